"""Gated DeltaNet, KDA and Mamba2 under context parallelism: each rank keeps its zigzag segments,
the conv windows and the recurrent states pass along the segments in sequence order
(moe_fold/parallel/recurrent_cp.py); the outputs, the input gradients and the summed
parameter gradients equal one process's, with and without packed documents. KDA's state
decays per key channel, and its segment map is still affine in the start state; Mamba2's
decays by one scalar per head."""

from __future__ import annotations

import math

import pytest
import torch
import torch.distributed as dist

from moe_fold.comm import group_rank, group_size
from moe_fold.config import ModelConfig
from moe_fold.launch import run_ranks
from moe_fold.models.gated_deltanet import GatedDeltaNet
from moe_fold.models.kda import KimiDeltaAttention
from moe_fold.models.mamba2 import Mamba2
from moe_fold.parallel.context_parallel import zigzag_gather, zigzag_split
from moe_fold.parallel.tensor_parallel import shard_tp
from moe_fold.parallel.varlen import Documents

S, B, H = 24, 2, 20


# Odd sizes; chunks of 4 cut the cp4 segments (3 tokens) and the documents unevenly.
# Gated DeltaNet: 2 key heads over 4 value heads of 6/5; KDA: 2 heads of 6.
LAYERS = {"gated_deltanet": (GatedDeltaNet, dict(linear_num_value_heads=4, linear_value_head_dim=5)),
          "kda": (KimiDeltaAttention, dict(linear_num_value_heads=2, linear_value_head_dim=6)),
          # Mamba2: 6 heads of 5 in 2 groups, state 7, chunks of 4.
          "mamba2": (Mamba2, dict(mamba_num_heads=6, mamba_head_dim=5, mamba_state_size=7, mamba_num_groups=2,
                                  mamba_conv_kernel=4, mamba_chunk_size=4))}


def _config(kind: str) -> ModelConfig:
    return ModelConfig(hidden_size=H, linear_num_key_heads=2, linear_key_head_dim=6, linear_conv_kernel=4,
                       linear_chunk_size=4, init_std=0.2, **LAYERS[kind][1])


