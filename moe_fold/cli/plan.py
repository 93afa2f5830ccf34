"""Estimate memory, FLOPs, communication, step time and MFU of a model on a layout and a GPU,
or rank every layout of a world size by estimated MFU (--search).

Per rank: parameter, gradient, optimizer-state and activation memory of the busiest
pipeline stage, as moe-fold keeps them (--implementation megatron: Megatron-LM's figures,
for comparison with the papers); FLOPs per step; bytes sent per step over each group (tp, cp, pp, dp, ep,
etp, edp, ...); the step time (compute at --efficiency of the GPU's dense BF16 peak, tensor
and expert parallel traffic on the critical path, pipeline bubble, exposed data-parallel
traffic, optimizer update) and MFU. Formulas and their sources: moe_fold/planner*.py.
The data-parallel overlaps assumed are the config's own (parallel.overlap_grad_reduce,
parallel.overlap_param_gather), so the MFU is moe-fold's; --overlap megatron assumes
Megatron-LM's, for comparison with the papers. The output names the overlaps assumed, the
MoE layer's (moe.shared_expert_overlap, moe.overlap_chunks) included.
Sizes not given on the command line come from the config (a preset name or a YAML path).
"""

from __future__ import annotations

import argparse
import json
import sys

from moe_fold.config import choices

EPILOG = """examples:
  moe-fold plan --config mixtral-8x22b --world 128 --gpu h100 --tp 2 --pp 8 --ep 8 --etp 1 --vpp 1
  moe-fold plan --config qwen2-57b-a14b --world 64 --gpu h100 --recompute none --distributed-optimizer
  moe-fold plan --config mixtral-8x7b --world 64 --gpu h200 --search --top 10
  moe-fold plan --config qwen3-30b-a3b --world 16 --gpu b200 --json
  moe-fold plan --config mixtral-8x7b --world 64 --tp 2 --pp 4 --ep 8 --implementation megatron
  moe-fold plan --config mixtral-8x22b --world 128 --tp 2 --pp 8 --ep 8 --overlap megatron
  moe-fold plan --config mixtral-8x7b --world 64 --set parallel.overlap_grad_reduce=true
  moe-fold plan --config qwen2-57b-a14b --world 64 --ep 8 --set moe.shared_expert_overlap=true
  moe-fold plan --config mixtral-8x7b --world 64 --loads runs/mixtral-8x7b --loads-steps 1000:2000
  moe-fold plan --config mixtral-8x7b --world 128 --loads runs/mixtral-8x7b --search --top 5
  moe-fold plan --config mixtral-8x7b --world 64 --compute-model flat --efficiency 0.7
  moe-fold plan --row liu25-mixtral-8x22b-folding

Step time: by default each kernel is timed from its shape with the efficiency fitted for the
GPU on published measurements (bench/plan_validation.py, docs/planner.md); --efficiency
overrides it, --compute-model flat divides the FLOPs by peak x efficiency instead.
With --loads, the expert loads a run recorded (<run_dir>/metrics.jsonl) replace balanced
routing: the busiest ep rank's rows under the static placement, re-placement
(moe.replace_every), copies (moe.replicas) and capacity factors, what each does to the step
and the busiest rank's memory, and the policy recommended; --search ranks layouts on them.

--row ID plans one row of the published measurements exactly as bench/plan_validation.py does
(moe_fold.planner.precedent.row_plan): the same MFU. Without it, sizes not given come from the
config: a preset's own recompute, optimizer and overlap switches can differ from a paper's run.

An impossible layout prints the rules it breaks and exits with code 2.
"""


