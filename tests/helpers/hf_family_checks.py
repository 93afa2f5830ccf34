"""What every Hugging Face family's tests share (tests/models/hf/test_families.py holds each
family's parameters): a tiny random transformers model of a family case (:func:`hf_model`),
a saved config.json edited until the importer refuses it (:func:`refused`), and the checks
made alike: import equals transformers' logits and exports the same tensors back (which
transformers loads again), on one process and under a layout of 4 gloo ranks."""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass

import pytest
import torch
import torch.distributed as dist
import transformers
from safetensors import safe_open

from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups
from moe_fold.models import from_hf, to_hf
from moe_fold.models.hf import HFConfigError, export_family
from tests.helpers.float64_reference import Float64Everywhere

VOCAB, SEQ, BATCH = 70, 12, 2
TOL = 1e-5
# Our float64 forward against transformers' (both wholly float64): measured at most 1.1e-7
# over every case (constants such as rotary frequencies are born in float32 on one side),
# 2e-14 for the linear-attention families; float32 noise (2e-6 to 1.1e-5 per side) is absent.
TOL64 = 1e-6


def hf_logits(model, ids):
    return model(ids).logits.float()


@dataclass(frozen=True)
class Spec:
    """A family's tiny test models: transformers' config and model classes (names in
    ``transformers``), the settings every case shares, and case -> its own settings.
    ``eager_experts``: switch the experts to the eager loop (transformers' grouped-mm
    experts want 16-byte rows, which odd widths do not have); ``eager_attention``: build
    and reload with eager attention (attention sinks); ``matrix_std``: the matrices'
    std and ``zero_centred``: the RMSNorm weights are offsets from 1 (:func:`randomize`);
    ``exported_by_default``: the exporter picks this family for
    the imported models (else it is asked by name)."""

    config_cls: str
    model_cls: str
    common: dict
    cases: dict
    eager_experts: bool = True
    eager_attention: bool = False
    matrix_std: float = 0.2
    zero_centred: bool = False
    exported_by_default: bool = True

    def load_kwargs(self) -> dict:
        return {"attn_implementation": "eager"} if self.eager_attention else {}


def randomize(model, seed: "int | torch.Generator", matrix_std: float = 0.2, zero_centred: bool = False):
    """``model`` with matrices N(0, matrix_std), vectors U(0.5, 1.5) and any score correction
    bias (a buffer, or ERNIE-4.5's parameter) N(0, 0.1), LongCat-Flash's unread zero-expert
    rows 0, drawn from ``seed`` (or from a
    generator the caller goes on using): large enough that routing and every layer matter.
    ``zero_centred``: the RMSNorms (``*layernorm``, ``norm``, ``q_norm``, ``k_norm``; not a
    Gated DeltaNet's gated ``linear_attn.norm``) multiply by 1 + weight: their weights are
    drawn U(-0.5, 0.5), gains U(0.5, 1.5) as elsewhere."""
    gen = seed if isinstance(seed, torch.Generator) else torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for p in model.parameters():
            if p.dim() > 1:
                p.copy_(torch.randn(p.shape, generator=gen) * matrix_std)
            else:
                p.copy_(torch.rand(p.shape, generator=gen) + 0.5)
        if zero_centred:
            for name, p in model.named_parameters():
                if name.endswith("norm.weight") and not name.endswith("linear_attn.norm.weight"):
                    p.sub_(1.0)
        for name, b in model.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=gen) * 0.1)
        for name, p in model.named_parameters():
            if name.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
        for module in model.modules():
            # LongCat-Flash's fused gate|up has rows for its zero experts, which no token
            # multiplies: an export writes them as zeros, so the round trip starts there.
            if type(module).__name__ == "LongcatFlashExperts":
                module.gate_up_proj[module.num_routed_experts:].zero_()
    return model


def hf_model(spec: Spec, case: str, seed: int = 0, **overrides):
    """A tiny random transformers model of ``spec``'s ``case`` (with config ``overrides``)."""
    config = getattr(transformers, spec.config_cls)(**{**spec.common, **spec.cases[case], **overrides})
    if spec.eager_attention:
        config._attn_implementation = "eager"
    torch.manual_seed(seed)
    model = getattr(transformers, spec.model_cls)(config).eval()
    if spec.eager_experts:
        model.set_experts_implementation("eager")
    return randomize(model, seed, spec.matrix_std, spec.zero_centred)


