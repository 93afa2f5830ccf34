"""The routed experts: E_local SwiGLU MLPs run as two grouped GEMMs (or, with
``moe.activation: relu2``, Nemotron-H's non-gated ``fc2(relu(x fc1)^2)``, fc1 then ``[E_local,
H, F/etp]``).

``fc2(silu(x fc1_gate) * (x fc1_up) * prob)`` for every row, each row with its own
expert's weights. Rows arrive from the dispatcher grouped by local expert; the routing
prob of each row is applied inside the SwiGLU (the dispatcher's combine only sums rows).

Weights (``[in, out]`` per expert, the layout the grouped GEMM multiplies as is):

- ``fc1 [E_local, H, 2F/etp]``: this etp rank's slice of the gate columns followed by the
  matching slice of the up columns, ``[gate_shard | up_shard]``, so the SwiGLU's
  contiguous halves line up;
- ``fc2 [E_local, F/etp, H]``: the matching rows of fc2. Its output is this etp rank's
  partial sum; the dispatcher's combine adds the etp shards (reduce-scatter), so no
  communication happens here.

gpt-oss's experts (``moe.expert_linear_bias``, ``moe.activation: clamped_swiglu``) add
``fc1_bias [E_local, 2F/etp]`` (sharded like fc1's columns) and ``fc2_bias [E_local, H/etp]``
inside the grouped GEMMs (:func:`moe_fold.kernels.gmm.gmm`'s ``bias``), and weight the
rows by their prob after fc2, ``(act @ fc2 + fc2_bias) * prob`` as transformers does
(the prob cannot go inside the activation: it must scale the bias too). fc2's output is
an etp partial sum, so its bias must be added once over etp, not etp times: etp rank
``t`` holds and adds columns ``[t*H/etp, (t+1)*H/etp)`` of it (zeros elsewhere), and the
combine's sum over etp assembles the whole bias. Each bias slice's grad is then complete
on its own rank, like any etp shard. Biases draw from their own seeds like the weights
(transformers starts them at zero; a checkpoint import overwrites them anyway).

Every global expert ``g`` draws its global weights from its own seed (the run seed and
``<name>.<g>.fc1`` / ``.fc2``) before the ep rank keeps its experts and the etp rank its
slice: every layout of one config holds the same global weights.

Placement (:class:`moe_fold.dispatch.placement.Placement`): dim 0 holds this ep rank's
*slots*, slot ``i`` holding global expert ``placement.rank_slots(ep_rank)[i]`` (by default
the contiguous ``[j*E_local, (j+1)*E_local)``). Both parameters carry the placement for
the code that lays them out (:mod:`moe_fold.parallel.sharding`) and reduces their grads
(:mod:`moe_fold.training.grads`): ``num_experts``, ``slot_experts`` (the global expert of
each local slot), ``slot_primary`` (whether the slot is its expert's first copy) and
``replicated_experts`` (the experts with copies on several ranks, ascending).
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import nn

from moe_fold.config import activation_backend, choice, expert_bias_over_etp, expert_width_over_etp, require
from moe_fold.dispatch.placement import Placement
from moe_fold.kernels.gmm import build_backend as build_gemm_backend
from moe_fold.kernels.gmm import grouped_mm
from moe_fold.kernels.swiglu import clamped_swiglu, relu2, swiglu_op
from moe_fold.layout import ProcessGroups
from moe_fold.parallel.tensor_parallel import global_normal, init_seed, mark, shard_tp

from .recompute import recomputed

__all__ = ["Experts"]


class Experts(nn.Module):
    """This rank's share of ``num_experts`` SwiGLU experts of width ``ffn_hidden_size``.

    The ep rank ``j`` holds global experts ``[j*E_local, (j+1)*E_local)`` (the dispatcher's
    split) or, with a ``placement``, the experts of its slots; the etp rank ``t`` holds slice ``t`` of each one's ffn dim. Both parameters are
    marked ``"expert"`` (grads summed over edp, see :mod:`moe_fold.training.grads`) and carry
    ``etp_dim`` / ``etp_parts``: the dim split over etp and the global sizes of its fused
    parts, for :func:`moe_fold.parallel.tensor_parallel.unshard_tp` (experts stack along dim 0 over ep).
    """

    def __init__(self, num_experts: int, hidden_size: int, ffn_hidden_size: int, groups: ProcessGroups,
                 *, std: float, seed: int, name: str, gemm_backend: str = "auto",
                 swiglu_backend: str = "auto", placement: Placement | None = None, linear_bias: bool = False,
                 activation: str = "swiglu", swiglu_alpha: float = 1.702, swiglu_limit: float = 7.0,
                 score_on_input: bool = False, row_multiple: int = 0):
        super().__init__()
        # > 0: every expert's rows padded to a multiple of this for the GEMMs, so a row's
        # bits do not depend on how many other rows its expert got (train.batch_invariant).
        self.row_multiple = row_multiple
        self.score_on_input = score_on_input
        ep, etp = groups.size("ep"), groups.size("etp")
        require(expert_width_over_etp, ffn_hidden_size, etp)
        require(choice, "moe.gemm_backend", gemm_backend)
        require(choice, "moe.swiglu_backend", swiglu_backend)
        require(choice, "moe.activation", activation)
        require(activation_backend, activation, swiglu_backend)
        require(expert_bias_over_etp, linear_bias, hidden_size, etp)
        if placement is None:
            placement = Placement.contiguous(num_experts, ep)  # checks num_experts over ep
        if placement.num_experts != num_experts or placement.ep != ep:
            raise ValueError(f"placement of {placement.num_experts} experts over ep={placement.ep} does not fit "
                             f"moe.num_experts={num_experts} over parallel.ep={ep}")
        self.num_experts = num_experts
        self.ep_rank = groups.rank_in("ep")
        self.num_local_experts = placement.slots_per_rank
        # Checked here, once; auto is resolved by the op from the operands' device.
        self.gemm_backend = build_gemm_backend(gemm_backend)
        self.swiglu_backend = swiglu_backend
        self.activation, self.swiglu_alpha, self.swiglu_limit = activation, swiglu_alpha, swiglu_limit
        # What the backward runs again (train.recompute, models/recompute.py): "none",
        # "all" (the whole forward) or "activation" (the SwiGLU and fc2).
        self.recompute = "none"
        etp_rank = groups.rank_in("etp")
        self.hidden_size, self.etp_rank = hidden_size, etp_rank
        F = ffn_hidden_size
        # relu2 (Nemotron-H) is not gated: fc1 is the up projection alone.
        fc1_parts = [F] if activation == "relu2" else [F, F]
        fc1, fc2 = [], []
        for g in placement.rank_slots(self.ep_rank):
            full1 = global_normal((hidden_size, sum(fc1_parts)), std, init_seed(seed, f"{name}.{g}.fc1"))  # [H, gate|up]
            full2 = global_normal((F, hidden_size), std, init_seed(seed, f"{name}.{g}.fc2"))  # [F, H]
            fc1.append(shard_tp(full1, 1, fc1_parts, etp_rank, etp))  # [H, 2F/etp]
            fc2.append(shard_tp(full2, 0, [F], etp_rank, etp))  # [F/etp, H]
        self.fc1 = self._expert_param(torch.stack(fc1), 2, fc1_parts)  # [E_local, H, 2F/etp]
        self.fc2 = self._expert_param(torch.stack(fc2), 1, [F])  # [E_local, F/etp, H]
        self.fc1_bias: Optional[nn.Parameter] = None
        self.fc2_bias: Optional[nn.Parameter] = None
        if linear_bias:
            b1, b2 = [], []
            for g in placement.rank_slots(self.ep_rank):
                full_b1 = global_normal((sum(fc1_parts),), std, init_seed(seed, f"{name}.{g}.fc1_bias"))  # [gate|up]
                full_b2 = global_normal((hidden_size,), std, init_seed(seed, f"{name}.{g}.fc2_bias"))  # [H]
                b1.append(shard_tp(full_b1, 0, fc1_parts, etp_rank, etp))  # [2F/etp]
                b2.append(shard_tp(full_b2, 0, [hidden_size], etp_rank, etp))  # [H/etp]
            self.fc1_bias = self._expert_param(torch.stack(b1), 1, fc1_parts)  # [E_local, 2F/etp]
            self.fc2_bias = self._expert_param(torch.stack(b2), 1, [hidden_size])  # [E_local, H/etp]
        self.set_placement(placement)

    def expert_params(self) -> list[nn.Parameter]:
        """Every per-expert parameter (dim 0 = local expert slots): fc1, fc2 and their biases."""
        return [p for p in (self.fc1, self.fc2, self.fc1_bias, self.fc2_bias) if p is not None]

    def set_placement(self, placement: Placement) -> None:
        """Record ``placement`` on the module and its parameters (the weights themselves
        are moved by :func:`moe_fold.training.replace.move_experts`)."""
        if placement.slots_per_rank != self.num_local_experts or placement.num_experts != self.num_experts:
            raise ValueError(f"placement with {placement.slots_per_rank} slots per rank of {placement.num_experts} "
                             f"experts does not fit experts holding {self.num_local_experts} of {self.num_experts}")
        self.placement = placement
        start = self.ep_rank * self.num_local_experts
        replicated = [e for e, n in enumerate(placement.num_copies()) if n > 1]
        for param in self.expert_params():
            param.num_experts = self.num_experts
            param.slot_experts = list(placement.rank_slots(self.ep_rank))
            param.slot_primary = [placement.primary(start + i) for i in range(self.num_local_experts)]
            param.replicated_experts = replicated

    @staticmethod
    def _expert_param(value: torch.Tensor, etp_dim: int, etp_parts: list[int]) -> nn.Parameter:
        param = mark(nn.Parameter(value), "expert")
        param.etp_dim = etp_dim
        param.etp_parts = etp_parts
        return param

    def forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                host_tokens_per_expert: Optional[Sequence[int]] = None) -> torch.Tensor:
        """``tokens [N, H]`` grouped by local expert (``tokens_per_expert [E_local]`` rows
        each, an int tensor), ``probs [N]`` -> ``[N, H]``, prob-weighted (an etp partial sum
        when etp > 1). ``host_tokens_per_expert``: the same counts as a host list when the
        caller has them (the dispatcher does), so no GEMM backend reads the tensor back."""
        tokens, probs = self.scaled_input(tokens, probs)
        if self.row_multiple:
            return self._padded(tokens, tokens_per_expert, probs, host_tokens_per_expert)
        if self.recompute == "all":
            return recomputed(self._grouped_mlp, tokens, tokens_per_expert, probs, host_tokens_per_expert)
        return self._grouped_mlp(tokens, tokens_per_expert, probs, host_tokens_per_expert)

    def _padded(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                host: Optional[Sequence[int]]) -> torch.Tensor:
        """:meth:`forward` with each expert's rows padded by zero rows to a multiple of
        ``row_multiple``: a CPU GEMM gives a row the same bits for any such row count."""
        counts = [int(c) for c in (host if host is not None else tokens_per_expert.tolist())]
        m = self.row_multiple
        padded = [-(-c // m) * m for c in counts]
        starts = torch.tensor([0] + padded[:-1]).cumsum(0).tolist()
        # Where each real row goes in the padded rows: [N]
        dest = torch.cat([torch.arange(s, s + c) for s, c in zip(starts, counts)] +
                         [torch.zeros(0, dtype=torch.int64)]).to(tokens.device)
        rows = sum(padded)
        x = tokens.new_zeros(rows, tokens.shape[1]).index_put((dest,), tokens)  # [N, H] -> [N_padded, H]
        p = probs.new_zeros(rows).index_put((dest,), probs)  # [N_padded]
        counts_t = torch.tensor(padded, dtype=tokens_per_expert.dtype, device=tokens_per_expert.device)
        if self.recompute == "all":
            out = recomputed(self._grouped_mlp, x, counts_t, p, padded)
        else:
            out = self._grouped_mlp(x, counts_t, p, padded)
        return out[dest]  # [N_padded, H] -> [N, H]

    def scaled_input(self, tokens: torch.Tensor, probs: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(tokens, probs)`` as the experts take them: unchanged, or with
        ``moe.score_on_input`` (Llama-4) ``expert(p * x)``: the rows scaled by their prob and
        the probs that weight the output all ones (the same grouped GEMMs)."""
        if not self.score_on_input:
            return tokens, probs
        return tokens * probs.unsqueeze(-1).to(tokens.dtype), torch.ones_like(probs)  # [N, H], [N]

    def _grouped_mlp(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                     host: Optional[Sequence[int]]) -> torch.Tensor:
        h = self.fc1_forward(tokens, tokens_per_expert, host)  # [N, H] -> [N, 2F/etp]
        if self.recompute == "activation":
            # Only h and the inputs are kept; the host counts ride along as they are (a
            # list, not a tensor), so the recompute in backward reads nothing back.
            return recomputed(self.act_fc2, h, tokens_per_expert, probs, host)
        return self.act_fc2(h, tokens_per_expert, probs, host)

    def fc1_forward(self, tokens: torch.Tensor, tokens_per_expert: torch.Tensor,
                    host_tokens_per_expert: Optional[Sequence[int]] = None) -> torch.Tensor:
        """``tokens [N, H]`` -> fc1's output ``[N, 2F/etp]`` (``[gate | up]``, biased if any)."""
        return grouped_mm(tokens, self.fc1, tokens_per_expert, host_tokens_per_expert, backend=self.gemm_backend,
                          bias=self.fc1_bias)

    def act_fc2(self, h: torch.Tensor, tokens_per_expert: torch.Tensor, probs: torch.Tensor,
                host_tokens_per_expert: Optional[Sequence[int]] = None) -> torch.Tensor:
        """fc1's output ``h [N, 2F/etp]`` -> the activation -> fc2 -> ``[N, H]``, prob-weighted
        (an etp partial sum when etp > 1)."""
        host = host_tokens_per_expert
        # Without an fc2 bias the prob rides inside the activation (one pass fewer);
        # with one it must scale the bias too, so it is applied after fc2.
        inner = probs if self.fc2_bias is None else None
        if self.activation == "clamped_swiglu":
            act = clamped_swiglu(h, inner, alpha=self.swiglu_alpha, limit=self.swiglu_limit)  # [N, F/etp]
        elif self.activation == "relu2":
            act = relu2(h, inner)  # [N, F/etp]
        else:
            act = swiglu_op(h, inner, self.swiglu_backend)  # [N, F/etp]
        if self.fc2_bias is None:
            return grouped_mm(act, self.fc2, tokens_per_expert, host, backend=self.gemm_backend)  # [N, H]
        # This etp rank's slice of the bias in its columns, zeros elsewhere: the etp sum adds it once.
        width = self.fc2_bias.shape[1]
        start = self.etp_rank * width
        bias = torch.nn.functional.pad(self.fc2_bias, (start, self.hidden_size - start - width))  # [E_local, H]
        out = grouped_mm(act, self.fc2, tokens_per_expert, host, backend=self.gemm_backend, bias=bias)
        return out * probs.to(out.dtype).unsqueeze(-1)  # [N, H]
