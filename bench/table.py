"""The suite's table: one row per benchmark record with its case, its time, and each ratio
against the baseline measured in the same run, with what the ratio means."""

from __future__ import annotations

COLUMNS = ("bench", "case", "ms", "ratio", "meaning")


def _num(value) -> str:
    return "-" if value is None else f"{value:.3g}"


def _bytes(n: int) -> str:
    return f"{n / 1024:.1f} KiB" if n < 2 ** 20 else f"{n / 2 ** 20:.2f} MiB"


def _dispatch(r: dict):
    skew = f" s={r['zipf_s']:g}" if r.get("zipf_s") is not None else ""
    etp = f" etp{r['etp']}" if r.get("etp", 1) > 1 else ""
    case = (f"{r['dispatcher']} {r['mode']} {r['routing']}{skew} ep{r['ep']}{etp} "
            f"T{r['tokens']} H{r['hidden']} E{r['experts']} k{r['topk']}")
    sent, least = r["bytes_sent"], r["bytes_min"]
    over = f"{sent / least:.3g}" if least else "-"
    return case, r["ms"], [
        ("bytes_sent/bytes_min", f"{over} ({_bytes(sent)} / {_bytes(least)})",
         "bytes per rank / least possible (1 = optimal)"),
        ("permute_ratio_to_copy", _num(r["permute_ratio_to_copy"]),
         "local permute+unpermute / row copy (1 = limit)"),
    ]


def _gemm(r: dict):
    backend = r["backend"] if r["resolved"] == r["backend"] else f"{r['backend']}->{r['resolved']}"
    dtype = "" if r["dtype"] == "float32" else f" {r['dtype']}"
    case = (f"{backend} {r['routing']} {r['tokens_per_expert_mean']:g} tok/expert "
            f"H{r['hidden']} F{r['ffn']} E{r['experts']}{dtype}")
    return case, r["ms"], [("ratio_to_dense", _num(r["ratio_to_dense"]),
                            "dense GEMM time / grouped time (1 = limit)")]


def _permute(r: dict):
    case = f"{r['backend']} {r['pass']} T{r['tokens']} H{r['hidden']} E{r['experts']} k{r['topk']}"
    return case, r["ms"], [("ratio_to_copy", _num(r["ratio_to_copy"]),
                            "permute+unpermute / row copy (1 = limit)")]


def _moe_layer(r: dict):
    case = f"{r['tokens']}x{r['hidden']}x{r['ffn']}x{r['experts']}x{r['topk']}"
    if "skipped" in r:
        return f"{case} {r['candidate']}", None, [("skipped", "", r["skipped"])]
    ms = r["ms"]
    ep = r.get("ep", 1)
    if ep > 1:  # ep gloo ranks: ours and the Megatron-Core-style layer only
        return f"{case} ep{ep}", ms["ours"], [("ratio_vs_megatron", _num(r["ratio_vs_megatron"]),
                                               "megatron-style / ours, slowest rank (>1: ours faster)")]
    if "overhead_vs_dense" not in r:  # a transformers implementation timed alone on fewer tokens
        (hf,) = (name for name in ms if name.startswith("hf:"))
        return f"{case} vs {hf}", ms["ours"], [("ratio_vs_hf", _num(r["ratio_vs_hf"]),
                                                f"{hf} time / ours (>1: ours faster); {r['note']}")]
    metrics = [
        ("ratio_vs_hf", _num(r["ratio_vs_hf"]),
         f"hf:{r['best_hf']} (fastest HF) / ours (>1: ours faster)"),
    ]
    if "ratio_vs_megatron" in r:  # results written before the Megatron-style candidate have none
        metrics.append(("ratio_vs_megatron", _num(r["ratio_vs_megatron"]),
                        "Megatron-Core-style layer / ours (>1: ours faster)"))
    metrics += [
        ("overhead_vs_dense", _num(r["overhead_vs_dense"]),
         "ours / dense SwiGLU of equal FLOPs (1 = limit)"),
    ]
    if "gemm_overhead_vs_dense" in r:  # results written before the GEMM-only candidates have none
        metrics.append(("gemm_overhead_vs_dense", _num(r["gemm_overhead_vs_dense"]),
                        "the six grouped GEMMs alone / the dense MLP's six GEMMs"))
    return case, ms["ours"], metrics


def _pipeline_bubble(r: dict):
    case = f"{r['schedule']} pp{r['pp']} vpp{r['vpp']} m{r['microbatches']} fwd {r['forward_ms']:g} ms"
    return case, r["total_ms"], [
        ("idle vs theory", f"{r['idle_fraction']:.3f} vs {r['idle_fraction_theory']:.3f}",
         "idle / total time: measured vs textbook"),
    ]


def _attention(r: dict):
    name = f"default ({r['kernel']})" if r["candidate"] == "default" else r["candidate"]
    case = (f"{name} {r['pass']} B{r['batch']} seq{r['seq']} {r['num_docs']} docs "
            f"heads {r['heads']}/{r['kv_heads']}x{r['head_dim']}")
    return case, r["ms"], [("ratio_vs_loop", _num(r["ratio_vs_loop"]),
                            "time / per-document loop before issue 26 (<1: faster)")]


def _cp_attention(r: dict):
    case = f"{r['kind']} cp{r['cp']} seq{r['seq']} heads {r['heads']}/{r['kv_heads']}x{r['head_dim']}"
    return case, r["ms"], [("ratio_to_single", _num(r["ratio_to_single"]),
                            f"1 process / {r['cp']} ranks, time (ideal {r['cp']})")]


