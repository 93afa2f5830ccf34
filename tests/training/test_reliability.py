"""Reliability (issue 11): faults provoked for real, and what the project does about them.

- A rank of ``moe-fold train --nproc 2`` killed with SIGKILL from outside: the run stops
  with an error naming the dead rank, well within ``parallel.timeout_s``; ``--resume``
  then reaches the losses of an uninterrupted run bit for bit (deterministic mode).
- A rank that hangs (asleep, or SIGSTOP from outside): its peers give up after the
  process group's timeout (``parallel.timeout_s``) and the report names the silent rank.
- A training process killed with SIGKILL inside ``save_checkpoint`` (stopped there by a
  wrapper script, not by a flag of the code): the previous checkpoint stays the latest
  and loads; the partial directory is ignored with a message and removed by the next save.
- Two runs of one config give bit-identical metrics and checkpoint bytes, on 4 ranks too
  when the second run's collectives, checkpoint writer and heap are perturbed.

docs/reliability.md lists every fault with the test that proves it (some live in
tests/training/test_checkpoint.py, tests/data/test_indexed_dataset.py, tests/config/test_load.py, tests/models/hf/test_importer.py, tests/core/test_launch.py,
tests/dispatch/test_dispatcher.py and test_reliability_*.py).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import json
import logging
import os
import random
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest
import torch

from moe_fold.launch import run_ranks
from moe_fold.training.checkpoint import CheckpointSaver, latest_checkpoint, load_checkpoint
from moe_fold.config import load_config
from moe_fold.layout import ProcessGroups
from moe_fold.models.model import build_model
from moe_fold.training.optim import build_optimizer, build_scheduler
from moe_fold.training.train import read_metrics, train

# A small Mixtral-style model (2 MoE layers of 8 experts, top-2), a constant learning rate
# so that train.steps changes nothing but where a run ends.
SMALL = [
    "model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.ffn_hidden_size=64", "model.seq_length=16", "moe.ffn_hidden_size=32",
    "train.micro_batch_size=2", "train.global_batch_size=4", "train.save_every=1", "train.keep_last=3",
    "train.deterministic=true", "optimizer.schedule=constant", "optimizer.warmup_steps=0",
    "wandb.mode=disabled", "parallel.ep=1",
]
from tests.helpers.paths import REPO as ROOT


def overrides(run_dir, cache_dir, *extra) -> list[str]:
    return SMALL + [f"train.run_dir={run_dir}", f"data.cache_dir={cache_dir}", *extra]


def small_config(run_dir, cache_dir, *extra):
    return load_config("mixtral-tiny", overrides(run_dir, cache_dir, *extra))


def _env() -> dict:
    # As many threads as this test process (conftest: MOE_FOLD_TEST_THREADS, default 1, as
    # the ranks of --nproc 2 get on 2 cores): a run compared bit for bit with one made here
    # must take the same sums.
    return {**os.environ, "OMP_NUM_THREADS": str(torch.get_num_threads()), "PYTHONUNBUFFERED": "1"}


def _losses(run_dir) -> list[tuple[int, float]]:
    return [(r["step"], r["loss"]) for r in read_metrics(run_dir)]


def _wait_for(condition, timeout: float, what: str, proc: subprocess.Popen) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        if proc.poll() is not None:
            out, err = proc.communicate()
            raise AssertionError(f"the process ended (code {proc.returncode}) before {what}:\n{out}\n{err}")
        if time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.02)


# --------------------------------------------------------------------------- a rank killed

def children(pid: int) -> list[int]:
    """The pids ``pid`` started (none once it is gone)."""
    try:
        return [int(c) for t in os.listdir(f"/proc/{pid}/task")
                for c in Path(f"/proc/{pid}/task/{t}/children").read_text().split()]
    except FileNotFoundError:
        return []


def descendants(pid: int) -> list[int]:
    out, todo = [], [pid]
    while todo:
        for child in children(todo.pop()):
            out.append(child)
            todo.append(child)
    return out


def holds_open(pid: int, path: Path) -> bool:
    """Whether process ``pid`` has ``path`` open (False once it is gone)."""
    fds = Path(f"/proc/{pid}/fd")
    try:
        return any(os.readlink(fds / fd) == str(path) for fd in os.listdir(fds))
    except (FileNotFoundError, ProcessLookupError):
        return False


def _rank_pids(cli_pid: int, metrics: Path) -> tuple[int, int]:
    """(rank 0, rank 1) of a 2-rank run: the rank processes are the forkserver's children,
    rank 0 the one that holds metrics.jsonl open."""
    writers = [p for p in descendants(cli_pid) if holds_open(p, metrics)]
    assert len(writers) == 1, writers
    siblings = [p for p in children(int(Path(f"/proc/{writers[0]}/stat").read_text().split()[3]))
                if p != writers[0]]
    assert len(siblings) == 1, siblings
    return writers[0], siblings[0]


def _cli(*args: str) -> list[str]:
    return [sys.executable, "-m", "moe_fold.cli", "train", "--config", "mixtral-tiny", "--no-progress", *args]


def _set(values: list[str]) -> list[str]:
    return [a for v in values for a in ("--set", v)]


def _two_ranks_past_a_checkpoint(run_dir: Path, cache_dir: Path, *settings: str):
    """`moe-fold train --nproc 2` with ``settings`` started, once its first checkpoint and
    metrics.jsonl exist: the launcher's process and the pids of ranks 0 and 1. A long
    schedule, so the run is surely still going when the test acts on a rank."""
    metrics = run_dir / "metrics.jsonl"
    proc = subprocess.Popen(_cli("--nproc", "2", *_set(overrides(run_dir, cache_dir, *settings, "train.steps=1000"))),
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    _wait_for(lambda: latest_checkpoint(run_dir) is not None and metrics.exists(), 240, "the first checkpoint", proc)
    return proc, _rank_pids(proc.pid, metrics)


@pytest.mark.slow
def test_killed_rank_stops_the_run_with_its_name_and_resume_is_exact(tmp_path, cache_dir):
    """SIGKILL to rank 1 of a 2-rank run (ep2): the parent exits with code 1 within
    parallel.timeout_s, naming rank 1 and its signal; --resume from the last checkpoint
    gives, step for step, the losses of an uninterrupted 2-rank run, bit for bit."""
    steps, timeout_s = 10, 30
    layout = ["parallel.ep=2", f"parallel.timeout_s={timeout_s}"]
    straight = subprocess.run(_cli("--nproc", "2", *_set(overrides(tmp_path / "straight", cache_dir, *layout,
                                                                   f"train.steps={steps}"))),
                              capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert straight.returncode == 0, straight.stderr

    run_dir = tmp_path / "killed"
    proc, (_, rank1) = _two_ranks_past_a_checkpoint(run_dir, cache_dir, *layout)
    os.kill(rank1, signal.SIGKILL)
    killed_at = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout_s)
    finally:
        proc.kill()
    waited = time.monotonic() - killed_at
    assert proc.returncode == 1, (out, err)
    assert waited < timeout_s
    message = " ".join(err.split())
    assert "error: training failed: rank 1 of 2 died with exit code -9 before returning a result" in message, err

    saved = int(latest_checkpoint(run_dir).name.removeprefix("step_"))
    assert 1 <= saved < steps, saved
    resumed = subprocess.run(_cli("--nproc", "2", "--resume",
                                  *_set(overrides(run_dir, cache_dir, *layout, f"train.steps={steps}"))),
                             capture_output=True, text=True, env=_env(), cwd=ROOT, timeout=300)
    assert resumed.returncode == 0, resumed.stderr
    assert f"resumed from {run_dir}/checkpoints/step_{saved:06d}" in " ".join(resumed.stdout.split())
    assert _losses(run_dir) == _losses(tmp_path / "straight")
    assert [s for s, _ in _losses(run_dir)] == list(range(1, steps + 1))


def _hang_on_rank_1(rank, world_size):
    import torch
    import torch.distributed as dist

    if rank == 1:
        time.sleep(600)
    dist.all_reduce(torch.ones(1))


def test_hung_rank_is_named_after_the_process_group_timeout():
    """Rank 1 sleeps; rank 0 waits in an all-reduce until the process group's timeout
    (5 s here), and the report names rank 1 as the one that stopped responding."""
    from moe_fold.launch import RankError

    begin = time.monotonic()
    with pytest.raises(RankError) as err:
        run_ranks(_hang_on_rank_1, 2, timeout=120, env={"MOE_FOLD_PG_TIMEOUT": "5"})
    assert err.value.rank == 1
    assert str(err.value).startswith("rank 1 of 2 stopped responding (alive, no result, no error) while rank 0 "
                                     "gave up waiting for it")
    assert time.monotonic() - begin < 60


@pytest.mark.slow
def test_stopped_rank_ends_the_run_within_parallel_timeout_s(tmp_path, cache_dir):
    """SIGSTOP to rank 1 of `moe-fold train --nproc 2`: rank 0 gives up after
    parallel.timeout_s, the run exits with code 1 naming rank 1, no process is left."""
    from moe_fold.data.loader import dataset_from_config

    timeout_s = 20
    run_dir = tmp_path / "run"
    dataset_from_config(small_config(run_dir, cache_dir))  # the corpus cached: no rank waits on it
    proc, (rank0, rank1) = _two_ranks_past_a_checkpoint(run_dir, cache_dir, "parallel.ep=2",
                                                        f"parallel.timeout_s={timeout_s}")
    os.kill(rank1, signal.SIGSTOP)
    stopped_at = time.monotonic()
    try:
        out, err = proc.communicate(timeout=timeout_s + 60)
    except subprocess.TimeoutExpired:
        for pid in (rank0, rank1, proc.pid):  # the ranks hold the output pipes open
            with contextlib.suppress(ProcessLookupError):  # one may have ended meanwhile
                os.kill(pid, signal.SIGKILL)
        out, err = proc.communicate()
        raise AssertionError(f"still running {timeout_s + 60} s after the stop:\n{out[-2000:]}\n{err[-4000:]}")
    waited = time.monotonic() - stopped_at
    assert proc.returncode == 1, (out, err)
    assert timeout_s - 1 < waited < timeout_s + 60
    message = " ".join(err.split())
    assert ("error: training failed: rank 1 of 2 stopped responding (alive, no result, no error) while rank 0 "
            "gave up waiting for it") in message, err
    assert f"Timed out waiting {timeout_s * 1000}ms" in message, err
    deadline = time.monotonic() + 10
    while any(Path(f"/proc/{p}").exists() and "Z" != Path(f"/proc/{p}/stat").read_text().split()[2]
              for p in (rank0, rank1)) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(Path(f"/proc/{p}").exists() and Path(f"/proc/{p}/stat").read_text().split()[2] != "Z"
                   for p in (rank0, rank1))


# --------------------------------------------------------------------------- killed inside a save

# Runs training in one process, stopping inside the save of step 3 (at the given call of
# a function of moe_fold.training.checkpoint) until it is killed; the code under test is not
# changed, only wrapped.
_STOP_IN_SAVE = textwrap.dedent("""
    import sys, time
    import moe_fold.training.checkpoint as ckpt
    from moe_fold.config import load_config
    from moe_fold.training.train import train

    point, call, marker, *overrides = sys.argv[1:]
    original = getattr(ckpt, point)
    calls = {"n": 0}

    def stop_here(*args, **kwargs):
        calls["n"] += 1
        if calls["n"] == int(call):
            open(marker, "w").close()
            time.sleep(600)
        return original(*args, **kwargs)

    setattr(ckpt, point, stop_here)
    train(load_config("mixtral-tiny", overrides))
