"""MoE layer benchmark: forward + backward of one MoE layer, side by side with a
Megatron-Core-style layer in plain torch, Hugging Face transformers' Mixtral sparse MoE
block and the dense equivalent; on one process and on ep gloo ranks.

    python bench/moe_layer.py [--shapes 4096x512x1024x8x2,1024x256x512x16x4] [--ep 1,2,4]
                              [--rounds 7] [--threads 2] [--hf-memory-gib 2]

A shape is ``tokens x hidden x ffn x experts x topk``. Candidates, all float32 with the
same weights and routing (the outputs are checked equal before timing):

- ``ours``: :class:`moe_fold.models.moe_layer.MoELayer` (router, dispatcher, grouped
  GEMM experts, combine), aux loss off like the HF block (which has none inside);
- ``megatron``: :class:`MegatronStyleMoE`, the structure of Megatron-Core's ``MoELayer``
  with its local spec (``TopKRouter``, ``MoEAlltoAllTokenDispatcher``, ``SequentialMLP``)
  written in plain torch: one ``F.linear`` per expert on ``[out, in]`` weights;
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
per shape and ep: ``ms`` per candidate, ``fastest``, ``ratio_vs_megatron`` = megatron /
ours, ``ratio_vs_hf`` = best (fastest) transformers implementation's time / ours (plus
``ratio_vs_hf_each``), ``overhead_vs_dense`` = ours / dense. The same from process CPU time
(``cpu_ms``, ``*_cpu``) beside them: on a shared machine wall-clock time also measures how
long the threads waited for a core. ``swiglu_backend`` (what ours' ``auto`` ran) and
``keeps_freed_memory`` record the setup.

ep > 1: ``ep`` gloo ranks (``--threads // ep`` threads each, at least one), each with
``tokens`` tokens of its own and ``experts / ep`` experts; ``ours`` and ``megatron`` only
(transformers' blocks and the dense MLP have no expert parallelism). Every iteration
starts at a barrier and counts the slowest rank's time.

Every candidate runs with :func:`moe_fold.launch.keep_freed_memory`, as ``moe-fold train``'s
ranks do: glibc's malloc would otherwise unmap and fault in again every tensor of 32 MiB
or more each step, which costs whoever allocates the largest tensors (docs/performance.md).
"""

from __future__ import annotations

import dataclasses

import argparse
import json
import os
import statistics
import time

# Threads that spin at OpenMP barriers on a loaded machine starve the thread they wait
# for (see bench/gemm.py); set before torch starts OpenMP.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
import torch.nn.functional as F  # noqa: E402
from torch import nn  # noqa: E402

from moe_fold.config import Config, ModelConfig, experts_over_ep  # noqa: E402
from moe_fold.launch import keep_freed_memory, run_ranks  # noqa: E402
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups  # noqa: E402
from moe_fold.models.moe_layer import MoELayer  # noqa: E402


def parse_shape(text: str) -> dict:
    try:
        tokens, hidden, ffn, experts, topk = (int(v) for v in text.split("x"))
    except ValueError:
        raise SystemExit(f"--shapes: {text!r} must be tokens x hidden x ffn x experts x topk, e.g. 4096x512x1024x8x2")
    return dict(tokens=tokens, hidden=hidden, ffn=ffn, experts=experts, topk=topk)


def build_ours(shape: dict, seed: int = 0, groups: ProcessGroups | None = None, **moe) -> MoELayer:
    """Our MoE layer of ``shape``; ``moe``: other ``moe.*`` settings (e.g. ``pad_to_capacity``)."""
    config = Config()
    config.model = ModelConfig(hidden_size=shape["hidden"], init_std=0.02)
    m = config.moe
    m.num_experts, m.topk, m.ffn_hidden_size, m.aux_loss_coeff = shape["experts"], shape["topk"], shape["ffn"], 0.0
    config.moe = dataclasses.replace(m, **moe)  # an unknown name is a TypeError
    config.train.seed = seed
    return MoELayer(config, groups or ProcessGroups.single_process(), 0)