def _layer(kind: str, tp_group, sequence_parallel, **where):
    """The layer with slow decays (exp(A_log) = 0.05, dt_bias = -2: about 0.01 per token;
    KDA: per channel, a few channels faster): with the initial decay rates (1 to 16) a
    segment of 3 to 6 tokens forgets its start state (the transition reaches 1e-17), and a
    state not passed along cp, or not reset at a document start, would not show."""
    layer = LAYERS[kind][0](_config(kind), tp_group, sequence_parallel, **where)
    if kind == "mamba2":
        with torch.no_grad():
            # Mamba2: exp(A_log) = 0.05 and a step near 0.13; its conv bias drawn too, so a
            # conv window carried across a document start would show.
            layer.A_log.fill_(math.log(0.05))
            layer.dt_bias.fill_(-2.0)
            parts = [6 * 5, 2 * 7, 2 * 7]  # x|B|C channels: the global bias, this tp rank's shard
            bias = torch.randn(sum(parts), generator=torch.Generator().manual_seed(5))
            layer.conv_bias.copy_(shard_tp(bias, 0, parts, group_rank(tp_group), group_size(tp_group)))
        return layer
    with torch.no_grad():
        layer.A_log.fill_(math.log(0.05))
        # KDA: the same spread in every head, so a tp rank's heads hold one process's values.
        layer.dt_bias.copy_(torch.linspace(-3.0, 0.5, 6).repeat(layer.dt_bias.numel() // 6) if kind == "kda" else
                            torch.full_like(layer.dt_bias, -2.0))
    return layer


def _doc_ids() -> torch.Tensor:
    # Row 0: starts mid-segment and on segment edges; row 1: one document.
    lengths = [[5, 1, 6, 9, 3], [24]]
    ids, nxt = [], 0
    for row in lengths:
        ids.append(torch.repeat_interleave(torch.arange(nxt, nxt + len(row)), torch.tensor(row)))
        nxt += len(row)
    return torch.stack(ids)


def _data():
    gen = torch.Generator().manual_seed(7)
    return torch.randn(S, B, H, generator=gen), torch.randn(S, B, H, generator=gen)


def _run(layer, x: torch.Tensor, probe: torch.Tensor, docs):
    x = x.clone().requires_grad_()
    out = layer(x, None, None, docs)
    (out * probe).sum().backward()
    grads = {name: p.grad.clone() for name, p in layer.named_parameters()}
    return out.detach(), x.grad, grads


def _rank(rank, world_size, kind, packed):
    group = dist.new_group(list(range(world_size)), group_desc="cp")
    layer = _layer(kind, None, False, seed=3, name="layers.0.attn", cp_group=group)
    x, probe = (zigzag_split(t, rank, world_size, dim=0) for t in _data())
    docs = Documents(_doc_ids(), group) if packed else None
    return _run(layer, x, probe, docs)


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("cp", [2, 4])
@pytest.mark.parametrize("packed", [False, True])
def test_cp_equals_one_process(kind, cp, packed):
    layer = _layer(kind, None, False, seed=3, name="layers.0.attn")
    x, probe = _data()
    want_out, want_dx, want_grads = _run(layer, x, probe, Documents(_doc_ids(), None) if packed else None)
    per_rank = run_ranks(_rank, cp, kind, packed, timeout=120)
    out = zigzag_gather([r[0] for r in per_rank], dim=0)
    dx = zigzag_gather([r[1] for r in per_rank], dim=0)
    torch.testing.assert_close(out, want_out, rtol=1e-5, atol=1e-6)
    # The state carries the whole sequence (slow decays): float32 input grads move by up to
    # 2.9e-6 with the segments' order of sums; the float64 test bounds the layout at 1e-12.
    torch.testing.assert_close(dx, want_dx, rtol=1e-5, atol=3e-6)
    for name, want in want_grads.items():
        got = sum(r[2][name] for r in per_rank)
        # Mamba2's grads reach 50 at these sizes: float32's rounding of sums that large is
        # 1e-5, so the bound scales with the tensor's largest grad (float64 test: 1e-12).
        atol = max(1e-5, 1e-6 * float(want.abs().max()))
        torch.testing.assert_close(got, want, rtol=1e-5, atol=atol, msg=lambda m: f"grad of {name}: {m}")
    print(f"{kind} cp{cp} packed={packed}: max |out diff| {float((out - want_out).abs().max()):.2e}, "
          f"max |dx diff| {float((dx - want_dx).abs().max()):.2e}")


@pytest.mark.parametrize("kind", list(LAYERS))
def test_packed_layer_equals_each_document_alone(kind):
    """One process: a packed row's outputs are those of each document run alone."""
    layer = _layer(kind, None, False, seed=3, name="layers.0.attn")
    x, _ = _data()
    ids = _doc_ids()
    with torch.no_grad():
        packed = layer(x, None, None, Documents(ids, None))
        for doc in ids[0].unique():
            cols = (ids[0] == doc).nonzero().flatten()
            alone = layer(x[cols, :1], None, None)
            torch.testing.assert_close(packed[cols, :1], alone, rtol=1e-5, atol=1e-6)


def _rank64(rank, world_size, kind, split):
    group = dist.new_group(list(range(world_size)), group_desc=split)
    tp, cp = (group, None) if split == "tp" else (None, group)
    layer = _layer(kind, tp, False, seed=3, name="layers.0.attn", cp_group=cp).double()
    x, probe = (t.double() for t in _data())
    if split == "cp":
        x, probe = (zigzag_split(t, rank, world_size, dim=0) for t in (x, probe))
    return _run(layer, x, probe, Documents(_doc_ids(), cp))


@pytest.mark.parametrize("kind", list(LAYERS))
@pytest.mark.parametrize("split", ["tp", "cp"])
def test_tp_and_cp_equal_one_process_in_float64(kind, split):
    """In float64 the tp (heads split) and cp (segments in order) layers are one process's
    to rounding: the float32 layout matrix's differences are float32's."""
    layer = _layer(kind, None, False, seed=3, name="layers.0.attn").double()
    x, probe = (t.double() for t in _data())
    want_out, want_dx, _ = _run(layer, x, probe, Documents(_doc_ids(), None))
    per_rank = run_ranks(_rank64, 2, kind, split, timeout=120)
    if split == "cp":
        out = zigzag_gather([r[0] for r in per_rank], dim=0)
        dx = zigzag_gather([r[1] for r in per_rank], dim=0)
    else:
        # tp without SP: every rank holds the whole output and (all-reduced) input grad.
        out, dx = per_rank[0][0], per_rank[0][1]
    torch.testing.assert_close(out, want_out, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(dx, want_dx, rtol=1e-12, atol=1e-12)