def _dynamic_cp(r: dict):
    case = f"{r['dist']} cp{r['cp']} seq{r['seq']} ({r['documents']} docs, max {r['max_doc']})"
    return case, r["dynamic_ms"], [
        ("time_ratio", _num(r["time_ratio"]), "static cp step / dynamic cp step (>1: dynamic faster)"),
        ("balance", f"{r['static_balance']:.3f} -> {r['dynamic_balance']:.3f}",
         "max / mean attention FLOPs per rank, static -> dynamic (1 = even)"),
    ]


def _placement(r: dict):
    case = f"{r['policy']} {r['routing']} e{r['experts']} ep{r['ep']} top{r['topk']}"
    return case, r["ms"], [
        ("busiest_over_mean", f"{r['busiest_over_mean']:.3f}", "busiest ep rank's rows / mean (1 = even)"),
        ("ratio_vs_static", _num(r["ratio_vs_static"]), "static step / this policy's step (>1: faster)"),
        ("move", f"{r['move_bytes']} B {r['move_ms']:.1f} ms x{r['moves']}", "cost of one re-placement"),
    ]


def _train(r: dict):
    if "skipped" in r:
        return r["candidate"], None, [("skipped", "", r["skipped"])]
    if "candidate" in r:  # one candidate's step; the summary record holds the ratios
        speed = (f"{r['tokens_per_s']:.4g} tokens/s" if "tokens_per_s" in r
                 else f"{r['flops_per_s'] / 1e9:.3g} GFLOP/s")
        return f"step of {r['candidate']}", r["ms"], [("", speed, "")]
    case = f"{r['preset']} mb{r['micro_batch']} seq{r['seq_length']}: ours"
    return case, r["tokens_per_step"] / r["tokens_per_s"] * 1e3, [
        ("ratio_vs_hf", _num(r["ratio_vs_hf"]),
         "fastest HF Mixtral step / ours (>1: ours faster)"),
        ("flops_fraction_of_matmul", _num(r["flops_fraction_of_matmul"]),
         "our model FLOP/s / dense matmul FLOP/s"),
    ] + ([("flops_fraction_ceiling", _num(r["flops_fraction_ceiling"]),
           "the same if only its matmul and attention kernels took time")]
         if "flops_fraction_ceiling" in r else [])


def _overlap(r: dict):
    setting = r.get("setting", "on")
    case = f"{r['kind']}{'' if setting == 'on' else ' ' + setting} {r['preset']} world {r['world']}"
    rows = [("exposed_fraction", _num(r["exposed_fraction"]),
             "time waited on it with its overlap on / its whole time (overlap off)")]
    if "planner_exposed_fraction" in r:
        rows.append(("planner_exposed_fraction", _num(r["planner_exposed_fraction"]),
                     "the same from the planner's exposed terms"))
        rows.append(("step_ratio", _num(r["step_ratio"]), "step time overlap off / on (>1: overlap faster)"))
    return case, r["ms"], rows


def _checkpoint(r: dict):
    case = f"{r['preset']} {r['params'] / 1e6:.0f}M params, {r['checkpoint_bytes'] / 2**30:.2f} GiB: async save"
    return case, r["async_stall_ms"], [
        ("ratio_async_to_sync", _num(r["ratio_async_to_sync"]),
         f"training stall of an async save / a sync one ({r['sync_stall_ms']:.0f} ms; target <= 0.25)"),
    ]


def _other(r: dict):
    """A record of a benchmark this table has no layout for: its ratio-like fields."""
    ratios = [(k, _num(v), "") for k, v in r.items()
              if k.startswith(("ratio", "overhead")) and isinstance(v, (int, float))]
    ms = r.get("ms")
    return r.get("suite_case", ""), ms if isinstance(ms, (int, float)) else None, ratios


ROWS = {"dispatch": _dispatch, "gemm": _gemm, "permute": _permute, "moe_layer": _moe_layer,
        "pipeline_bubble": _pipeline_bubble, "attention": _attention, "cp_attention": _cp_attention,
        "dynamic_cp": _dynamic_cp,
        "placement": _placement, "overlap": _overlap,
        "train": _train, "checkpoint": _checkpoint}


def rows(records: list[dict]) -> list[tuple[str, str, str, str, str]]:
    """One row (``COLUMNS``) per benchmark record, suite records left out; several ratios of
    a record share its row, one per line."""
    out = []
    for r in records:
        if r["bench"] == "suite":
            continue
        if "error" in r:
            out.append((r["bench"], r.get("suite_case", ""), "-", "error", r["error"]))
            continue
        try:
            case, ms, ratios = ROWS.get(r["bench"], _other)(r)
        except KeyError as err:  # the benchmark's output changed: show the record, say what is missing
            case, ms, ratios = _other(r)
            ratios.append(("", "", f"(no {r['bench']} layout for this record: it has no field {err})"))
        out.append((r["bench"], case, _num(ms) if ms is None else f"{ms:.2f}",
                    "\n".join(f"{name} {value}".strip() for name, value, _ in ratios),
                    "\n".join(meaning for _, _, meaning in ratios)))
    return out


def render(records: list[dict]):
    """A rich Table of :func:`rows`."""
    from rich.table import Table
    from rich.text import Text

    t = Table(title="moe-fold bench: each ratio is against a baseline measured in the same run")
    for name in COLUMNS:
        t.add_column(name, justify="right" if name == "ms" else "left", overflow="fold")
    for row in rows(records):
        t.add_row(*map(Text, row))  # plain text: a reason in brackets is not markup
    return t