def add_layout_arguments(parser: argparse.ArgumentParser) -> None:
    """The layout and batch flags that ``plan`` and ``dryrun`` share (each overrides its key)."""
    for name, what in (("tp", "tensor parallel size"), ("cp", "context parallel size"),
                       ("pp", "pipeline parallel size"), ("ep", "expert parallel size"),
                       ("etp", "expert tensor parallel size"), ("vpp", "model chunks per pp rank")):
        parser.add_argument(f"--{name}", type=int, default=None, help=f"{what} (default: the config's)")
    parser.add_argument("--mbs", type=int, default=None, help="micro-batch size (default: train.micro_batch_size)")
    parser.add_argument("--gbs", type=int, default=None, help="global batch size (default: train.global_batch_size)")
    parser.add_argument("--seq", type=int, default=None, help="sequence length (default: model.seq_length)")
    parser.add_argument("--recompute", choices=choices("train.recompute"), default=None,
                        help="activation recompute (default: train.recompute)")
    parser.add_argument("--distributed-optimizer", action=argparse.BooleanOptionalAction, default=None,
                        help="shard the optimizer state over dp (default: optimizer.distributed)")


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.epilog = EPILOG
    parser.add_argument("--config", default=None, help="preset name or YAML path (required unless --row)")
    parser.add_argument("--world", type=int, default=None, help="number of GPUs (required unless --row)")
    parser.add_argument("--gpu", default=None, help="h100 | h200 | b200 | a100 | v100 (default h100, or the row's)")
    parser.add_argument("--row", default=None, metavar="ID",
                        help="plan a row of the published measurements (bench/published, --published): its model, "
                             "world, GPU, layout, batch, recompute, overlap, attention kernel and precision, as "
                             "bench/plan_validation.py predicts it; the flags given here override the row's")
    add_layout_arguments(parser)
    parser.add_argument("--precision", choices=("bf16", "fp32"), default="bf16",
                        help="training precision to plan for (default bf16)")
    parser.add_argument("--efficiency", type=float, default=None,
                        help="achieved / peak FLOP/s of a large GEMM (default: the GPU's fitted figure; 0.7 with "
                             "--compute-model flat)")
    parser.add_argument("--compute-model", choices=("shapes", "flat"), default="shapes",
                        help="time each kernel from its shape (default) or divide the FLOPs by peak x efficiency")
    parser.add_argument("--fp8", action="store_true", help="the linear layers' GEMMs in FP8 (Transformer Engine)")
    parser.add_argument("--loads", default=None, metavar="RUN_DIR",
                        help="plan on the expert loads a run recorded (a run directory or its metrics.jsonl)")
    parser.add_argument("--loads-steps", default=None, metavar="FIRST:LAST",
                        help="the steps of --loads to use, inclusive (default: the whole run)")
    parser.add_argument("--replace-every", type=int, default=None,
                        help="re-placement interval weighed with --loads (default: moe.replace_every, else 10)")
    parser.add_argument("--published", default=None, metavar="DIR",
                        help="published measurements for the closest precedent (default: the checkout's "
                             "bench/published)")
    parser.add_argument("--implementation", choices=("moe-fold", "megatron"), default=None,
                        help="whose memory footprint: moe-fold's own (default) or Megatron-LM's "
                             "(fused kernels, 18 bytes/parameter mixed-precision Adam)")
    parser.add_argument("--overlap", choices=("moe-fold", "megatron", "none"), default=None,
                        help="data-parallel traffic hidden behind compute: moe-fold (default: what the config's "
                             "parallel.overlap_grad_reduce / overlap_param_gather switch on), megatron (both, as "
                             "Megatron-LM's --overlap-grad-reduce --overlap-param-gather) or none")
    parser.add_argument("--set", action="append", default=[], metavar="KEY=VALUE",
                        help="override a config key, e.g. parallel.overlap_grad_reduce=true (repeatable)")
    parser.add_argument("--search", action="store_true", help="rank every valid layout of --world by MFU")
    parser.add_argument("--top", type=int, default=15, help="layouts shown by --search (default 15)")
    parser.add_argument("--json", action="store_true", help="print JSON instead of tables")


def _gb(x: float) -> str:
    return f"{x / 1e9:,.2f}"


