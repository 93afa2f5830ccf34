"""Sampling (``moe-fold sample``, :mod:`moe_fold.models.sampling`) and the exported
tokenizer: the cached decode equals a full forward, every layout samples the same tokens
as one process, and transformers' ``AutoTokenizer`` + ``generate`` on the exported folder
give the tokens ``moe-fold sample`` gives (byte and BPE tokenizers, on trained checkpoints).
"""

from __future__ import annotations

import random
import warnings
from pathlib import Path

import pytest
import torch

from moe_fold.cli import main
from moe_fold.cli.sample import sample_config, sample_on_rank
from moe_fold.config import load_config
from moe_fold.data.hf_tokenizer import hf_byte_tokenizer, prompt_ids
from moe_fold.data.tokenizer import ByteTokenizer, load_tokenizer, train_bpe
from moe_fold.launch import run_ranks
from moe_fold.layout import ProcessGroups
from moe_fold.models.kv_cache import KVCache
from moe_fold.models.model import build_model
from moe_fold.models.sampling import forward_cached, generate, next_token
from moe_fold.training.train import train

SMALL = [
    "model.hidden_size=64", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
    "model.seq_length=64", "moe.ffn_hidden_size=64", "train.micro_batch_size=4", "train.global_batch_size=8",
    "optimizer.lr=1e-2", "optimizer.warmup_steps=1", "wandb.mode=disabled", "parallel.ep=1",
]
PROMPT = "def main("
GREEDY = dict(max_new_tokens=24, temperature=0.0, top_k=0, top_p=1.0, seed=0)
SAMPLED = dict(max_new_tokens=24, temperature=1.0, top_k=50, top_p=0.95, seed=7)


def _train_run(run_dir: Path, cache: Path, *extra: str) -> Path:
    config = load_config("mixtral-tiny", SMALL + ["train.steps=12", "train.save_every=12", f"train.run_dir={run_dir}",
                                                  f"data.cache_dir={cache}", *extra])
    return Path(train(config, progress=False).checkpoint)


@pytest.fixture(scope="module")
def byte_run(tmp_path_factory) -> Path:
    """A checkpoint trained 12 steps on the demo corpus with the byte tokenizer."""
    root = tmp_path_factory.mktemp("byte_run")
    return _train_run(root / "run", root / "cache")


@pytest.fixture(scope="module")
def bpe_run(tmp_path_factory) -> Path:
    """A checkpoint trained 12 steps on a small corpus with a BPE tokenizer trained on it."""
    root = tmp_path_factory.mktemp("bpe_run")
    src = root / "src"
    src.mkdir()
    for i in range(40):
        (src / f"f{i:02d}.py").write_text(f"def function_{i}(x):\n    return x * {i} + 'héllo wörld'\n" * 4)
    tok = train_bpe([src], 320, root / "tok" / "tokenizer.json")
    assert tok.vocab_size <= 320
    return _train_run(root / "run", root / "cache", f"data.path={src}", f"data.tokenizer={root / 'tok'}",
                      "model.vocab_size=320")


@pytest.fixture(scope="module")
def gpt_oss_run(tmp_path_factory) -> Path:
    """gpt-oss-tiny trained 12 steps from the command line on 2 ranks (ep 2): sinks, a
    sliding window shorter than the prompt plus the new tokens, biased experts."""
    root = tmp_path_factory.mktemp("gpt_oss_run")
    sets = [f"train.run_dir={root / 'run'}", f"data.cache_dir={root / 'cache'}", "model.num_layers=2",
            "model.local_attention_layers=[1, 0]", "model.sliding_window=8", "model.seq_length=64",
            "train.micro_batch_size=4", "train.global_batch_size=8", "optimizer.lr=1e-2", "optimizer.warmup_steps=1",
            "wandb.mode=disabled", "parallel.ep=2", "train.steps=12", "train.save_every=12"]
    argv = ["train", "--config", "gpt-oss-tiny", "--nproc", "2", "--no-progress"]
    assert main(argv + [arg for value in sets for arg in ("--set", value)]) == 0
    return root / "run" / "checkpoints" / "step_000012"


