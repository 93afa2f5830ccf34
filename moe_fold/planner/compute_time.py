"""Seconds of compute one rank spends on one micro-batch, from the shapes of its kernels.

The flat model (``Assumptions.compute_model="flat"``) divides a stage's FLOPs by one rate,
``peak x matmul_efficiency``. This one (``"shapes"``, the default) times each kernel from its
shape on the GPU's figures (:mod:`moe_fold.planner.hardware`), so that small GEMMs (narrow
experts, few rows per expert, a thin tp slice), attention and the memory-bound work between
GEMMs cost what they cost, and one pair of constants holds across models and layouts:

- a GEMM ``[m, k] x [k, n]`` (2mkn FLOPs) runs in ``max(2mkn / (peak e q), B / hbm)``: ``e``
  (``Assumptions.matmul_efficiency``) is what a large, tile-aligned GEMM reaches; ``q =
  mn / (ceil(m/128) 128 ceil(n/128) 128)`` is the share of the 128 x 128 output tiles that
  holds real rows and columns (tile quantization: a 200-row expert runs 256 rows); the
  compute term is scaled by ``(k + k0)/k``: every output tile pays a fixed prologue and
  epilogue (loading its first operand tiles, writing and converting its output) worth ``k0``
  of the reduction dimension, so a GEMM with a short ``k`` (a narrow expert's second GEMM, an
  etp-split expert) reaches less of ``e`` (``k0``, ``Assumptions.gemm_k_overhead``, is fitted
  with ``e``); ``B = a (mk + kn + mn)`` the bytes it must read and write (roofline: a GEMM
  with a small side is bound by HBM). Every forward GEMM has two backward GEMMs of the same FLOPs, the input
  gradient ``[m, n] x [n, k]`` and the weight gradient ``[k, m] x [m, n]``; recompute reruns
  the forward GEMMs of what it recomputes (the parts of
  :func:`moe_fold.planner.model._recomputed_forward`);
- the attention core: ``flash`` kernels compute only the causal half of the ``s x s``
  products the FLOPs count (:mod:`moe_fold.planner.model`), forward (and recompute) at
  ``peak x gpu.flash_forward`` and backward (twice the products) at ``peak x
  gpu.flash_backward``, the kernel benchmarks' shares of :mod:`moe_fold.planner.hardware`,
  not the GEMM efficiency: a flash kernel is not a GEMM; ``unfused``
  kernels (Megatron-LM 2019 and 2021) compute all of them as batched GEMMs and move the
  ``b heads s s`` scores through HBM: written by the first GEMM, read and written by the
  softmax, read by the second, and twice that backward (12 passes);
- element-wise work is bound by HBM: ``Assumptions.elementwise_passes`` reads or writes of a
  ``[tokens, H]`` activation per layer forward (norms, residual adds, rotary, dropout, bias),
  on the tokens a rank holds (``s b/(cp tp)`` under sequence parallelism, ``s b/cp``
  without), and the MLP's and experts' activation function over its ``[rows, 2F]`` input and
  ``[rows, F]`` output; the backward moves twice the forward's bytes. The dispatcher copies
  every routed ``[H]`` row 8 times (permute and unpermute, forward and backward), and
  every held row 4 more when it sorts the received chunks.

The expert GEMMs see ``rows / local experts`` rows each: balanced routing gives every
expert of a rank ``s b topk etp/(cp tp E/ep)`` rows; ``expert_rows`` scales them per MoE
layer (the busiest rank under measured routing, :mod:`moe_fold.planner.loads`).

FP8 (``Assumptions.gemm_dtype="fp8"``): the linear layers' GEMMs (not the attention core)
run at ``gpu.fp8_flops`` and read one-byte operands, after a cast of their ``[m, k]`` input
(read 2 bytes, write 1 per element); everything else as under BF16.
Not modelled: wave quantization over the SMs, kernel launch gaps, the CPU, and any slow-down
of a kernel by the communication that overlaps it.
"""

from __future__ import annotations

import math
from typing import Optional, Sequence

from moe_fold.config import Config, etp_size
from moe_fold.planner.hardware import GPU
from moe_fold.planner.model import act_bytes, dims, held_rows_per_token, stage_blocks

__all__ = ["TILE", "ATTENTION_KERNELS", "GEMM_DTYPES", "gemm_seconds", "microbatch_compute"]

