"""MoE layer benchmark: forward + backward of one MoE layer on one process, side by side
with Hugging Face transformers' Mixtral sparse MoE block and with the dense equivalent.

    python bench/moe_layer.py [--shapes 4096x512x1024x8x2,1024x256x512x16x4]
                              [--rounds 7] [--threads 2] [--hf-memory-gib 2]

A shape is ``tokens x hidden x ffn x experts x topk``. Candidates, all float32 with the
same weights and routing (the outputs are checked equal before timing):

- ``ours``: :class:`moe_fold.models.moe_layer.MoELayer` (router, dispatcher, grouped
  GEMM experts, combine), aux loss off like the HF block (which has none inside);
- ``hf:<impl>``: ``MixtralSparseMoeBlock`` built from a ``MixtralConfig`` in code, once
  per experts implementation transformers registers (``eager`` plus
  ``ALL_EXPERTS_FUNCTIONS``); one that cannot run here (CUDA-only kernels) gets a
  ``skipped`` line with the reason. ``batched_mm`` gathers one weight matrix per
  (token, expert) pair, ``tokens*topk*3*hidden*ffn*4`` bytes and as much again for its
  gradient; where that exceeds ``--hf-memory-gib`` it is timed, with ``ours``, at the
  largest power-of-two token count that fits (its own JSON line says which);
- ``dense``: one SwiGLU MLP (``[H, 2F]``, ``[F, H]``) over ``tokens*topk`` rows: the same
  GEMM FLOPs with no routing, permutation or grouping, the practical limit;
- ``gemm:ours`` / ``gemm:dense``: only the six GEMMs of each (fc1 and fc2: forward, dx,
  dw), ours grouped with the per-expert row counts its router gives the benchmark's
  input. ``gemm_overhead_vs_dense`` is what grouping alone costs;
  ``overhead_vs_dense_gemm_floor`` is the ``overhead_vs_dense`` ours would have if every
  other part (routing, permutation, SwiGLU) cost exactly what the dense MLP's SwiGLU does.

Timing: every step is forward + ``autograd.grad`` of the output w.r.t. the input and all
weights (no ``.grad`` accumulation); candidates are timed interleaved, round after round,
each round the mean of ``--iters`` steps; medians over rounds are reported. One JSON line
per shape: ``ms`` per candidate, ``ratio_vs_hf`` = best (fastest) transformers
implementation's time / ours (plus ``ratio_vs_hf_each``), ``overhead_vs_dense`` = ours /
dense. The same from process CPU time (``cpu_ms``, ``*_cpu``) beside them: on a shared
machine wall-clock time also measures how long the threads waited for a core.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

# Threads that spin at OpenMP barriers on a loaded machine starve the thread they wait
# for (see bench/gemm.py); set before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moe_fold.config import Config, ModelConfig  # noqa: E402
from moe_fold.layout import ProcessGroups  # noqa: E402
from moe_fold.models.moe_layer import MoELayer  # noqa: E402


def parse_shape(text: str) -> dict:
    try:
        tokens, hidden, ffn, experts, topk = (int(v) for v in text.split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} must be tokens x hidden x ffn x experts x topk, e.g. 4096x512x1024x8x2")
    return dict(tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, topk=topk)


def build_ours(shape: dict, seed: int = 0) -> MoELayer:
    config = Config()
    config.model = ModelConfig(hidden_size=shape["hidden"], init_std=0.02)
    m = config.moe
    m.num_experts, m.topk, m.ffn_hidden_size, m.aux_loss_coeff = shape["experts"], shape["topk"], shape["ffn"], 0.0
    config.train.seed = seed
    return MoELayer(config, ProcessGroups.single_process(), 0)


def hf_implementations() -> list[str]:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ["eager"] + [name for name in ALL_EXPERTS_FUNCTIONS if name != "eager"]


def build_hf(shape: dict, ours: MoELayer, impl: str):
    """The transformers Mixtral block with ``ours``' weights (HF stores ``[out, in]``)."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralSparseMoeBlock

    config = MixtralConfig(hidden_size=shape["hidden"], intermediate_size=shape["ffn"],
                           num_local_experts=shape["experts"], num_experts_per_tok=shape["topk"],
                           router_jitter_noise=0.0)
    config._experts_implementation = impl
    block = MixtralSparseMoeBlock(config)
    with torch.no_grad():
        block.gate.weight.copy_(ours.router.weight)
        block.experts.gate_up_proj.copy_(ours.experts.fc1.transpose(1, 2))  # [E, H, 2F] -> [E, 2F, H]
        block.experts.down_proj.copy_(ours.experts.fc2.transpose(1, 2))  # [E, F, H] -> [E, H, F]
    return block.train()