""")


@pytest.mark.parametrize("point, call, partial", [
    # Once per save (the rank's done marker, in the background writer), after the shard
    # and the random states are written: no index.json yet.
    ("_write_json_atomic", 3, "rank_00000.safetensors"),
    # Twice per save (the new directory, then the renamed one): all written, not renamed.
    pytest.param("_fsync_dir", 5, "index.json", marks=pytest.mark.slow),
])
def test_kill_inside_a_save_keeps_the_previous_checkpoint(tmp_path, cache_dir, caplog, point, call, partial):
    run_dir = tmp_path / "run"
    marker = tmp_path / "inside_save"
    opts = overrides(run_dir, cache_dir, "train.steps=4")
    proc = subprocess.Popen([sys.executable, "-c", _STOP_IN_SAVE, point, str(call), str(marker), *opts],
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env(), cwd=ROOT)
    _wait_for(marker.exists, 240, f"the save of step 3 to reach {point}", proc)
    proc.send_signal(signal.SIGKILL)
    proc.communicate(timeout=60)
    assert proc.returncode == -signal.SIGKILL

    ckpts = run_dir / "checkpoints"
    names = sorted(p.name for p in ckpts.iterdir())
    assert names[:2] == ["step_000001", "step_000002"] and len(names) == 3, names
    leftover = ckpts / names[2]
    assert leftover.name.startswith("step_000003.tmp-") and (leftover / partial).is_file()
    with caplog.at_level(logging.WARNING, logger="moe_fold.training.checkpoint"):
        assert latest_checkpoint(run_dir) == ckpts / "step_000002"
    assert f"ignoring incomplete checkpoint directory {leftover}" in caplog.text
    config = small_config(run_dir, cache_dir, "train.steps=4")
    groups = ProcessGroups.single_process()
    model = build_model(config, groups)
    optimizer = build_optimizer(model, config.optimizer, groups)
    extra = load_checkpoint(run_dir, model, optimizer, build_scheduler(optimizer, config), groups)
    assert extra["step"] == 2  # every file of step 2 passed its size and sha256 check

    resumed = train(config, resume=True)
    assert resumed.first_step == 3
    assert not leftover.exists()  # the next save removed it
    straight = train(small_config(tmp_path / "straight", cache_dir, "train.steps=4"))
    assert _losses(run_dir) == _losses(tmp_path / "straight")
    assert resumed.losses == straight.losses[2:]


# --------------------------------------------------------------------------- determinism

def test_two_runs_give_identical_losses_and_weights(tmp_path, cache_dir):
    """train.deterministic: the same config twice (the same run folder, moved aside after
    the first run) gives the same metrics (every field but the timings) and
    byte-identical checkpoints: every file of the folder, hashed here, index.json included."""
    runs = []
    for name in ("a", "b"):
        train(small_config(tmp_path / "run", cache_dir, "train.steps=3", "moe.z_loss_coeff=0.001"))
        (tmp_path / "run").rename(tmp_path / name)
        records = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in read_metrics(tmp_path / name)]
        folder = tmp_path / name / "checkpoints" / "step_000003"
        files = {p.name: hashlib.sha256(p.read_bytes()).hexdigest() for p in sorted(folder.iterdir())}
        runs.append((records, files))
    (records_a, files_a), (records_b, files_b) = runs
    assert len(records_a) == 3 and records_a == records_b
    assert sorted(files_a) == ["config.yaml", "index.json", "rank_00000.safetensors", "rng_00000.json"]
    assert files_a == files_b


def _run_record(run_dir: Path) -> tuple[list[dict], dict[str, str]]:
    """A finished run's metrics (every field but the timings) and the sha256 of every file
    of its checkpoints, by path in the checkpoints folder."""
    records = [{k: v for k, v in r.items() if k != "tokens_per_s"} for r in read_metrics(run_dir)]
    folder = run_dir / "checkpoints"
    return records, {str(p.relative_to(folder)): hashlib.sha256(p.read_bytes()).hexdigest()
                     for p in sorted(folder.rglob("*")) if p.is_file()}


# The collectives a training step may post (the comm wrappers call them through the module).
_COLLECTIVES = ("all_reduce", "all_to_all_single", "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast",
                "all_gather", "all_gather_object", "batch_isend_irecv", "barrier")


def _train_rank(rank, world_size, config):
    return train(config)


def _train_perturbed_rank(rank, world_size, config, seed):
    """``train(config)`` with this rank's timing and memory addresses moved: every
    collective starts after a random delay of up to 10 ms (drawn per rank, so the ranks
    arrive in other orders), the asynchronous checkpoint writer starts up to 200 ms late
    (it overlaps other parts of the next step), and tensors of random sizes held for the
    run shift the addresses of the run's own allocations."""
    import torch.distributed as dist

    rng = random.Random(seed * 1009 + rank)

    def late(fn, most_s):
        @functools.wraps(fn)
        def call(*args, **kwargs):
            time.sleep(rng.random() * most_s)
            return fn(*args, **kwargs)
        return call

    for name in _COLLECTIVES:
        setattr(dist, name, late(getattr(dist, name), 0.01))
    CheckpointSaver._background = late(CheckpointSaver._background, 0.5)
    held = [torch.empty(rng.randint(1, 1 << 16)) for _ in range(rng.randint(1, 64))]
    result = train(config)
    del held
    return result