TILE = 128
ATTENTION_KERNELS = ("flash", "unfused")
GEMM_DTYPES = ("bf16", "fp8")
# Passes over the s x s scores of an unfused attention, forward and backward (see the module doc).
_SCORE_PASSES = 12
# Reads and writes of a routed row, forward and backward: the permute and the unpermute
# each read and write it once forward and once backward.
_DISPATCH_PASSES = 8


def gemm_seconds(m: float, k: float, n: float, peak: float, efficiency: float, hbm_bw: float,
                 operand_bytes: float, out_bytes: float, k_overhead: float = 0.0) -> float:
    """Seconds of one ``[m, k] x [k, n]`` GEMM (see the module doc)."""
    if m <= 0 or k <= 0 or n <= 0:
        return 0.0
    tiles = math.ceil(m / TILE) * TILE * math.ceil(n / TILE) * TILE
    quantized = m * n / tiles
    compute = 2 * m * k * n / (peak * efficiency * quantized) * (k + k_overhead) / k
    memory = (operand_bytes * (m * k + k * n) + out_bytes * m * n) / hbm_bw
    return max(compute, memory)


def _training_gemm(m: float, k: float, n: float, count: float, rerun: bool, rate) -> float:
    """Forward, both backward GEMMs and (``rerun``) the recomputed forward of ``count``
    GEMMs ``[m, k] x [k, n]``."""
    forward = rate(m, k, n)
    return count * ((2 if rerun else 1) * forward + rate(m, n, k) + rate(k, m, n))