def batched_mm_bytes(shape: dict, tokens: int) -> int:
    """Gathered per-pair weights of transformers' batched_mm and their gradient."""
    return 2 * tokens * shape["topk"] * 3 * shape["hidden"] * shape["ffn"] * 4


def make_steps(shape: dict, tokens: int, ours: MoELayer, hf_impls: list[str]):
    """``name -> step()`` for ours, each HF implementation and (full size only) dense;
    also the largest output difference of each HF block from ours."""
    gen = torch.Generator().manual_seed(1)
    hidden = shape["hidden"]
    x = torch.randn(tokens, hidden, generator=gen).requires_grad_()
    grad = torch.randn(tokens, hidden, generator=gen)
    ours_params = [x] + list(ours.parameters())

    def ours_step():
        return torch.autograd.grad(ours(x), ours_params, grad)

    steps, diffs = {"ours": ours_step}, {}
    reference = ours(x).detach()
    for impl in hf_impls:
        block = build_hf(shape, ours, impl)
        params = [x] + list(block.parameters())

        def hf_step(block=block, params=params):
            return torch.autograd.grad(block(x.view(1, tokens, hidden)).view(tokens, hidden), params, grad)

        with torch.no_grad():
            diffs[impl] = (block(x.view(1, tokens, hidden)).view(tokens, hidden) - reference).abs().max().item()
        steps[f"hf:{impl}"] = hf_step
    return steps, diffs


def make_dense_step(shape: dict):
    gen = torch.Generator().manual_seed(2)
    rows, hidden, ffn = shape["tokens"] * shape["topk"], shape["hidden"], shape["ffn"]
    x = torch.randn(rows, hidden, generator=gen).requires_grad_()
    w1 = (torch.randn(hidden, 2 * ffn, generator=gen) * 0.02).requires_grad_()
    w2 = (torch.randn(ffn, hidden, generator=gen) * 0.02).requires_grad_()
    grad = torch.randn(rows, hidden, generator=gen)

    def dense_step():
        gate, up = (x @ w1).chunk(2, dim=-1)  # [rows, H] -> [rows, F] each
        return torch.autograd.grad((F.silu(gate) * up) @ w2, [x, w1, w2], grad)

    return dense_step


def make_gemm_steps(shape: dict, ours: MoELayer) -> dict:
    """The six GEMMs alone (fc1 and fc2: forward, dx, dw), grouped as ours runs them (its
    own per-expert row counts for the benchmark's input) and dense as the dense equivalent
    runs them: ``gemm:ours`` / ``gemm:dense`` is the part of ``overhead_vs_dense`` that the
    grouped GEMM costs by itself, before routing, permutation or the activation."""
    from moe_fold.kernels.gmm import gmm

    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape["tokens"], shape["hidden"], generator=gen)
    with torch.no_grad():
        routing = ours.router(x)
        counts = ours.dispatcher.dispatch(x, routing.probs, routing.routing_map).tokens_per_local_expert
    rows, hidden, ffn = int(counts.sum()), shape["hidden"], shape["ffn"]
    a = torch.randn(rows, hidden, generator=gen).requires_grad_()
    b = torch.randn(rows, ffn, generator=gen).requires_grad_()
    g1, g2 = torch.randn(rows, 2 * ffn, generator=gen), torch.randn(rows, hidden, generator=gen)
    fc1, fc2 = ours.experts.fc1.detach().requires_grad_(), ours.experts.fc2.detach().requires_grad_()
    w1, w2 = fc1[0].detach().clone().requires_grad_(), fc2[0].detach().clone().requires_grad_()
    backend = ours.experts.gemm_backend

    def grouped():
        torch.autograd.grad(gmm(a, fc1, counts, backend=backend), [a, fc1], g1)
        return torch.autograd.grad(gmm(b, fc2, counts, backend=backend), [b, fc2], g2)

    def dense():
        torch.autograd.grad(a @ w1, [a, w1], g1)
        return torch.autograd.grad(b @ w2, [b, w2], g2)

    return {"gemm:ours": grouped, "gemm:dense": dense}


def time_interleaved(steps: dict, rounds: int, iters: int) -> tuple[dict, dict]:
    """Median wall-clock and process-CPU milliseconds per step of each candidate."""
    for step in steps.values():  # warm-up: allocator, caches
        step()
    wall, cpu = {name: [] for name in steps}, {name: [] for name in steps}
    for _ in range(rounds):
        for name, step in steps.items():
            w0, c0 = time.perf_counter(), time.process_time()
            for _ in range(iters):
                step()
            wall[name].append((time.perf_counter() - w0) / iters)
            cpu[name].append((time.process_time() - c0) / iters)
    return ({name: statistics.median(t) * 1e3 for name, t in wall.items()},
            {name: statistics.median(t) * 1e3 for name, t in cpu.items()})


