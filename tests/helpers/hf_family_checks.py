"""The checks every Hugging Face family's tests make alike: import equals transformers'
logits and exports the same tensors back (which transformers loads again), on one process
and under a layout of 4 gloo ranks."""

from __future__ import annotations

import torch
import transformers

from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups
from moe_fold.models import from_hf, to_hf
from moe_fold.models.hf import export_family
from tests.models.hf.test_deepseek_v3 import _gathered_logits, _tensors, hf_logits, max_diff, saved_with_logits, token_ids

TOL = 1e-5


def check_import_and_round_trip(ref_model, family: str, tmp_path, label: str, **load):
    """``ref_model`` (a transformers model of ``family``) saved, imported on one process:
    logits within TOL of transformers', exported back to identical tensors, and the export
    loads in transformers (``from_pretrained(..., **load)``) with the same logits. Returns
    the imported model."""
    ids = token_ids()
    ref_model.save_pretrained(tmp_path / "hf")
    ref = hf_logits(ref_model, ids)
    model = from_hf(tmp_path / "hf")
    assert export_family(model.config) == family
    diff = max_diff(model.eval().logits(ids), ref)
    print(f"{family} {label}: max abs logit diff vs transformers {diff:.3g}")
    assert diff <= TOL
    to_hf(model, tmp_path / "out")
    a, b = _tensors(tmp_path / "hf"), _tensors(tmp_path / "out")
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", **{"experts_implementation": "eager",
                                                                                   **load}).eval()
    assert type(back).__name__ == type(ref_model).__name__
    assert max_diff(hf_logits(back, ids), ref) <= TOL
    return model


def _import_export(rank, world_size, sizes, paths, out_dir):
    groups = create_process_groups(ParallelLayout(world_size, **sizes))
    results = {}
    for case, path in paths.items():
        model = from_hf(path, groups).eval()
        results[case] = _gathered_logits(model, groups, token_ids())
        to_hf(model, f"{out_dir}/{case}")
    return results


def check_layouts(ref_models: dict, family: str, sizes: dict, tmp_path) -> None:
    """Each of ``ref_models`` (case -> transformers model) imported on 4 ranks under
    ``sizes``: every rank's gathered logits within TOL of transformers', and the export
    written from the shards equal to the saved tensors."""
    refs, paths = saved_with_logits(tmp_path, ref_models, token_ids())
    results = run_ranks(_import_export, 4, sizes, paths, str(tmp_path / "out"), timeout=240)
    for case, ref in refs.items():
        for rank, result in enumerate(results):
            diff = max_diff(result[case], ref)
            print(f"{family} {sizes} {case} rank {rank}: max abs logit diff vs transformers {diff:.3g}")
            assert diff <= TOL
        a, b = _tensors(tmp_path / case), _tensors(tmp_path / "out" / case)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), case
