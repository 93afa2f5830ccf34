"""Our logits against transformers' for every Hugging Face family we import, on one
process and under two 4-rank layouts: a correctness table, not a timing.

For each family, the tiny odd-sized random transformers models of its tests (the same
builders, imported from tests/; nothing downloaded) are saved to a temporary folder,
imported with ``moe_fold.models.from_hf`` on 1 process, on 4 gloo ranks under tp2 x ep2
(etp 2, the default etp = tp) and under pp2 x cp2, and the logits of the same token ids
(batch 2 x 12 tokens, float32) compared with transformers' forward. Under a layout the
full logits are gathered on every rank (pipeline stages in turn, tp and zigzag cp shards
joined: ``tests/helpers/hf_family_checks.gathered_logits``); the number is the largest
absolute difference over every rank, token and vocabulary entry. A layout a family
cannot run prints the rule that refuses it instead of a number.

    python -m bench.hf_logits [--markdown FILE] [--timeout 600]

One JSON line per (family, case, layout): ``{"bench": "hf_logits", "family", "case",
"sizes", "layout", "max_abs_diff"}`` (or ``"refused": "<the error>"`` in place of
``max_abs_diff``), then a Markdown table (``--markdown FILE`` also writes it to FILE).
"""

from __future__ import annotations

import argparse
import json
import os
import tempfile
from pathlib import Path

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # idle OpenMP workers starve a small shared CPU

import torch  # noqa: E402

from moe_fold.config import ConfigError, head_dim  # noqa: E402
from moe_fold.launch import run_ranks  # noqa: E402
from moe_fold.layout import ParallelLayout, create_process_groups  # noqa: E402
from moe_fold.models import from_hf  # noqa: E402
from moe_fold.models.hf import HFConfigError, hf_config  # noqa: E402

from tests.models.hf import test_importer as test_hf  # noqa: E402
from tests.helpers.hf_family_checks import gathered_logits as _gathered_logits, max_diff, token_ids  # noqa: E402
from tests.models.hf.test_importer import hf_logits  # noqa: E402
from tests.models.hf.test_families import SPECS, model_of  # noqa: E402

LAYOUTS = {"1 process": None, "tp2 x ep2 (etp 2)": dict(tp=2, ep=2), "pp2 x cp2": dict(pp=2, cp=2)}

# test_hf's Mixtral/Qwen cases are even-sized (hidden 32, 4 heads of 8) with vocab 64: here
# they take GLM's and ERNIE's odd sizes and vocab 70 (6 heads of 8, 3 heads and one kv head
# per tp rank, expert widths 25 and 11 per etp rank), so one set of token ids and one gather
# serve all.
_ODD = dict(vocab_size=70, hidden_size=48, num_attention_heads=6, num_key_value_heads=2, intermediate_size=50)
_ODD_QWEN3 = dict(_ODD, moe_intermediate_size=22)
_ODD_QWEN2 = dict(_ODD_QWEN3, shared_expert_intermediate_size=30)


def _eager(model):
    """transformers' grouped-mm experts want 16-byte rows, which odd widths do not have."""
    model.set_experts_implementation("eager")
    return model


# family (models/hf/config_map.py FAMILIES) -> case -> a builder of its transformers model.
# Every case of each family's single-process test, at its sizes (test_hf's at _ODD), and
# GLM-4.5 with num_experts_per_tok != 2 x topk_group.
BUILDERS = {
    "mixtral": {"mixtral_gqa": lambda: _eager(test_hf.hf_model("mixtral_gqa", **_ODD))},
    "qwen2_moe": {case: (lambda case=case: _eager(test_hf.hf_model(case, **_ODD_QWEN2)))
                  for case in ("qwen2_shared_dense", "qwen2_sparse_step_norm")},
    "qwen3_moe": {case: (lambda case=case: _eager(test_hf.hf_model(case, **_ODD_QWEN3)))
                  for case in ("qwen3_norm_topk", "qwen3_no_norm_tied")},
    # The other families: the cases of tests/models/hf/test_families.py.
    **{family: {case: (lambda family=family, case=case: _eager(model_of(family, case))) for case in spec.cases}
       for family, spec in SPECS.items() if family not in ("mixtral", "qwen2_moe", "qwen3_moe")},
}

# What refuses a model or a layout before any work: the rule's message is the result.
REFUSALS = (ConfigError, HFConfigError, ValueError)