def microbatch_compute(config: Config, pp_rank: int, recompute: str, gpu: GPU, efficiency: float,
                       elementwise_passes: float, attention: str = "flash", gemm_dtype: str = "bf16",
                       expert_rows: Optional[Sequence[float]] = None, k_overhead: float = 0.0) -> dict[str, float]:
    """Seconds one rank of stage ``pp_rank`` computes for one micro-batch, forward, backward
    and recompute, by part: ``gemm`` (linear layers, dense and shared), ``experts``,
    ``attention`` (the core), ``elementwise``; and ``total``. ``expert_rows``: per MoE
    layer of the stage, the rows this rank's experts get over the balanced count (default 1)."""
    if attention not in ATTENTION_KERNELS:
        raise ValueError(f"attention={attention!r} must be one of {', '.join(ATTENTION_KERNELS)}")
    if gemm_dtype not in GEMM_DTYPES:
        raise ValueError(f"gemm_dtype={gemm_dtype!r} must be one of {', '.join(GEMM_DTYPES)}")
    if attention == "flash" and not (gpu.flash_forward and gpu.flash_backward):
        raise ValueError(f"attention='flash' needs a flash attention kernel; {gpu.name} has none listed "
                         "(use the unfused kernel)")
    d, p = dims(config), config.parallel
    a = act_bytes(config)
    tp, cp, etp = p.tp, p.cp, etp_size(config)
    sp = p.sequence_parallel and tp > 1
    tokens = config.train.micro_batch_size * d.seq / cp  # rows of a tp-split GEMM
    local = tokens / tp  # the tokens a rank routes and holds under SP
    held_tokens = local if sp else tokens  # the rows element-wise work runs on
    if gemm_dtype == "fp8":
        if not gpu.fp8_flops:
            raise ValueError(f"gemm_dtype='fp8' needs a GPU with FP8 tensor cores; {gpu.name} has none listed")
        linear_peak, operand = gpu.fp8_flops, 1
    else:
        linear_peak, operand = gpu.peak_flops, a

    def linear(m, k, n):
        seconds = gemm_seconds(m, k, n, linear_peak, efficiency, gpu.hbm_bw, operand, a, k_overhead)
        if gemm_dtype == "fp8":  # the input is cast to FP8 first: read 2 bytes, write 1
            seconds += (a + 1) * m * k / gpu.hbm_bw
        return seconds

    blocks = stage_blocks(config, pp_rank)
    moe_blocks = [i for i in blocks if d.moe_flags[i]]
    if expert_rows is None:
        expert_rows = [1.0] * len(moe_blocks)
    elif len(expert_rows) != len(moe_blocks):
        raise ValueError(f"expert_rows has {len(expert_rows)} entries, expected one per MoE layer of stage "
                         f"{pp_rank} ({len(moe_blocks)})")
    scale = dict(zip(moe_blocks, expert_rows))
    out = {"gemm": 0.0, "experts": 0.0, "attention": 0.0, "elementwise": 0.0}
    for i in blocks:
        is_moe = d.moe_flags[i]
        full = recompute == "full"
        # Attention projections (rerun under full recompute).
        if d.mla:
            for name, rows, cols in d.mla:
                if name in ("q_down", "kv_down"):  # replicated over tp: each rank its own tokens
                    out["gemm"] += _training_gemm(local, cols, rows, 1, full, linear)
                else:
                    out["gemm"] += _training_gemm(tokens, cols, rows / tp, 1, full, linear)
        else:
            out["gemm"] += _training_gemm(tokens, d.hidden, (d.q_size + 2 * d.kv_size) / tp, 1, full, linear)
            out["gemm"] += _training_gemm(tokens, d.q_size / tp, d.hidden, 1, full, linear)
        # Attention core: scores and context over the sequence, per sequence and local head.
        heads = d.heads / tp
        qk = d.qk_head if d.mla else d.head_dim
        v = d.v_head if d.mla else d.head_dim
        flops = 2 * tokens * d.seq * heads * (qk + v)  # forward, full s x s, as the FLOPs count it
        passes = 3 + full  # forward, backward (2x), recompute
        if attention == "flash":
            # The causal half of the counted products, at the flash kernel's own rates
            # (hardware.GPU.flash_forward / flash_backward): forward and recompute once each,
            # the backward's two products.
            causal = 0.5 * flops
            out["attention"] += (1 + full) * causal / (gpu.peak_flops * gpu.flash_forward) \
                + 2 * causal / (gpu.peak_flops * gpu.flash_backward)
        else:
            scores = config.train.micro_batch_size * heads * (d.seq / cp) * d.seq * a
            out["attention"] += passes * flops / (gpu.peak_flops * efficiency) \
                + (_SCORE_PASSES + 4 * full) * scores / gpu.hbm_bw
        # Element-wise passes over the block's activations.
        elementwise = elementwise_passes * a * d.hidden * held_tokens
        if is_moe:
            rows = local * held_rows_per_token(config) * etp * scale[i]
            slots = d.experts // p.ep + d.replicas
            per_expert = rows / slots
            rerun = recompute in ("full", "moe")
            fe = d.expert_ffn / etp
            out["gemm"] += _training_gemm(local, d.hidden, d.experts + d.zero_experts, 1, False, linear)  # router
            if d.latent:  # the latent MoE's projections, H -> L and L -> H, never recomputed
                out["gemm"] += _training_gemm(local, d.hidden, d.latent, 1, False, linear)
                out["gemm"] += _training_gemm(local, d.latent, d.hidden, 1, False, linear)
            w = d.expert_width
            out["experts"] += _training_gemm(per_expert, w, 2 * fe, slots, rerun, linear)
            out["experts"] += _training_gemm(per_expert, fe, w, slots, rerun or recompute == "expert_act", linear)
            elementwise += 3 * a * fe * rows
            # Dispatch and combine copy every routed row: permute and unpermute forward,
            # their scatters backward; the sort of received chunks twice more when it runs.
            sorts = sum(n > 1 for n in (etp, p.ep, d.experts // p.ep)) >= 2
            routed = local * held_rows_per_token(config)
            out["elementwise"] += (_DISPATCH_PASSES * routed + (4 * rows if sorts else 0)) * 2 * a * w \
                / gpu.hbm_bw
            if d.shared_ffn:
                out["gemm"] += _training_gemm(tokens, d.hidden, 2 * d.shared_ffn / tp, 1, rerun, linear)
                out["gemm"] += _training_gemm(tokens, d.shared_ffn / tp, d.hidden, 1, rerun, linear)
                elementwise += 3 * a * d.shared_ffn / tp * tokens
        else:
            out["gemm"] += _training_gemm(tokens, d.hidden, 2 * d.ffn / tp, 1, full, linear)
            out["gemm"] += _training_gemm(tokens, d.ffn / tp, d.hidden, 1, full, linear)
            elementwise += 3 * a * d.ffn / tp * tokens
        out["elementwise"] += (3 + full) * elementwise / gpu.hbm_bw
    if pp_rank == p.pp - 1:
        heads_run = 1 + d.mtp
        out["gemm"] += _training_gemm(tokens, d.hidden, d.vocab / tp, heads_run, False, linear)
        out["gemm"] += _training_gemm(local, 2 * d.hidden, d.hidden, d.mtp, False, linear)
    out["total"] = sum(out.values())
    return out