class _AllToAll(torch.autograd.Function):
    """``dist.all_to_all_single`` along dim 0 with row splits; the backward swaps them."""

    @staticmethod
    def forward(ctx, x, output_splits, input_splits, group):
        ctx.splits, ctx.group = (output_splits, input_splits), group
        out = x.new_empty(sum(output_splits), *x.shape[1:])
        dist.all_to_all_single(out, x.contiguous(), output_splits, input_splits, group=group)
        return out

    @staticmethod
    def backward(ctx, grad):
        forward_out, forward_in = ctx.splits  # the grads travel back: the splits swap
        out = grad.new_empty(sum(forward_in), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), forward_in, forward_out, group=ctx.group)
        return out, None, None, None


def _sort_chunks(x: torch.Tensor, sizes: list[int], order: list[int]) -> torch.Tensor:
    """Megatron-Core's ``sort_chunks_by_idxs``: split into ``sizes``, concatenate in ``order``."""
    chunks = torch.split(x, sizes)
    return torch.cat([chunks[i] for i in order])


class MegatronStyleMoE(nn.Module):
    """Megatron-Core 0.16's ``MoELayer`` with its local spec, in plain torch, holding the
    weights of ``ours`` (this ep rank's experts; the router is replicated).

    - ``TopKRouter``: logits in float32, top-k, softmax over the k scores, scattered to
      ``probs [T, E]`` and a bool ``routing_map [T, E]``;
    - ``MoEAlltoAllTokenDispatcher``: tokens per expert all-gathered over ep (the one host
      synchronisation), ``permute`` by the transposed routing map (``masked_select`` of
      token indices, ``index_select`` of the rows), all-to-all of the rows and of the
      probs, and with several local experts ``sort_chunks_by_idxs`` (split + cat) from
      ``[source rank][local expert]`` to ``[local expert][source rank]``;
    - ``SequentialMLP``: the rows split per expert, each through its own ``MLP``:
      ``F.linear`` on ``[2F, H]``, ``silu(gate) * up``, times the probs, ``F.linear`` on
      ``[H, F]``, and ``torch.cat`` of the outputs;
    - the combine in reverse: sort back, all-to-all, ``unpermute`` by ``scatter_add`` into
      zeros.
    """

    def __init__(self, ours: MoELayer, ep_group=None):
        super().__init__()
        self.topk, self.num_experts = ours.router.topk, ours.experts.num_experts
        self.ep_group = ep_group
        self.ep = 1 if ep_group is None else dist.get_world_size(ep_group)
        self.ep_rank = 0 if ep_group is None else dist.get_rank(ep_group)
        self.num_local_experts = self.num_experts // self.ep
        self.router_weight = nn.Parameter(ours.router.weight.detach().clone())  # [E, H]
        # Megatron's linears hold [out, in]; ours hold [in, out] per expert.
        self.fc1 = nn.ParameterList(nn.Parameter(w.t().contiguous()) for w in ours.experts.fc1.detach())  # [2F, H]
        self.fc2 = nn.ParameterList(nn.Parameter(w.t().contiguous()) for w in ours.experts.fc2.detach())  # [H, F]
        el, ep = self.num_local_experts, self.ep
        # [source rank][local expert] -> [local expert][source rank], and back.
        self._sort = [r * el + e for e in range(el) for r in range(ep)]
        self._unsort = [e * ep + r for r in range(ep) for e in range(el)]

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        num_tokens, h = hidden.shape
        e, el, ep = self.num_experts, self.num_local_experts, self.ep
        # TopKRouter
        logits = F.linear(hidden.float(), self.router_weight.float())  # [T, E]
        scores, top = torch.topk(logits, self.topk, dim=1)
        probs = torch.zeros_like(logits).scatter(1, top, torch.softmax(scores, dim=-1))
        routing_map = torch.zeros_like(logits, dtype=torch.bool).scatter(1, top, True)
        # Dispatcher preprocess: splits from the per-expert counts of every ep rank.
        counts = routing_map.sum(dim=0)  # [E]
        if ep > 1:
            gathered = counts.new_empty(ep * e)
            dist.all_gather_single(gathered, counts, group=self.ep_group)
            per_source = gathered.view(ep, e)[:, self.ep_rank * el:(self.ep_rank + 1) * el]  # [ep, E_local]
            input_splits = counts.view(ep, el).sum(dim=1).tolist()
            output_splits = per_source.sum(dim=1).tolist()
            chunk_sizes = per_source.reshape(-1).tolist()  # [source][local expert]
            tokens_per_expert = per_source.sum(dim=0).tolist()
        else:
            chunk_sizes = tokens_per_expert = counts.tolist()
        # permute
        mask = routing_map.t().contiguous()  # [E, T]
        token_indices = torch.arange(num_tokens, device=hidden.device).unsqueeze(0).expand(e, -1)
        sorted_indices = token_indices.masked_select(mask)  # [N]
        rows = hidden.index_select(0, sorted_indices)  # [N, H]
        row_probs = probs.t().contiguous().masked_select(mask)  # [N]
        if ep > 1:
            rows = _AllToAll.apply(rows, output_splits, input_splits, self.ep_group)
            row_probs = _AllToAll.apply(row_probs, output_splits, input_splits, self.ep_group)
        if el > 1:
            rows = _sort_chunks(rows, chunk_sizes, self._sort)
            row_probs = _sort_chunks(row_probs, chunk_sizes, self._sort)
        # SequentialMLP
        outs = []
        for x, p, w1, w2 in zip(torch.split(rows, tokens_per_expert), torch.split(row_probs, tokens_per_expert),
                                self.fc1, self.fc2):
            gate, up = torch.chunk(F.linear(x, w1), 2, dim=-1)
            outs.append(F.linear(F.silu(gate) * up * p.unsqueeze(-1), w2))
        out = torch.cat(outs)  # [N_local, H]
        # combine
        if el > 1:
            out = _sort_chunks(out, [chunk_sizes[i] for i in self._sort], self._unsort)
        if ep > 1:
            out = _AllToAll.apply(out, input_splits, output_splits, self.ep_group)
        return torch.zeros(num_tokens, h, dtype=out.dtype, device=out.device).scatter_add(
            0, sorted_indices.unsqueeze(1).expand(-1, h), out)  # [N, H] -> [T, H]


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
    steps["megatron"], diffs["megatron"] = megatron_step(ours, x, grad, reference)
    for impl in hf_impls:
        block = build_hf(shape, ours, impl)
        params = [x] + list(block.parameters())

        def hf_step(block=block, params=params):
            return torch.autograd.grad(block(x.view(1, tokens, hidden)).view(tokens, hidden), params, grad)

        with torch.no_grad():
            diffs[impl] = (block(x.view(1, tokens, hidden)).view(tokens, hidden) - reference).abs().max().item()
        steps[f"hf:{impl}"] = hf_step
    return steps, diffs