def _ours(checkpoint: Path, spec: str, options: dict, nproc: int = 1, layout: tuple[str, ...] = ()) -> list[list[int]]:
    """The tokens ``moe-fold sample`` generates, per rank."""
    config = sample_config(load_config(checkpoint / "config.yaml", list(layout)), nproc)
    prompt = prompt_ids(load_tokenizer(spec), PROMPT)
    args = (str(checkpoint), config, prompt, options, spec, False)
    if nproc == 1:
        return [sample_on_rank(0, 1, *args)]
    return run_ranks(sample_on_rank, nproc, *args, timeout=300)


# --------------------------------------------------------------------------- the KV cache

# DSA keeps 5 keys per query (of up to 16); GLM-5's second layer reuses the first's selection.
DSA_SETTINGS = {"deepseek-v32-tiny": ["model.index_topk=5"],
                "glm-5-tiny": ["model.index_topk=5", "model.indexer_types=[full, shared]"]}


@pytest.mark.parametrize("preset", ["mixtral-tiny", "qwen2-moe-tiny", "qwen3-moe-tiny", "deepseek-v3-tiny",
                                    "deepseek-v32-tiny", "glm-5-tiny"])
def test_cached_decode_equals_full_forward(preset):
    """Prefill 7 tokens, then one at a time: the logits equal one forward over the whole
    sequence (DSA: the cache holds the indexer keys too, and a decode step selects the keys
    the full forward's row selects, ties included)."""
    torch.manual_seed(0)
    # float64 throughout (the router too), so that only a real difference shows.
    config = load_config(preset, ["parallel.ep=1", "model.num_layers=2", "moe.router_dtype=float64",
                                  *DSA_SETTINGS.get(preset, [])])
    model = build_model(config, ProcessGroups.single_process()).double().eval()
    ids = torch.randint(0, 256, (2, 16))
    with torch.no_grad():
        full = model.logits(ids)  # [2, 16, V]
    cache = KVCache([0, 1])
    steps = [forward_cached(model, ids[:, :7], cache)] + [forward_cached(model, ids[:, t:t + 1], cache)
                                                          for t in range(7, 16)]
    assert cache.length == 16 and cache[1].keys.shape[2] == 16
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("tp", [1, 2])
def test_cached_decode_equals_full_forward_with_gated_deltanet(tp):
    """Qwen3-Next's layers (Gated DeltaNet, gated attention): prefill 7 tokens, then 2, then one
    at a time; the conv window and recurrent state carried in the cache give the logits of one
    forward over the whole sequence (float64). Under tp2 with sequence parallel a step of an
    odd count is padded: the state must not take the padding in."""
    args = ("qwen3-next-tiny", ["model.num_layers=4", "moe.router_dtype=float64", "model.linear_chunk_size=4"])
    if tp == 1:
        _gated_deltanet_decode(0, 1, args, tp)
    else:
        run_ranks(_gated_deltanet_decode, 2, args, tp, timeout=240)


@pytest.mark.parametrize("tp", [1, 2])
def test_cached_decode_equals_full_forward_with_mamba2(tp):
    """Nemotron-H's layers (Mamba2, MoE, attention without rotary, one mixer each): the conv
    window and SSM state carried in the cache give the logits of one forward (float64),
    also under tp2 with sequence parallel, where a padded step must not reach the state."""
    args = ("nemotron-h-tiny", ["model.num_layers=4", "model.layer_types=[mamba2, moe, mamba2, attention]",
                                "model.rope_layers=[0, 0, 0, 0]", "moe.router_dtype=float64",
                                "model.mamba_chunk_size=4"])
    if tp == 1:
        _gated_deltanet_decode(0, 1, args, tp)
    else:
        run_ranks(_gated_deltanet_decode, 2, args, tp, timeout=240)


def _gated_deltanet_decode(rank, world_size, args, tp):
    from moe_fold.layout import ParallelLayout, create_process_groups

    sets = args[1] + ["parallel.ep=1", f"parallel.tp={tp}", f"parallel.sequence_parallel={str(tp > 1).lower()}"]
    config = load_config(args[0], sets)
    groups = (ProcessGroups.single_process() if world_size == 1
              else create_process_groups(ParallelLayout(world_size, tp=tp)))
    torch.manual_seed(0)
    model = build_model(config, groups).double().eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model.logits(ids)  # [2, 16, V]
    cache = KVCache(list(range(4)))
    cuts = [0, 7, 9] + list(range(10, 17))
    steps = [forward_cached(model, ids[:, a:b], cache) for a, b in zip(cuts[:-1], cuts[1:])]
    assert cache.length == 16 and cache[0].state is not None and cache[3].keys.shape[2] == 16
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)


