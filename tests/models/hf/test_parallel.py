"""Hugging Face import and export under tp2, ep2 and tp2 x ep2 (etp 2) on gloo ranks:
each rank reads exactly its shard's elements from the safetensors files, the gathered
logits equal transformers' for the three families, and the export gathered from the
shards loads in transformers with the same logits."""

import pytest
import torch
import transformers

from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups

from tests.models.hf.test_importer import TOL, hf_logits, max_diff, save_hf, token_ids

# Qwen3 both ways: renormalised top-k; top-k of the full softmax with tied embeddings
# and a dense first layer.
FAMILY_CASES = ("mixtral_gqa", "qwen2_shared_dense", "qwen3_norm_topk", "qwen3_no_norm_tied")


def count_reads() -> list[int]:
    """From now on, add the elements every safetensors read returns in this process to the
    returned one-item counter (for a rank's process, which ends with its test)."""
    from moe_fold.models.hf import weights

    read = weights.SafetensorsFolder.read
    counted = [0]

    def counting_read(self, name, offsets, sizes):
        value = read(self, name, offsets, sizes)
        counted[0] += value.numel()
        return value

    weights.SafetensorsFolder.read = counting_read
    return counted


def _import_export(rank, world_size, tp, ep, paths, out_dir):
    from moe_fold.models import from_hf, to_hf

    groups = create_process_groups(ParallelLayout(world_size, tp=tp, ep=ep))
    counted = count_reads()
    results = {}
    for case, path in paths.items():
        counted[0] = 0
        model = from_hf(path, groups)
        local = sum(p.numel() for p in model.parameters())
        experts = next(tuple(b.mlp.experts.fc1.shape) for b in model.layers if hasattr(b.mlp, "experts"))
        results[case] = {"logits": model.eval().logits(token_ids()).detach(), "read": counted[0],
                         "local": local, "experts_fc1": experts}
        to_hf(model, f"{out_dir}/{case}")
    return results


@pytest.mark.parametrize("tp,ep,world", [
    pytest.param(2, 1, 2, id="tp2", marks=pytest.mark.slow),
    pytest.param(1, 2, 2, id="ep2", marks=pytest.mark.slow),
    pytest.param(2, 2, 4, id="tp2_ep2"),
])
def test_import_and_export_under_layouts(tmp_path, tp, ep, world):
    ids = token_ids()
    refs, paths = {}, {}
    for case in FAMILY_CASES:
        model = save_hf(case, tmp_path / case)
        refs[case], paths[case] = model, str(tmp_path / case)
    out_dir = tmp_path / "out"
    results = run_ranks(_import_export, world, tp, ep, paths, str(out_dir), timeout=240)
    for case, ref_model in refs.items():
        ref = hf_logits(ref_model, ids)
        for rank, result in enumerate(results):
            r = result[case]
            diff = max_diff(r["logits"], ref)
            print(f"tp{tp} ep{ep} {case} rank {rank}: max abs logit diff vs transformers {diff:.3g}")
            # Every local element read once, nothing else: the rank read only its slices.
            assert r["read"] == r["local"], (case, rank)
            # 4 experts over ep; gate|up (2 x 48 for Mixtral, 2 x 24 for Qwen) over etp = tp.
            width = 96 if case.startswith("mixtral") else 48
            assert r["experts_fc1"] == (4 // ep, 32, width // tp)
            assert diff <= TOL
        back = type(ref_model).from_pretrained(out_dir / case).eval()
        assert max_diff(hf_logits(back, ids), ref) <= TOL


def _export_pp(rank, world_size, paths, out_dir):
    from moe_fold.config import Config
    from moe_fold.models import from_hf, to_hf

    groups = create_process_groups(ParallelLayout(world_size, pp=2))
    base = Config()
    base.parallel.pp, base.parallel.pp_layers = 2, [1, 2]  # the 3 layers: 1 on stage 0, 2 on stage 1
    for case, path in paths.items():
        to_hf(from_hf(path, groups, config=base), f"{out_dir}/{case}")


def test_export_under_pp_writes_every_stage(tmp_path):
    """pp 2: rank 0 writes the second stage's tensors too (a tied embedding once), the
    very tensors transformers saved."""
    from safetensors import safe_open

    paths = {}
    for case in ("mixtral_gqa", "qwen3_no_norm_tied"):
        save_hf(case, tmp_path / case)
        paths[case] = str(tmp_path / case)
    run_ranks(_export_pp, 2, paths, str(tmp_path / "out"), timeout=240)
    for case in paths:
        with safe_open(str(tmp_path / case / "model.safetensors"), "pt") as a, \
                safe_open(str(tmp_path / "out" / case / "model.safetensors"), "pt") as b:
            assert set(a.keys()) == set(b.keys()), case
            for key in a.keys():
                assert torch.equal(a.get_tensor(key), b.get_tensor(key)), (case, key)