def sizes_of(model) -> str:
    """The model's shape, read from the config we imported."""
    m, moe = model.config.model, model.config.moe
    heads = (f"{m.num_heads} MLA" if m.attention == "mla"
             else f"{m.num_heads}/{m.num_kv_heads} x {head_dim(model.config)}")
    if m.dsa:  # DSA: the indexer's heads x width, the keys kept, the layers sharing a selection
        shared = sum(t == "shared" for t in m.indexer_types or [])
        heads += (f" + DSA {m.index_n_heads} x {m.index_head_dim} top-{m.index_topk}"
                  + (f" ({shared} shared)" if shared else ""))
    deltanet = ""
    if m.layer_types is not None and {"gated_deltanet", "kda"} & set(m.layer_types):
        kinds = "".join({"gated_deltanet": "D", "kda": "K"}.get(kind, "A") for kind in m.layer_types)
        kind = "KDA" if "kda" in m.layer_types else "Gated DeltaNet"
        deltanet = (f" ({kinds}: {kind} {m.linear_num_key_heads}/{m.linear_num_value_heads} x "
                    f"{m.linear_key_head_dim}/{m.linear_value_head_dim})")
    if m.block == "shortcut_moe":
        deltanet = " (2 sublayers each)"
    zero = f" + Z{moe.zero_experts}" if moe.zero_experts else ""
    zero += f" in latent {moe.latent_size}" if moe.latent_size is not None else ""
    if m.block == "single_mixer":
        # Nemotron-H's pattern letters: M Mamba2, * attention, - MLP, E MoE.
        kinds = "".join({"mamba2": "M", "attention": "*", "mlp": "-", "moe": "E"}[k] for k in m.layer_types)
        deltanet = (f" ({kinds}: Mamba2 {m.mamba_num_heads} x {m.mamba_head_dim} in {m.mamba_num_groups} groups, "
                    f"state {m.mamba_state_size})")
    return (f"V{m.vocab_size} H{m.hidden_size} L{m.num_layers}{deltanet} heads {heads}, "
            f"E{moe.num_experts} x {moe.ffn_hidden_size}{zero} top-{moe.topk}")


def _import(path, groups):
    """``from_hf`` under ``groups``; a layer count that pp does not divide (test_hf's
    3-layer cases) is split unevenly with ``parallel.pp_layers``, as a user would."""
    pp = groups.size("pp")
    config = hf_config(path)
    layers = config.model.num_layers
    if layers % pp == 0:
        return from_hf(path, groups)
    p, layout = config.parallel, groups.layout
    p.tp, p.cp, p.pp, p.ep, p.etp = layout.tp, layout.cp, layout.pp, layout.ep, layout.etp
    p.sequence_parallel = layout.tp > 1  # what from_hf sets for a layout without a config
    p.pp_layers = [layers // pp + (stage < layers % pp) for stage in range(pp)]
    return from_hf(path, groups, config=config)


def rank_logits(rank, world_size, sizes, paths):
    """On each rank: ``case -> full logits [B, S, V]`` (or the refusal's message)."""
    groups = create_process_groups(ParallelLayout(world_size, **sizes))
    out = {}
    for case, path in paths.items():
        try:
            model = _import(path, groups).eval()
        except REFUSALS as e:
            out[case] = f"{type(e).__name__}: {e}"
            continue
        out[case] = _gathered_logits(model, groups, token_ids())
    return out


def measure(folder: Path, timeout: float) -> list[dict]:
    ids = token_ids()
    cases, refs, paths = [], {}, {}
    for family, builders in BUILDERS.items():
        for case, build in builders.items():
            model = build()
            model.save_pretrained(folder / case)
            refs[case], paths[case] = hf_logits(model, ids), str(folder / case)
            cases.append((family, case))
    records, shape = [], {}
    for layout, sizes in LAYOUTS.items():
        if sizes is None:
            results = {}
            for case, path in paths.items():
                try:
                    model = from_hf(path).eval()
                except REFUSALS as e:
                    results[case] = [f"{type(e).__name__}: {e}"]
                    continue
                shape[case] = sizes_of(model)
                with torch.no_grad():
                    results[case] = [model.logits(ids)]
        else:
            per_rank = run_ranks(rank_logits, 4, sizes, paths, timeout=timeout)
            results = {case: [r[case] for r in per_rank] for case in paths}
        for family, case in cases:
            got = results[case]
            refused = next((r for r in got if isinstance(r, str)), None)
            record = {"bench": "hf_logits", "family": family, "case": case, "sizes": shape.get(case, "-"),
                      "layout": layout}
            if refused is not None:
                record["refused"] = refused
            else:
                record["max_abs_diff"] = max(max_diff(r, refs[case]) for r in got)
            print(json.dumps(record), flush=True)
            records.append(record)
    return records


def markdown(records: list[dict]) -> str:
    rows: dict[tuple, dict] = {}
    for r in records:
        row = rows.setdefault((r["family"], r["case"]), {"sizes": r["sizes"]})
        # A refusal's message spans lines; a table cell may not.
        cell = f"{r['max_abs_diff']:.2g}" if "max_abs_diff" in r else f"refused: {' '.join(r['refused'].split())}"
        row[r["layout"]] = cell
    lines = ["| family | case | sizes | " + " | ".join(LAYOUTS) + " |",
             "| --- | --- | --- | " + " | ".join("---:" for _ in LAYOUTS) + " |"]
    for (family, case), row in rows.items():
        lines.append(f"| {family} | {case} | {row['sizes']} | " + " | ".join(row[layout] for layout in LAYOUTS) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--markdown", default=None, metavar="FILE", help="also write the Markdown table to FILE")
    parser.add_argument("--timeout", type=float, default=600.0, help="seconds the 4 ranks of one layout may take")
    args = parser.parse_args()
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as folder:
        table = markdown(measure(Path(folder), args.timeout))
    print(table)
    if args.markdown:
        Path(args.markdown).write_text(table)


if __name__ == "__main__":
    main()