def refused(model, tmp_path, edit, errors=(HFConfigError,)) -> str:
    """The error text of importing ``model`` saved with its config.json edited by ``edit``:
    HFConfigError for a key we cannot map, ConfigError (in ``errors``) for a mapped value
    our rules refuse."""
    model.save_pretrained(tmp_path / "hf")
    file = tmp_path / "hf" / "config.json"
    hf = json.loads(file.read_text())
    edit(hf)
    file.write_text(json.dumps(hf))
    with pytest.raises(errors) as err:
        from_hf(tmp_path / "hf")
    return str(err.value)


def token_ids(seed: int = 1) -> torch.Tensor:
    return torch.randint(0, VOCAB, (BATCH, SEQ), generator=torch.Generator().manual_seed(seed))


def max_diff(a, b) -> float:
    return (a - b).abs().max().item()


def tensors(path):
    with safe_open(str(path / "model.safetensors"), "pt") as f:
        return {k: f.get_tensor(k) for k in f.keys()}


def saved_with_logits(folder, models: dict, ids) -> tuple[dict, dict]:
    """Save each of ``models`` (name -> transformers model) under ``folder/name``; returns
    ``(logits of ids, path)`` dicts by name, the references a layout test compares with."""
    refs, paths = {}, {}
    for name, model in models.items():
        model.save_pretrained(folder / name)
        refs[name], paths[name] = hf_logits(model, ids), str(folder / name)
    return refs, paths


def gathered_logits(model, groups, ids):
    """Full logits ``[B, S, V]`` of the whole batch, on every rank: the pipeline stages
    run in turn (stage 0's hidden states sent to stage 1), the last stage's logits are
    gathered over tp and over cp (zigzag shards back to natural order)."""
    from moe_fold.comm import gather_from_tp_region
    from moe_fold.parallel.context_parallel import zigzag_gather, zigzag_positions, zigzag_split

    cp, cp_rank, pp = groups.size("cp"), groups.rank_in("cp"), groups.size("pp")
    local_ids = zigzag_split(ids, cp_rank, cp, dim=1)
    positions = zigzag_positions(SEQ, cp_rank, cp)
    with torch.no_grad():
        x = None
        if model.stages[0] > 0:
            x = torch.empty(SEQ // cp // (groups.size("tp") if model.config.parallel.sequence_parallel else 1),
                            BATCH, model.config.model.hidden_size)
            dist.recv(x, dist.get_global_rank(groups.pp, groups.rank_in("pp") - 1))
        x = model._chunk_hidden(0, x, local_ids, positions)
        if model.stages[0] < pp - 1:
            dist.send(x.contiguous(), dist.get_global_rank(groups.pp, groups.rank_in("pp") + 1))
            logits = torch.zeros(BATCH, SEQ, VOCAB)
        else:
            local = gather_from_tp_region(model.lm_head(model.norm(x)), groups.tp, dim=-1)  # [S_local, B, V]
            shards = [torch.empty_like(local) for _ in range(cp)]
            dist.all_gather(shards, local.contiguous(), group=groups.cp)
            logits = zigzag_gather(shards, dim=0).transpose(0, 1).contiguous()  # [B, S, V]
    # Every rank returns the last stage's logits.
    dist.broadcast(logits, dist.get_global_rank(groups.pp, pp - 1), group=groups.pp)
    return logits