@pytest.mark.slow
def test_ranks_repeat_their_steps_bit_for_bit_whatever_the_timing(tmp_path, cache_dir):
    """train.deterministic on 4 ranks (dp 4 x ep 4: all-reduces, the MoE all-to-alls, an
    asynchronous save every step): a run whose collectives arrive in other orders, whose
    checkpoint writer runs late and whose tensors sit at other addresses
    (:func:`_train_perturbed_rank`) gives the plain run's metrics and the bytes of every
    file of its checkpoints."""
    opts = ["train.steps=3", "parallel.ep=4", "train.global_batch_size=8", "train.async_save=true"]
    run_ranks(_train_rank, 4, small_config(tmp_path / "run", cache_dir, *opts), timeout=300)
    (tmp_path / "run").rename(tmp_path / "plain")
    run_ranks(_train_perturbed_rank, 4, small_config(tmp_path / "run", cache_dir, *opts), 7, timeout=300)
    (records_a, files_a), (records_b, files_b) = _run_record(tmp_path / "plain"), _run_record(tmp_path / "run")
    assert [r["step"] for r in records_a] == [1, 2, 3] and records_a == records_b
    assert len([name for name in files_a if "/rank_" in name]) == 3 * 4  # steps 1-3 (keep_last=3), 4 ranks
    assert files_a == files_b
