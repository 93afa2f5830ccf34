"""Elastic restarts (issue 28): the layout a run takes on a world its config does not fit.

- :func:`moe_fold.elastic.choose_layout`, table-driven: the configured layout when it fits,
  else the first ``parallel.elastic_layouts`` entry that fits, else the largest ep <=
  parallel.ep that fits (tp, cp, pp, etp kept); the global batch kept (micro-batches per
  step follow dp); an error naming each candidate when nothing fits.
- Without ``parallel.elastic`` a world the layout does not fit fails as before; the new
  keys' rules.
- ``moe-fold train`` says and logs the layout it took (one process, ep=2 config).
- :func:`moe_fold.launch.agree_on_round`: every rank of a start gets the same number, unlike
  any earlier start's, whatever keys the earlier starts left in the store.

The two-agent torchrun test (a node lost for good, then back) is in tests/training/test_stop.py.
"""

from __future__ import annotations

import datetime
import json
import threading
import time

import pytest
import torch.distributed as dist

from moe_fold.cli import main
from moe_fold.config import ConfigError, load_config, validate
from moe_fold.elastic import choose_layout
from moe_fold.launch import agree_on_round

from tests.training.test_reliability import overrides

# mixtral-tiny: 8 experts; a global batch of 8 samples, micro-batches of 1.
BASE = ["parallel.elastic=true", "train.global_batch_size=8", "train.micro_batch_size=1"]


def _config(*extra: str):
    return load_config("mixtral-tiny", [*BASE, *extra])


# (overrides, world) -> (rule, tp, dp, ep, etp, edp, micro-batches per step)
CHOICES = [
    # The configured layout fits: kept, also on a world that grew past it (dp grows).
    (["parallel.ep=4"], 4, ("configured", 1, 4, 4, 1, 1, 2)),
    (["parallel.ep=4"], 8, ("configured", 1, 8, 4, 1, 2, 1)),
    # Fewer ranks than ep: the largest ep that fits; micro-batches per step follow dp.
    (["parallel.ep=4"], 2, ("largest ep", 1, 2, 2, 1, 1, 4)),
    (["parallel.ep=4"], 1, ("largest ep", 1, 1, 1, 1, 1, 8)),
    (["parallel.ep=8"], 4, ("largest ep", 1, 4, 4, 1, 1, 2)),
    # ep must divide moe.num_experts (6): not 4 nor 3 on 4 ranks (3 does not divide 4), so 2.
    (["parallel.ep=6", "moe.num_experts=6"], 4, ("largest ep", 1, 4, 2, 1, 2, 2)),
    # tp and etp are kept: tp2 (sequence parallel), experts fold over tp*dp: ep2 on 2 ranks.
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.etp=1", "parallel.ep=4"], 2,
     ("largest ep", 2, 1, 2, 1, 1, 8)),
    # etp=tp=2: ep*etp must divide the world, so 2 ranks leave ep1.
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2"], 2, ("largest ep", 2, 1, 1, 2, 1, 8)),
    # The user's list: its first entry that fits, not the rule's answer (ep2).
    (["parallel.ep=4", "parallel.elastic_layouts=['ep=8', 'ep=1']"], 2, ("elastic_layouts[1]", 1, 2, 1, 1, 2, 4)),
    (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=4", "parallel.etp=1",
      "parallel.elastic_layouts=['tp=1,ep=2']"], 2, ("elastic_layouts[0]", 1, 2, 2, 1, 1, 4)),
]


@pytest.mark.parametrize("extra, world, expected", CHOICES, ids=[f"{' '.join(c[0])} world{c[1]}" for c in CHOICES])
def test_choose_layout(extra, world, expected):
    choice = choose_layout(_config(*extra), world)
    sizes = choice.sizes()
    assert (choice.rule, sizes["tp"], sizes["dp"], sizes["ep"], sizes["etp"], sizes["edp"],
            sizes["micro_batches"]) == expected
    validate(choice.config, world)  # the chosen config is one the run accepts
    config = _config(*extra)
    assert (choice.config.train, choice.config.moe) == (config.train, config.moe)  # the global batch kept
    assert (choice.config.parallel.cp, choice.config.parallel.pp) == (config.parallel.cp, config.parallel.pp)
    # Never silent: the reason names the world, the rule and the sizes; the record carries them.
    assert f"world_size={world}" in choice.reason and f"ep={sizes['ep']}" in choice.reason
    if choice.rule != "configured":
        assert choice.reason.startswith(f"world_size={world}: the configured layout")
        assert "does not fit" in choice.reason
        assert choice.rejected and choice.rejected[0].startswith("configured (")
    record = choice.record()
    assert record["rule"] == choice.rule and record["world_size"] == world and record["ep"] == sizes["ep"]
    json.dumps(record)