def _print_plan(console, plan) -> None:
    from rich.table import Table

    lay = plan.layout
    console.print(f"[bold]{plan.gpu} x {plan.world}[/bold]: attention tp {lay['tp']} x cp {lay['cp']} x "
                  f"dp {lay['dp']} x pp {lay['pp']} (vpp {lay['vpp']}); experts etp {lay['etp']} x ep {lay['ep']} "
                  f"x edp {lay['edp']} x pp {lay['pp']}")
    console.print(f"seq {lay['seq']}, micro-batch {lay['mbs']}, global batch {lay['gbs']} "
                  f"({plan.microbatches} micro-batches per rank), recompute {plan.recompute}, "
                  f"distributed optimizer {'on' if plan.distributed_optimizer else 'off'}")
    assumed = ", ".join(plan.overlaps) if plan.overlaps else "none (every data-parallel byte exposed)"
    console.print(f"overlaps assumed ({plan.overlap_model}): {assumed}")
    ov = plan.moe_overlap
    if ov.get("ep_a2a_s"):
        console.print(f"MoE overlap assumed (moe.shared_expert_overlap, moe.overlap_chunks): shared expert under "
                      f"the all-to-all {'on' if ov['shared_expert_overlap'] else 'off'}, {ov['overlap_chunks']} "
                      f"chunk(s); ep all-to-all {ov['ep_a2a_s']:.4f} s / step, {ov['ep_a2a_exposed_s']:.4f} s exposed")
    c = plan.compute
    if c.get("model") == "shapes":
        console.print(f"compute: each kernel timed from its shape (moe_fold.planner.compute_time): large-GEMM "
                      f"efficiency {c['matmul_efficiency']:.3f} times k/(k + {c['gemm_k_overhead']:g}), "
                      f"{c['elementwise_passes']:g} element-wise passes per layer, {c['attention_kernel']} attention, "
                      f"{c['gemm_dtype']} GEMMs")
    elif c:
        console.print(f"compute: FLOPs at {c['matmul_efficiency']:.2f} x peak (flat model)")
    if plan.routing:
        t, p = plan.routing["busiest_over_mean_time"], plan.routing["busiest_over_mean_peak"]
        console.print(f"measured routing: the busiest ep rank holds {max(t):.3f}x the mean expert rows (worst layer, "
                      f"mean over steps), {max(p):.3f}x at its worst step (memory)")
    pr = plan.params
    console.print(f"parameters: {pr['total'] / 1e9:,.2f} B total, {pr['activated'] / 1e9:,.2f} B activated per "
                  f"token, {pr['rank_max'] / 1e9:,.3f} B on the busiest rank")

    mem = Table(title=None)
    mem.add_column(f"memory per rank (stage {plan.memory['stage']}), {plan.implementation}'s footprint")
    mem.add_column("GB", justify="right")
    for key in ("weights", "grads", "optimizer", "activations", "overhead", "total", "limit"):
        mem.add_row(key, _gb(plan.memory[key]))
    for key in ("master_weights", "main_grads"):
        if plan.memory.get(key):
            mem.add_row(f"(of which {key.replace('_', ' ')}, float32)", _gb(plan.memory[key]))
    other = "optimizer_not_distributed" if plan.distributed_optimizer else "optimizer_distributed"
    mem.add_row(f"({other.replace('_', ' ')})", _gb(plan.memory[other]))
    console.print(mem)

    comm = Table()
    comm.add_column("group")
    comm.add_column("GB sent / rank / step", justify="right")
    comm.add_column("link")
    for kind, nbytes in sorted(plan.comm_bytes.items(), key=lambda kv: -kv[1]):
        comm.add_row(kind, _gb(nbytes), plan.comm_links[kind])
    console.print(comm)

    time = Table()
    time.add_column("step time")
    time.add_column("s", justify="right")
    time.add_column("share", justify="right")
    for key, seconds in plan.time.items():
        time.add_row(key, f"{seconds:.4f}", f"{100 * seconds / plan.time['total']:.1f}%")
    console.print(time)
    fl = plan.flops
    console.print(f"model FLOPs / step {fl['model_per_step']:.3e}; per GPU {fl['model_per_rank_per_s'] / 1e12:,.0f} "
                  f"TFLOP/s achieved (model FLOPs); [bold]MFU {100 * plan.mfu:.1f}%[/bold]"
                  f"{'' if plan.fits else '  [red]does not fit in memory[/red]'}")
    for note in plan.notes:
        console.print(f"note: {note}")


