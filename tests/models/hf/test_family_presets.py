"""The CPU-sized twins of the DeepSeek-V2-Lite, ERNIE-4.5-MoE, MiniMax-M2, Qwen3-Next, Qwen3.5, Kimi-Linear,
LongCat-Flash, DeepSeek-V3.2, GLM-5 and Nemotron-H presets:
each trains from the command line, converts to a Hugging Face folder of its family that
transformers' ``AutoTokenizer`` and ``AutoModelForCausalLM`` load, and ``generate`` gives
the greedy tokens ``moe-fold sample`` gives (and the same logits at every step)."""

from __future__ import annotations

import json
import warnings

import pytest
import torch

from moe_fold.cli import main
from moe_fold.config import load_config
from moe_fold.layout import ProcessGroups
from moe_fold.models.kv_cache import KVCache
from moe_fold.models.model import build_model
from moe_fold.models.sampling import forward_cached
from tests.models.test_sampling import GREEDY, PROMPT, _ours

# preset (@ the family `convert --family` names, where not the one inferred) -> the Hugging
# Face class its export loads as. Qwen3.5's twin is Qwen3-Next's, written as Qwen3.5.
FAMILIES = {"deepseek-v2-lite-tiny": "DeepseekV2ForCausalLM", "ernie-4.5-tiny": "Ernie4_5_MoeForCausalLM",
            "minimax-m2-tiny": "MiniMaxM2ForCausalLM", "qwen3-next-tiny": "Qwen3NextForCausalLM",
            "qwen3-next-tiny@qwen3_5_moe": "Qwen3_5MoeForCausalLM", "kimi-linear-tiny": "KimiLinearForCausalLM",
            "longcat-flash-tiny": "LongcatFlashForCausalLM", "deepseek-v32-tiny": "DeepseekV32ForCausalLM",
            "glm-5-tiny": "GlmMoeDsaForCausalLM", "nemotron-h-tiny": "NemotronHForCausalLM"}
# A preset's own settings beside SMALL's: its layer types (and NoPE flags) for SMALL's 3 layers.
OWN = {"qwen3-next-tiny": ["model.layer_types=[gated_deltanet, attention, gated_deltanet]"],
       "kimi-linear-tiny": ["model.layer_types=[kda, attention, kda]", "model.rope_layers=[0, 0, 0]"],
       "glm-5-tiny": ["model.indexer_types=[full, shared, full]"],
       "nemotron-h-tiny": ["model.num_layers=4", "model.layer_types=[mamba2, moe, attention, mlp]",
                           "model.rope_layers=[0, 0, 0, 0]"]}

SMALL = ["model.num_layers=3", "model.seq_length=32", "train.steps=6", "train.save_every=6", "parallel.ep=1",
         "optimizer.warmup_steps=1", "wandb.mode=disabled", "train.micro_batch_size=2", "train.global_batch_size=4"]


@pytest.mark.parametrize("twin", list(FAMILIES))
def test_trained_twin_exports_and_generates_what_sample_gives(twin, tmp_path):
    transformers = pytest.importorskip("transformers")
    preset, _, family = twin.partition("@")
    run = tmp_path / "run"
    settings = [f"train.run_dir={run}", f"data.cache_dir={tmp_path / 'cache'}", *SMALL, *OWN.get(preset, [])]
    assert main(["train", "--config", preset, *[a for s in settings for a in ("--set", s)]]) == 0
    checkpoint = max((run / "checkpoints").glob("step_*"))
    out = tmp_path / "hf"
    assert main(["convert", str(checkpoint), str(out), "--no-progress", *(["--family", family] if family else [])]) == 0
    assert json.loads((out / "config.json").read_text())["architectures"] == [FAMILIES[twin]]
    tokenizer = transformers.AutoTokenizer.from_pretrained(out)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        model = transformers.AutoModelForCausalLM.from_pretrained(out, experts_implementation="eager")
    assert type(model).__name__ == FAMILIES[twin]
    enc = tokenizer(PROMPT, return_tensors="pt")
    hf = model.generate(**enc, max_new_tokens=GREEDY["max_new_tokens"], do_sample=False, output_logits=True,
                        return_dict_in_generate=True)
    new = hf.sequences[0, enc["input_ids"].shape[1]:].tolist()
    assert new == _ours(checkpoint, "byte", GREEDY)[0]
    # The logits of every step, not just their argmax: ours from one forward over the sequence.
    from moe_fold.cli.sample import sample_config
    from moe_fold.training.checkpoint import load_checkpoint

    mine = build_model(sample_config(load_config(checkpoint / "config.yaml"), 1), ProcessGroups.single_process())
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        load_checkpoint(checkpoint, mine, None, None, mine.groups)
    prompt = enc["input_ids"].shape[1]
    with torch.no_grad():
        logits = mine.eval().logits(hf.sequences[:, :-1])[0, prompt - 1:]  # [new, V]
    torch.testing.assert_close(torch.cat(hf.logits), logits, rtol=1e-4, atol=1e-4)
    # And through the KV cache `moe-fold sample` decodes with: the prompt, then a token at a time.
    cache = KVCache(list(range(mine.config.model.num_layers)))
    seq = hf.sequences[:, :-1]
    with torch.no_grad():
        steps = [forward_cached(mine, seq[:, :prompt], cache)[:, -1:]] + [
            forward_cached(mine, seq[:, t:t + 1], cache) for t in range(prompt, seq.shape[1])]
    torch.testing.assert_close(torch.cat(hf.logits), torch.cat(steps, dim=1)[0], rtol=1e-4, atol=1e-4)