def check_import_and_round_trip(ref_model, family: str, tmp_path, label: str, exported_by_default: bool = True,
                                **load):
    """``ref_model`` (a transformers model of ``family``) saved, imported on one process:
    logits within TOL x max(1, max |logit|) of transformers' (as the layouts: float32
    rounding alone strays 2e-6 to 1.1e-5 per side from float64 on these models, varying
    with the CPU path, so two float32 implementations may differ by 1.05e-5 on logits of a
    few units: measured on AVX2) and, both in float64, within TOL64 (the check that the
    function is the same, at 1e-14 to 1e-7), exported back (to ``family``, which the exporter
    picks itself when ``exported_by_default``) to identical tensors, and the export loads
    in transformers (``from_pretrained(..., **load)``) with the same logits. Returns the
    imported model."""
    ids = token_ids()
    ref_model.save_pretrained(tmp_path / "hf")
    ref = hf_logits(ref_model, ids)
    model = from_hf(tmp_path / "hf")
    assert (export_family(model.config) == family) == exported_by_default
    diff = max_diff(model.eval().logits(ids), ref)
    gap64 = max_diff(*float64_logits(ref_model, tmp_path / "hf", ids))
    print(f"{family} {label}: max abs logit diff vs transformers {diff:.3g} (float64: {gap64:.3g})")
    assert diff <= TOL * max(1.0, float(ref.abs().max())), (diff, float(ref.abs().max()))
    assert gap64 <= TOL64
    to_hf(model, tmp_path / "out", family=family)
    a, b = tensors(tmp_path / "hf"), tensors(tmp_path / "out")
    assert set(a) == set(b)
    for key in a:
        assert a[key].dtype == b[key].dtype and torch.equal(a[key], b[key]), key
    back = transformers.AutoModelForCausalLM.from_pretrained(tmp_path / "out", **{"experts_implementation": "eager",
                                                                                   **load}).eval()
    assert type(back).__name__ == type(ref_model).__name__
    assert max_diff(hf_logits(back, ids), ref) <= TOL
    return model


def float64_logits(ref_model, path, ids) -> tuple:
    """Our logits and transformers' for ``ids`` with the weights saved at ``path`` (those of
    ``ref_model``), both models in float64 and run wholly in float64
    (:class:`~tests.helpers.float64_reference.Float64Everywhere`): whether we compute the same
    function, apart from the float32 rounding each side carries."""
    ours = from_hf(path).eval().double()
    theirs = copy.deepcopy(ref_model).double()
    with torch.no_grad(), Float64Everywhere():
        return ours.logits(ids), theirs(ids).logits


def _import_export(rank, world_size, sizes, paths, out_dir, count, family):
    groups = create_process_groups(ParallelLayout(world_size, **sizes))
    if count:
        from tests.models.hf.test_parallel import count_reads

        counted = count_reads()
    results = {}
    for case, path in paths.items():
        if count:
            counted[0] = 0
        model = from_hf(path, groups).eval()
        results[case] = {"logits": gathered_logits(model, groups, token_ids())}
        if count:
            # parameters and the expert bias
            results[case].update(read=counted[0], local=sum(t.numel() for t in model.state_dict().values()))
        to_hf(model, f"{out_dir}/{case}", family=family)
    return results


def check_layouts(ref_models: dict, family: str, sizes: dict, tmp_path, count_reads: bool = False) -> None:
    """Each of ``ref_models`` (case -> transformers model) imported on 4 ranks under
    ``sizes``: every rank's gathered logits within TOL x max(1, max |logit|) of
    transformers' (relative: a layout reorders float32 sums, and the scalar ATen path,
    ATEN_CPU_CAPABILITY=default, measured 1.31e-5 on logits of a few units), and the export
    written from the shards equal to the saved tensors. ``count_reads``: also every local
    element read exactly once (a rank reads only its slices of the safetensors files)."""
    refs, paths = saved_with_logits(tmp_path, ref_models, token_ids())
    results = run_ranks(_import_export, 4, sizes, paths, str(tmp_path / "out"), count_reads, family, timeout=240)
    for case, ref in refs.items():
        for rank, result in enumerate(results):
            diff = max_diff(result[case]["logits"], ref)
            print(f"{family} {sizes} {case} rank {rank}: max abs logit diff vs transformers {diff:.3g}")
            assert diff <= TOL * max(1.0, float(ref.abs().max())), (case, rank, diff)
            if count_reads:
                assert result[case]["read"] == result[case]["local"], (case, rank)
        a, b = tensors(tmp_path / case), tensors(tmp_path / "out" / case)
        assert set(a) == set(b) and all(torch.equal(a[k], b[k]) for k in a), case