def _print_search(console, plans, top: int, precedents: list) -> None:
    from rich.table import Table

    table = Table(title=None)
    for name in ("tp", "cp", "pp", "vpp", "ep", "etp", "dp", "edp"):
        table.add_column(name, justify="right")
    for name in ("memory GB", "step s", "bubble s", "tp+ep s", "MFU", "closest published precedent"):
        table.add_column(name, justify="right")
    for plan, precedent in zip(plans[:top], precedents):
        lay, t = plan.layout, plan.time
        table.add_row(*(str(lay[k]) for k in ("tp", "cp", "pp", "vpp", "ep", "etp", "dp", "edp")),
                      _gb(plan.memory["total"]), f"{t['total']:.3f}", f"{t['bubble']:.3f}",
                      f"{t.get('tp', 0) + t.get('ep', 0) + t.get('etp', 0):.3f}", f"{100 * plan.mfu:.1f}%",
                      f"{precedent['id']}: {precedent['published']:g} {precedent['metric']}" if precedent else "-")
    console.print(table)


def _print_loads(console, report: dict) -> None:
    from rich.table import Table

    first, last = report["steps"]
    console.print(f"[bold]measured routing[/bold]: {report['source']}, steps {first}..{last} ({report['num_steps']} "
                  f"records), ep {report['ep']}; ratios over the steps after the first re-placement window "
                  f"({report['replace_every']} steps)")
    console.print("busiest ep rank per policy: its expert rows over the ranks' mean (mean over steps, worst "
                  "step), its rows per step in the recorded batch, the step it sets, its experts' share of the "
                  "step, its dropless activation peak and memory")
    table = Table()
    for name in ("policy", "busiest/mean", "worst", "rows/step", "step s", "vs balanced", "experts",
                 "activations GB", "memory GB", "fits", "dropped", "moves"):
        table.add_column(name, justify="left" if name == "policy" else "right", no_wrap=name == "policy")
    for r in report["policies"]:
        table.add_row(r["policy"], f"{r['busiest_over_mean']:.3f}", f"{r['busiest_over_mean_worst']:.3f}",
                      f"{r['busiest_rows_per_step']:,.0f}", f"{r['step_s']:.4g}", f"{r['vs_balanced']:.3f}x",
                      f"{100 * r['experts_share']:.1f}%", _gb(r["activations_peak_bytes"]), _gb(r["memory_bytes"]),
                      "yes" if r["fits"] else "[red]no[/red]", f"{100 * r['dropped_fraction']:.1f}%", str(r["moves"]))
    console.print(table)
    console.print(f"balanced routing: step {report['balanced_step_s']:.4g} s, activations "
                  f"{_gb(report['balanced_activations_bytes'])} GB")
    for row in report["invalid"]:
        console.print(f"not weighed: {row['policy']}: {row['why']}")
    console.print(f"[bold]recommended[/bold]: {report['recommendation'] or 'none'} ({report['why']})")


def _loads_window(text):
    if text is None:
        return None, None
    try:
        first, last = (int(x) if x else None for x in text.split(":"))
    except ValueError:
        raise ValueError(f"--loads-steps={text!r} must be FIRST:LAST (steps, inclusive; either may be empty)") \
            from None
    return first, last