def megatron_step(ours: MoELayer, x: torch.Tensor, grad: torch.Tensor, reference: torch.Tensor, ep_group=None):
    """``(step, max_abs_diff)`` of the Megatron-Core-style layer holding ``ours``' weights;
    raises if its output is not ours' (the same layer, so the same numbers up to rounding)."""
    layer = MegatronStyleMoE(ours, ep_group)
    params = [x] + list(layer.parameters())
    with torch.no_grad():
        diff = (layer(x) - reference).abs().max().item()
    if diff > 1e-4 * max(1.0, reference.abs().max().item()):
        raise RuntimeError(f"megatron-style layer differs from ours by {diff}: not the same layer")

    def step():
        return torch.autograd.grad(layer(x), params, grad)

    return step, diff


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


def resolve_swiglu() -> str:
    """The SwiGLU backend ours runs on CPU here (``auto``: the C kernels; kernels/backends.py)."""
    from moe_fold.kernels.swiglu import resolve_backend

    return resolve_backend("auto", torch.zeros(1, 2))


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
        "swiglu_backend": resolve_swiglu(), "keeps_freed_memory": args.keeps_freed_memory,
        "ep": 1, "ms": _rounded(ms), "cpu_ms": _rounded(cpu_ms),
        "fastest": min((name for name in ms if not name.startswith("gemm:") and name != "dense"), key=ms.get),
        "ratio_vs_megatron": round(ms["megatron"] / ms["ours"], 3),
        "ratio_vs_megatron_cpu": round(cpu_ms["megatron"] / cpu_ms["ours"], 3),
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