@pytest.mark.parametrize("extra, world, lines", [
    # 6 ranks: ep 2 and 1 fit the experts, but 8 samples do not split over dp 6.
    (["parallel.ep=8"], 6, ["configured (tp=1 cp=1 pp=1 ep=8 etp=1): world_size=6 is not divisible by "
                            "parallel.etp*ep*pp=8",
                            "largest ep (tp=1 cp=1 pp=1 ep=2 etp=1): train.global_batch_size=8 is not divisible by "
                            "train.micro_batch_size*dp=6"]),
    # A copy of an expert needs another ep rank: ep1 breaks moe.replicas.
    (["parallel.ep=2", "moe.replicas=1"], 1, ["largest ep (tp=1 cp=1 pp=1 ep=1 etp=1): moe.replicas=1 needs "
                                              "parallel.ep > 1"]),
    (["parallel.ep=4", "parallel.elastic_layouts=['ep=8']"], 2,
     ["nor any parallel.elastic_layouts entry", "elastic_layouts[0] (tp=1 cp=1 pp=1 ep=8 etp=1): world_size=2 is "
                                                "not divisible by parallel.etp*ep*pp=8"]),
], ids=["batch", "replicas", "list"])
def test_no_layout_fits_names_each_candidate_and_its_rule(extra, world, lines):
    with pytest.raises(ConfigError) as info:
        choose_layout(_config(*extra), world)
    text = str(info.value)
    assert f"parallel.elastic=true: no layout fits world_size={world}" in text
    for line in lines:
        assert line in text


def test_without_elastic_a_world_the_layout_does_not_fit_fails_as_before():
    config = load_config("mixtral-tiny", ["parallel.ep=4"])
    with pytest.raises(ConfigError, match=r"world_size=2 is not divisible by parallel.etp\*ep\*pp=4"):
        validate(config, 2)
    with pytest.raises(ConfigError, match="needs parallel.elastic=true"):
        choose_layout(config, 2)


@pytest.mark.parametrize("extra, message", [
    (["parallel.elastic_layouts=['ep=2']"], "parallel.elastic_layouts=[ep=2] needs parallel.elastic=true"),
    (["parallel.elastic=true", "parallel.elastic_layouts=['ep=2', 'dp=2']"],
     "parallel.elastic_layouts[1]=dp=2: 'dp=2' must be name=size with a name of tp, cp, pp, ep, etp"),
    (["parallel.elastic=true", "parallel.elastic_layouts=['ep=0']"], "parallel.elastic_layouts[0]=ep=0: 'ep=0'"),
    (["parallel.elastic=true", "parallel.elastic_layouts=['ep=2,ep=4']"], "'ep=4' must be name=size"),
    (["parallel.elastic=true", "parallel.elastic_layouts=['ep']"], "parallel.elastic_layouts[0]=ep: 'ep' must be"),
])
def test_elastic_keys_rules(extra, message):
    with pytest.raises(ConfigError) as info:
        validate(load_config("mixtral-tiny", extra), 1)
    assert message in str(info.value)


def test_train_says_and_logs_the_layout_it_took(tmp_path, cache_dir, capsys):
    """One process, a config for ep=2: without parallel.elastic it stops before any work
    (exit 2, the rule); with it, it trains on ep=1, says why, and logs it in elastic.jsonl."""
    run_dir = tmp_path / "run"
    args = ["train", "--config", "mixtral-tiny", "--no-progress",
            *[a for v in overrides(run_dir, cache_dir, "parallel.ep=2", "train.steps=1") for a in ("--set", v)]]
    assert main(args) == 2
    assert "world_size=1 is not divisible by parallel.etp*ep*pp=2" in capsys.readouterr().err
    assert not (run_dir / "elastic.jsonl").exists()
    assert main(args + ["--set", "parallel.elastic=true"]) == 0
    out = " ".join(capsys.readouterr().out.split())
    assert ("elastic layout: world_size=1: the configured layout (tp=1 cp=1 pp=1 ep=2 etp=1) does not fit "
            "(world_size=1 is not divisible by parallel.etp*ep*pp=2") in out
    assert "took largest ep (tp=1 cp=1 pp=1 ep=1 etp=1)" in out
    (record,) = [json.loads(line) for line in (run_dir / "elastic.jsonl").read_text().splitlines()]
    assert (record["world_size"], record["rule"], record["ep"], record["dp"], record["micro_batches"]) == (
        1, "largest ep", 1, 1, 2)
    assert "ep: 1" in (run_dir / "config.yaml").read_text()  # what ran is what the run folder says


# --------------------------------------------------------------------------- agree_on_round

def _start(store_port: int, world: int, delays: dict[int, float]) -> list:
    """One start of ``world`` ranks (threads, each with its own store client); ``delays``
    holds some ranks back, so rank 0 sees what earlier starts left first."""
    got: list = [None] * world

    def rank_main(rank):
        time.sleep(delays.get(rank, 0.0))
        store = dist.TCPStore("127.0.0.1", store_port, is_master=False, timeout=datetime.timedelta(seconds=10))
        try:
            got[rank] = agree_on_round(store, rank, world, datetime.timedelta(seconds=10))
        except Exception as e:  # noqa: BLE001 (reported below)
            got[rank] = e

    threads = [threading.Thread(target=rank_main, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    return got


def test_agree_on_round_gives_each_start_its_own_number_despite_stale_keys():
    server = dist.TCPStore("127.0.0.1", 0, is_master=True, wait_for_workers=False,
                           timeout=datetime.timedelta(seconds=10))
    assert _start(server.port, 4, {}) == [1, 1, 1, 1]
    # A start whose rank 1 died before it asked: its rank 0 drew a number, and the store
    # keeps a nonce rank 1 of the start before left.
    server.add("moe-fold/round", 1)
    # The next start, a smaller world (a node gone), rank 1 slow: rank 0 finds old nonces first.
    assert _start(server.port, 2, {1: 0.5}) == [3, 3]
    # The node is back; its ranks (2, 3) never saw this store's counter.
    assert _start(server.port, 4, {2: 0.3, 3: 0.3}) == [4, 4, 4, 4]