def _rounded(values: dict) -> dict:
    return {k: round(v, 3) for k, v in values.items()}


def runnable(shape: dict, ours: MoELayer, impl: str):
    """None if ``impl`` runs here, else the reason it cannot."""
    try:
        block = build_hf(shape, ours, impl)
        block(torch.randn(1, 4, shape["hidden"]))
    except Exception as err:  # noqa: BLE001 - the reason is reported, nothing is hidden
        return f"{type(err).__name__}: {str(err).splitlines()[0][:200]}"
    return None


def bench_shape(shape: dict, args) -> None:
    ours = build_ours(shape)
    impls = []
    for impl in hf_implementations():
        reason = runnable(shape, ours, impl)
        if reason is None:
            impls.append(impl)
        else:
            print(json.dumps({"bench": "moe_layer", **shape, "candidate": f"hf:{impl}", "skipped": reason}))
    budget = args.hf_memory_gib * 2 ** 30
    fits = [i for i in impls if i != "batched_mm" or batched_mm_bytes(shape, shape["tokens"]) <= budget]
    too_big = [i for i in impls if i not in fits]

    steps, diffs = make_steps(shape, shape["tokens"], ours, fits)
    steps["dense"] = make_dense_step(shape)
    steps.update(make_gemm_steps(shape, ours))
    ms, cpu_ms = time_interleaved(steps, args.rounds, args.iters)
    # If everything but the GEMMs cost ours exactly what it costs the dense equivalent,
    # overhead_vs_dense would be this: the GEMMs' own share of the budget.
    gemm_floor = (ms["dense"] - ms["gemm:dense"] + ms["gemm:ours"]) / ms["dense"]
    each = {name[3:]: ms[name] / ms["ours"] for name in ms if name.startswith("hf:")}
    each_cpu = {name[3:]: cpu_ms[name] / cpu_ms["ours"] for name in ms if name.startswith("hf:")}
    print(json.dumps({
        "bench": "moe_layer", **shape, "dtype": "float32", "threads": args.threads, "rounds": args.rounds,
        "ms": _rounded(ms), "cpu_ms": _rounded(cpu_ms),
        "ratio_vs_hf": round(min(each.values()), 3) if each else None,
        "best_hf": min(each, key=each.get) if each else None,
        "ratio_vs_hf_each": _rounded(each),
        "overhead_vs_dense": round(ms["ours"] / ms["dense"], 3),
        "ratio_vs_hf_cpu": round(min(each_cpu.values()), 3) if each_cpu else None,
        "overhead_vs_dense_cpu": round(cpu_ms["ours"] / cpu_ms["dense"], 3),
        "gemm_overhead_vs_dense": round(ms["gemm:ours"] / ms["gemm:dense"], 3),
        "gemm_overhead_vs_dense_cpu": round(cpu_ms["gemm:ours"] / cpu_ms["gemm:dense"], 3),
        "gemm_share_of_dense": round(ms["gemm:dense"] / ms["dense"], 3),
        "overhead_vs_dense_gemm_floor": round(gemm_floor, 3),
        "max_abs_diff_vs_hf": diffs,
    }))

    for impl in too_big:
        tokens = shape["tokens"]
        while tokens > 1 and batched_mm_bytes(shape, tokens) > budget:
            tokens //= 2
        steps, diffs = make_steps(shape, tokens, ours, [impl])
        ms, cpu_ms = time_interleaved(steps, args.rounds, args.iters)
        print(json.dumps({
            "bench": "moe_layer", **shape, "tokens": tokens, "dtype": "float32", "threads": args.threads,
            "note": f"hf:{impl} needs {batched_mm_bytes(shape, shape['tokens']) / 2 ** 30:.1f} GiB at "
                    f"{shape['tokens']} tokens; both timed at {tokens} tokens",
            "ms": _rounded(ms), "cpu_ms": _rounded(cpu_ms),
            "ratio_vs_hf": round(ms[f"hf:{impl}"] / ms["ours"], 3),
            "ratio_vs_hf_cpu": round(cpu_ms[f"hf:{impl}"] / cpu_ms["ours"], 3),
            "max_abs_diff_vs_hf": diffs,
        }))


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4096x512x1024x8x2,1024x256x512x16x4")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (median reported)")
    p.add_argument("--iters", type=int, default=3, help="steps per candidate and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hf-memory-gib", type=float, default=2.0,
                   help="largest gathered-weight memory transformers' batched_mm may use")
    args = p.parse_args(argv)
    torch.set_num_threads(args.threads)
    for text in args.shapes.split(","):
        bench_shape(parse_shape(text), args)


if __name__ == "__main__":
    main()