def test_generate_greedy_is_argmax_of_full_forward_routing_new_tokens_only():
    torch.manual_seed(0)
    model = build_model(load_config("mixtral-tiny", ["parallel.ep=1", "model.num_layers=2"]),
                        ProcessGroups.single_process()).double()
    prompt = torch.randint(0, 256, (1, 5))
    routed = []  # the tokens each MoE layer-0 call routes: the prompt once, then one per step
    model.layers[0].mlp.router.register_forward_hook(lambda m, args, out: routed.append(args[0].shape[0]))
    out = generate(model, prompt, 8)
    assert routed == [5] + [1] * 7
    seq = torch.cat([prompt, out], dim=1)
    with torch.no_grad():
        logits = model.logits(seq[:, :-1])
    assert out[0].tolist() == logits[0, 4:].argmax(-1).tolist()


def test_next_token_rules():
    logits = torch.tensor([[0.0, 3.0, 2.0, 1.0, -1.0]])
    assert next_token(logits).tolist() == [1]
    draws = lambda **kw: {next_token(logits, torch.Generator().manual_seed(s), **kw).item() for s in range(200)}
    assert draws(temperature=1.0, top_k=1) == {1}
    assert draws(temperature=1.0, top_k=2) == {1, 2}
    # softmax probs ~ [.03, .64, .24, .09, .01]: top_p=0.8 keeps the tokens before the mass reaches 0.8.
    assert draws(temperature=1.0, top_p=0.8) == {1, 2}
    assert draws(temperature=1.0, top_p=0.5) == {1}
    assert draws(temperature=1.0) == {0, 1, 2, 3, 4}
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert [next_token(logits, g1, temperature=2.0).item() for _ in range(20)] == \
           [next_token(logits, g2, temperature=2.0).item() for _ in range(20)]
    with pytest.raises(ValueError, match="top_p=0 in"):
        next_token(logits, temperature=1.0, top_p=0)


# --------------------------------------------------------------------------- layouts

@pytest.mark.parametrize("nproc, layout", [
    (2, ("parallel.ep=2",)),
    (2, ("parallel.tp=2", "parallel.sequence_parallel=true")),
    (4, ("parallel.pp=2", "parallel.ep=2")),
], ids=["ep2", "tp2-sp", "pp2-ep2"])
def test_layouts_sample_what_one_process_samples(byte_run, nproc, layout):
    for options in (GREEDY, SAMPLED):
        one = _ours(byte_run, "byte", options)[0]
        ranks = _ours(byte_run, "byte", options, nproc, layout)
        assert all(r == one for r in ranks), (options, one, ranks)
    assert len(set(_ours(byte_run, "byte", SAMPLED)[0])) > 3  # a sample, not a constant


# --------------------------------------------------------------------------- export

def test_byte_tokenizer_json_is_the_byte_tokenizer():
    from tokenizers import Tokenizer

    tok = Tokenizer.from_str(hf_byte_tokenizer().to_str())  # through its JSON
    ours = ByteTokenizer()
    texts = ["hello", "", "  tabs\tand\nnewlines\r\n", "héllo wörld → 世界 🎉", "\x00\x01\x7f\xad\xa0 \u2028"]
    for text in texts:
        assert tok.encode(text).ids == prompt_ids(ours, text)
        assert tok.decode(tok.encode(text).ids) == text
    rng = random.Random(0)
    for _ in range(500):  # any ids, cut characters and special tokens included
        ids = [rng.randrange(258) for _ in range(rng.randrange(1, 16))]
        assert tok.decode(ids) == ours.decode(ids), ids