def rank_main(rank: int, world_size: int, shapes: list[dict], args) -> list[dict]:
    """One ep rank's part of :func:`bench_ep`: ``ms`` of each candidate per shape (rank 0's
    medians of the slowest rank's times)."""
    kept = keep_freed_memory("cpu")  # gloo ranks
    groups = create_process_groups(ParallelLayout(world_size, ep=world_size))
    results = []
    for shape in shapes:
        ours = build_ours(shape, groups=groups)
        gen = torch.Generator().manual_seed(1 + rank)
        x = torch.randn(shape["tokens"], shape["hidden"], generator=gen).requires_grad_()
        grad = torch.randn(shape["tokens"], shape["hidden"], generator=gen)
        params = [x] + list(ours.parameters())
        steps = {"ours": lambda ours=ours, params=params: torch.autograd.grad(ours(x), params, grad)}
        reference = ours(x).detach()
        steps["megatron"], diff = megatron_step(ours, x, grad, reference, groups.ep)
        for step in steps.values():  # warm-up
            step()
        times = {name: [] for name in steps}
        for _ in range(args.rounds):
            for name, step in steps.items():
                per_iter = torch.empty(args.iters, dtype=torch.float64)
                for i in range(args.iters):
                    dist.barrier()
                    start = time.perf_counter()
                    step()
                    per_iter[i] = time.perf_counter() - start
                dist.all_reduce(per_iter, op=dist.ReduceOp.MAX)  # the slowest rank, per iteration
                times[name].append(per_iter.mean().item())
        diffs = torch.tensor([diff], dtype=torch.float64)
        dist.all_reduce(diffs, op=dist.ReduceOp.MAX)
        results.append({"ms": {name: statistics.median(t) * 1e3 for name, t in times.items()},
                        "max_abs_diff_vs_megatron": diffs.item(), "keeps_freed_memory": kept})
    return results


def bench_ep(shapes: list[dict], ep: int, args) -> None:
    """``ours`` and ``megatron`` on ``ep`` gloo ranks: one JSON line per shape."""
    threads = max(1, args.threads // ep)
    (results, *_) = run_ranks(rank_main, ep, shapes, args, threads=threads, timeout=args.timeout)
    for shape, r in zip(shapes, results):
        ms = r["ms"]
        print(json.dumps({
            "bench": "moe_layer", **shape, "ep": ep, "dtype": "float32", "threads_per_rank": threads,
            "swiglu_backend": resolve_swiglu(), "keeps_freed_memory": r["keeps_freed_memory"],
            "rounds": args.rounds, "ms": _rounded(ms), "fastest": min(ms, key=ms.get),
            "ratio_vs_megatron": round(ms["megatron"] / ms["ours"], 3),
            "max_abs_diff_vs_megatron": r["max_abs_diff_vs_megatron"],
        }), flush=True)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="4096x512x1024x8x2,1024x256x512x16x4")
    p.add_argument("--rounds", type=int, default=7, help="interleaved timing rounds (median reported)")
    p.add_argument("--iters", type=int, default=3, help="steps per candidate and round")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--hf-memory-gib", type=float, default=2.0,
                   help="largest gathered-weight memory transformers' batched_mm may use")
    p.add_argument("--ep", default="1,2,4",
                   help="comma list of expert-parallel sizes; each size > 1 runs on that many gloo ranks")
    p.add_argument("--timeout", type=float, default=3600.0, help="seconds the ranks of one ep size may take")
    args = p.parse_args(argv)
    try:
        eps = [int(v) for v in args.ep.split(",")]
    except ValueError:
        raise SystemExit(f"--ep: {args.ep!r} must be a comma list of positive integers, e.g. 1,2,4")
    if any(ep < 1 for ep in eps):
        raise SystemExit(f"--ep: {args.ep!r} must be a comma list of positive integers, e.g. 1,2,4")
    shapes = [parse_shape(text) for text in args.shapes.split(",")]
    for ep in eps:  # before any timing starts
        for shape in shapes:
            problems = experts_over_ep(shape["experts"], ep)
            if problems:
                raise SystemExit(f"--ep {ep}: shape {shape['tokens']}x{shape['hidden']}x{shape['ffn']}x"
                                 f"{shape['experts']}x{shape['topk']}: {problems[0]}")
    args.keeps_freed_memory = keep_freed_memory("cpu")  # every candidate runs on the CPU
    torch.set_num_threads(args.threads)
    for ep in eps:
        if ep == 1:
            for shape in shapes:
                bench_shape(shape, args)
        else:
            bench_ep(shapes, ep, args)


if __name__ == "__main__":
    main()