def run(args: argparse.Namespace) -> int:
    from rich.console import Console

    from moe_fold.config import ConfigError
    from moe_fold.planner.estimate import search, with_layout
    from moe_fold.planner.hardware import get_gpu
    from moe_fold.planner.precedent import closest, read_published

    try:
        published = read_published(args.published)
        config, world, gpu_name, assumptions = _inputs(args, published)
        args.world, args.gpu = world, gpu_name
        gpu = get_gpu(gpu_name)
        config = with_layout(config, tp=args.tp, cp=args.cp, pp=args.pp, ep=args.ep, etp=args.etp, vpp=args.vpp,
                             mbs=args.mbs, gbs=args.gbs, seq=args.seq, recompute=args.recompute,
                             distributed=args.distributed_optimizer)
        trace = report = None
        if args.loads is not None:
            from moe_fold.planner.loads import analyse, read_loads

            trace = read_loads(args.loads, *_loads_window(args.loads_steps))
            every = args.replace_every if args.replace_every is not None else (config.moe.replace_every or 10)
        if args.search:
            skew_for = None
            if trace is not None:
                from moe_fold.planner.loads import skew_by_ep

                skew_for = skew_by_ep(trace, config)
            plans = search(config, args.world, gpu, assumptions, skew_for=skew_for)
        else:
            if trace is not None:
                report = analyse(config, args.world, gpu, assumptions, trace, every)
            plans = [_estimate_with_loads(config, args.world, gpu, assumptions, trace)]
    except (ConfigError, ValueError) as e:
        print(f"moe-fold plan: error: {e}", file=sys.stderr)
        return 2
    precedents = [closest(published, plan, args.gpu) for plan in plans[:args.top]]
    if args.json:
        if args.search:
            out = [dict(p.to_dict(), precedent=c) for p, c in zip(plans[:args.top], precedents)]
        else:
            out = dict(plans[0].to_dict(), precedent=precedents[0], loads=report)
        print(json.dumps(out, indent=1))
        return 0
    console = Console(file=sys.stdout, highlight=False)
    # Piped output defaults to 80 columns, which truncates the search table's cells.
    console.width = max(console.width, 160 if args.search or report is not None else 120)
    if not published:
        console.print(f"note: no published measurements found ({args.published or 'bench/published'}): no "
                      "precedents shown")
    if args.search:
        if not plans:
            console.print(f"no layout of world {args.world} fits in {gpu.name}"
                          + (" with its busiest ep rank's measured load" if trace is not None else ""))
            return 1
        console.print(f"{len(plans)} layouts of world {args.world} fit in {gpu.name}"
                      + (f" (on the loads of {trace.source}, the busiest ep rank's memory)" if trace else "")
                      + "; best first:")
        _print_search(console, plans, args.top, precedents)
        console.print("\nbest layout:")
    _print_plan(console, plans[0])
    if precedents[0]:
        console.print(f"closest published precedent: {precedents[0]['text']}")
    if report is not None:
        _print_loads(console, report)
    return 0


def _inputs(args: argparse.Namespace, published: list[dict]):
    """(config, world, GPU key, assumptions) from the command line, or from ``--row`` with
    the command line's flags over the row's (moe_fold.planner.precedent.row_plan's inputs)."""
    from moe_fold.config import load_config
    from moe_fold.planner.estimate import Assumptions, calibrated
    from moe_fold.planner.hardware import get_gpu
    from moe_fold.planner.precedent import find_row, row_assumptions, row_config

    given = {k: v for k, v in (("overlap", args.overlap), ("implementation", args.implementation)) if v is not None}
    if args.fp8:
        given["gemm_dtype"] = "fp8"
    if args.efficiency is not None:
        given["matmul_efficiency"] = args.efficiency
    if args.row is not None:
        if args.config is not None:
            raise ValueError(f"--row={args.row!r} names its own model: drop --config={args.config!r}")
        if args.compute_model != "shapes":
            raise ValueError("--row plans with the calibrated shape model: drop --compute-model flat")
        row = find_row(published, args.row)
        config = row_config(row, tuple(args.set))
        world = args.world if args.world is not None else int(row["world"])
        gpu = (args.gpu if args.gpu is not None else row["gpu"]).lower()
        get_gpu(gpu)
        return config, world, gpu, row_assumptions(dict(row, gpu=gpu), **given)
    if args.config is None or args.world is None:
        raise ValueError("--config and --world are required (or --row ID to plan a published row)")
    gpu = args.gpu if args.gpu is not None else "h100"
    get_gpu(gpu)  # an unknown GPU is named before anything is calibrated for it
    common = dict({"overlap": "moe-fold", "implementation": "moe-fold", "gemm_dtype": "bf16"}, **given)
    if args.compute_model == "shapes":
        assumptions = calibrated(gpu, **common)
    else:
        assumptions = Assumptions(**{"matmul_efficiency": 0.7, **common})
    config = load_config(args.config, [f"train.precision={args.precision}", *args.set])
    return config, args.world, gpu, assumptions


def _estimate_with_loads(config, world, gpu, assumptions, trace):
    """The plan of ``config``'s own placement policy on the measured loads (balanced without)."""
    from moe_fold.planner.estimate import estimate
    from moe_fold.planner.loads import skew_by_ep

    if trace is None:
        return estimate(config, world, gpu, assumptions)
    return estimate(config, world, gpu, assumptions, skew=skew_by_ep(trace, config)(config.parallel.ep))