@pytest.mark.parametrize("which", ["byte", "bpe", "gpt_oss"])
def test_exported_model_generates_what_sample_gives(which, request, tmp_path):
    """convert -> AutoTokenizer + AutoModelForCausalLM.generate: the same prompt ids, the
    same greedy tokens (and logits) as ``moe-fold sample``, the same decoded text (for
    gpt_oss: a GptOssForCausalLM, its sliding window and sinks included)."""
    transformers = pytest.importorskip("transformers")
    checkpoint = request.getfixturevalue(f"{which}_run")
    spec = load_config(checkpoint / "config.yaml").data.tokenizer
    out = tmp_path / "hf"
    assert main(["convert", str(checkpoint), str(out), "--no-progress"]) == 0
    assert {"tokenizer.json", "tokenizer_config.json", "generation_config.json"} <= {p.name for p in out.iterdir()}
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(out)
    ours_tok = load_tokenizer(spec)
    enc = tokenizer(PROMPT, return_tensors="pt")
    assert enc["input_ids"][0].tolist() == prompt_ids(ours_tok, PROMPT)
    hf = model.generate(**enc, max_new_tokens=GREEDY["max_new_tokens"], do_sample=False, output_logits=True,
                        return_dict_in_generate=True)
    new = hf.sequences[0, enc["input_ids"].shape[1]:].tolist()
    ours = _ours(checkpoint, spec, GREEDY)[0]
    assert new == ours
    assert tokenizer.decode(new, skip_special_tokens=True) == ours_tok.decode(ours)
    # The logits of every step, not just their argmax: ours from one forward over the sequence.
    config = sample_config(load_config(checkpoint / "config.yaml"), 1)
    mine = build_model(config, ProcessGroups.single_process())
    from moe_fold.training.checkpoint import load_checkpoint

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_checkpoint(checkpoint, mine, None, None, mine.groups)
    with torch.no_grad():
        logits = mine.logits(hf.sequences[:, :-1])[0, enc["input_ids"].shape[1] - 1:]  # [new, V]
    torch.testing.assert_close(torch.cat(hf.logits), logits, rtol=1e-4, atol=1e-4)


# --------------------------------------------------------------------------- the command

def test_sample_command_streams_the_text(byte_run, capsys):
    expected = PROMPT + ByteTokenizer().decode(_ours(byte_run, "byte", GREEDY)[0]) + "\n"
    assert main(["sample", str(byte_run.parent.parent), "--prompt", PROMPT, "--max-new-tokens", "24"]) == 0
    assert capsys.readouterr().out == expected
    # One process ignores the layout a checkpoint was trained in (the quick start's ep 2).
    assert main(["sample", str(byte_run), "--prompt", PROMPT, "--max-new-tokens", "24", "--set", "parallel.ep=2"]) == 0
    assert capsys.readouterr().out == expected


@pytest.mark.parametrize("args, message", [
    (["--set", "parallel.cp=2", "--nproc", "2"], "parallel.cp=2: sampling runs without context parallel"),
    (["--set", "parallel.ep=3", "--nproc", "3"], "moe.num_experts=8 is not divisible by parallel.ep=3"),
    (["--top-p", "0"], "--top-p=0.0 must be in (0, 1]"),
    (["--temperature", "-1"], "--temperature=-1.0 must be >= 0 (0: greedy)"),
    (["--tokenizer", "nowhere.json"], "--tokenizer=nowhere.json: tokenizer file nowhere.json not found"),
])
def test_sample_refuses_before_spawning(byte_run, capsys, args, message):
    assert main(["sample", str(byte_run), "--prompt", "x", *args]) == 2
    assert message in capsys.readouterr().err


def test_convert_tokenizer_choices(byte_run, bpe_run, tmp_path, capsys):
    """--tokenizer names another one; one that cannot be the model's is refused before any
    work; a run whose data.tokenizer is gone exports the model and says why no tokenizer came."""
    out = tmp_path / "hf"
    assert main(["convert", str(byte_run), str(out), "--no-progress", "--tokenizer", "nowhere.json"]) == 2
    assert "--tokenizer=nowhere.json: tokenizer file nowhere.json not found" in capsys.readouterr().err
    assert not out.exists()
    # The tokenizer folder really gone (the checkpoint itself untouched: its config.yaml is
    # checksummed like every file it holds), then put back for the module's other tests.
    tokenizer = Path(load_config(bpe_run / "config.yaml").data.tokenizer)
    aside = tmp_path / "tokenizer-aside"
    tokenizer.rename(aside)
    try:
        assert main(["convert", str(bpe_run), str(out), "--no-progress"]) == 0
        assert "warning: no tokenizer written (data.tokenizer=" in capsys.readouterr().err
        assert (out / "model.safetensors").is_file() and not (out / "tokenizer.json").exists()
        assert main(["convert", str(bpe_run), str(out), "--no-progress", "--tokenizer", str(aside)]) == 0
    finally:
        aside.rename(tokenizer)
    assert (out / "tokenizer.json").is_file()
