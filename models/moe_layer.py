"""The MoE layer: router -> dispatcher -> experts -> combine, plus an optional shared expert.

``MoELayer(config, groups, layer)(hidden [T_local, H]) -> [T_local, H]``, the MLP contract
of :class:`moe_fold.models.model.Block`. Each rank routes only its own tokens (its
sequence shard under SP, its cp chunk, its dp micro-batch); the dispatcher moves them to
the ep ranks that own their experts and back (docs/architecture.md, "One MoE layer"). The
load-balancing and z losses ride on the router's probs through autograd, so nothing is
returned besides the hidden states.

Zero-computation experts (LongCat-Flash, ``moe.zero_experts``): the router picks among
held and zero experts, and hands the dispatcher the held ones only; a slot on a zero expert
adds the token times its gate weight here, without leaving the rank.

The shared expert (Qwen2-MoE, DeepSeek) is a dense SwiGLU :class:`~moe_fold.models.mlp.MLP`
of width ``moe.shared_expert_ffn_hidden_size`` that every token goes through; it is
tensor-parallel like the dense MLP (column/row-parallel, the sequence gathered over tp
under SP). ``moe.shared_expert_gate`` scales its output by ``sigmoid(x . w)`` per token.

Latent MoE (Nemotron 3 Super, ``moe.latent_size = L``): the routed experts work in ``L``
columns. The router reads the hidden state; the tokens are projected ``H -> L``
(``latent_in``) before the dispatch, so the all-to-all and the etp all-gather carry
``L``-wide rows, and the combined rows ``L -> H`` (``latent_out``) after the combine. Both
projections are linear and bias-free, so projecting the combined sum equals summing the
projected rows (transformers' ``NemotronHMoE`` projects after its expert sum too). The
shared expert and zero experts read the un-projected hidden state.

Overlap (docs/architecture.md, "One MoE layer"; off by default, and off runs the blocking
calls in the order above). ``moe.shared_expert_overlap``: the shared expert's fc1 and SwiGLU run while the
dispatch's all-to-all is in flight, its fc2 (and gate) while the combine's is.
``moe.overlap_chunks = n > 1``: the router decides on all the layer's tokens (capacity
dropping is per expert over the whole layer, as without chunks), then the tokens, probs and
routing map are cut into n consecutive chunks, each dispatched and combined on its own, all
dispatches posted first: chunk i's experts run while chunk i+1's dispatch and chunk i-1's
combine are in flight. A token's output is the same sum of the same expert rows, within fp32
rounding: the grouped GEMMs run on fewer rows and the expert weights' gradients sum per
chunk (the shared-expert overlap alone is bit for bit). The backward pass overlaps the same
way (:mod:`moe_fold.comm`'s asynchronous ops). Each chunk has its own count exchange (a
blocking all-gather of ``E`` int64 per rank).

Gradient sync kinds (:mod:`moe_fold.training.grads`): experts ``"expert"``; the router weight and
the shared-expert gate and the latent projections are replicated over tp but see only
this rank's tokens under SP, so ``"tp_sum"`` (they are small, ``2 H L``, and a tp split
would need the sequence gathered, where the dispatch needs each rank's own tokens); the shared expert's linears are ``"tp"`` shards.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import nn

from moe_fold.config import (
    BATCH_INVARIANT_ROWS, Config, gate_needs_shared_expert, moe_needs_sequence_parallel, overlap_problems, require,
)
from moe_fold.dispatch.dispatcher import build_dispatcher
from moe_fold.dispatch.placement import Placement
from moe_fold.dispatch.router import Router
from moe_fold.layout import ProcessGroups
from moe_fold.parallel.tensor_parallel import global_normal, init_seed, mark

from .experts import Experts
from .mlp import MLP

__all__ = ["MoELayer"]


class MoELayer(nn.Module):
    """Layer ``layer``'s MoE MLP in the layout of ``groups``; see the module docstring.

    Its router's loss values and load statistics are what ``self.router`` returns
    (:class:`~moe_fold.dispatch.router.RouterOutput`): a forward hook on the router reads
    them, as :class:`moe_fold.training.metrics.RoutingCollector` does.
    """

    def __init__(self, config: Config, groups: ProcessGroups, layer: int):
        super().__init__()
        m, moe, sp = config.model, config.moe, config.parallel.sequence_parallel
        tp = groups.size("tp")
        require(moe_needs_sequence_parallel, tp, sp)
        require(gate_needs_shared_expert, moe.shared_expert_gate, moe.shared_expert_ffn_hidden_size)
        require(overlap_problems, moe)
        seed, std, name = config.train.seed, m.init_std, f"layers.{layer}"
        # Replicated over tp; under SP each tp rank's grad covers only its own tokens.
        replicated = "tp_sum" if sp else "replicated"
        self.router = Router(moe, m.hidden_size, groups, init_std=std)
        with torch.no_grad():
            # The router draws from torch's global generator; redraw from a layout-free seed.
            self.router.weight.copy_(global_normal(self.router.weight.shape, std, init_seed(seed, f"{name}.router")))
        mark(self.router.weight, replicated)
        if self.router.bias is not None:
            mark(self.router.bias, replicated)  # gpt-oss's router bias: like the weight
        self.dispatcher = build_dispatcher(moe, groups)
        # moe.replicas spare slots per ep rank hold copies of other ranks' experts from the start.
        placement = Placement.contiguous(moe.num_experts, groups.size("ep"), moe.replicas)
        self.dispatcher.set_placement(placement)
        # Latent MoE: dense H -> L and L -> H around the dispatch, like the router replicated over tp.
        self.latent_in: Optional[nn.Linear] = None
        self.latent_out: Optional[nn.Linear] = None
        width = m.hidden_size
        if moe.latent_size is not None:
            width = moe.latent_size
            self.latent_in = self._replicated_linear(m.hidden_size, width, std, seed, f"{name}.latent_in", replicated)
            self.latent_out = self._replicated_linear(width, m.hidden_size, std, seed, f"{name}.latent_out",
                                                      replicated)
        self.experts = Experts(moe.num_experts, width, moe.ffn_hidden_size, groups, std=std, seed=seed,
                               name=f"{name}.experts", gemm_backend=moe.gemm_backend, swiglu_backend=moe.swiglu_backend,
                               placement=placement, linear_bias=moe.expert_linear_bias, activation=moe.activation,
                               swiglu_alpha=moe.swiglu_alpha, swiglu_limit=moe.swiglu_limit,
                               score_on_input=moe.score_on_input,
                               row_multiple=BATCH_INVARIANT_ROWS if config.train.batch_invariant else 0)
        self.shared_expert: Optional[MLP] = None
        self.shared_expert_gate: Optional[nn.Parameter] = None
        if moe.shared_expert_ffn_hidden_size > 0:
            self.shared_expert = MLP(m.hidden_size, moe.shared_expert_ffn_hidden_size, groups.tp, sp,
                                     std=std, seed=seed, name=f"{name}.shared_expert", activation=m.mlp_activation)
            if moe.shared_expert_gate:
                gate = global_normal((1, m.hidden_size), std, init_seed(seed, f"{name}.shared_expert_gate"))
                self.shared_expert_gate = mark(nn.Parameter(gate), replicated)  # [1, H]
        self.shared_expert_overlap = moe.shared_expert_overlap
        self.overlap_chunks = moe.overlap_chunks

    @staticmethod
    def _replicated_linear(fan_in: int, fan_out: int, std: float, seed: int, name: str, kind: str) -> nn.Linear:
        """A bias-free ``fan_in -> fan_out`` linear whose whole weight every rank holds."""
        linear = nn.Linear(fan_in, fan_out, bias=False)
        with torch.no_grad():
            linear.weight.copy_(global_normal((fan_out, fan_in), std, init_seed(seed, name)))  # [out, in]
        mark(linear.weight, kind)
        return linear

    @property
    def placement(self) -> Placement:
        """Which global expert each ep rank's expert slots hold."""
        return self.experts.placement

    def set_placement(self, placement: Placement) -> None:
        """Route by ``placement`` from the next forward on; the expert weights must be
        moved to match (:func:`moe_fold.training.replace.move_experts` does both)."""
        self.dispatcher.set_placement(placement)
        self.experts.set_placement(placement)

    def forward(self, hidden: torch.Tensor, *, loss_mask: Optional[torch.Tensor] = None,
                seq_ids: Optional[torch.Tensor] = None, num_seqs: Optional[int] = None,
                loss_scale: float = 1.0) -> torch.Tensor:
        """This rank's tokens ``hidden [T_local, H]`` -> ``[T_local, H]``.

        ``loss_mask``, ``seq_ids``, ``num_seqs`` and ``loss_scale`` go to
        :meth:`Router.forward` (padding left out of the losses; per-sequence aux loss; the
        factor on the router losses' gradients). :class:`~moe_fold.models.model.Block`
        passes ``seq_ids[t] = t % B``, the sample of token ``t`` in the ``[S_local, B]`` order,
        and ``num_seqs = B``."""
        routing = self.router(hidden, loss_mask=loss_mask, seq_ids=seq_ids, num_seqs=num_seqs, loss_scale=loss_scale)
        # Latent MoE: [T_local, H] -> [T_local, L], so the dispatch carries L-wide rows (else x is hidden).
        x = hidden if self.latent_in is None else self.latent_in(hidden)
        if self.shared_expert_overlap or self.overlap_chunks > 1:
            out = self._overlapped(hidden, x, routing.probs, routing.routing_map)
        else:
            sent = self.dispatcher.dispatch(x, routing.probs, routing.routing_map)  # [N, L] by local expert
            rows = self.experts(sent.tokens, sent.tokens_per_local_expert, sent.probs,
                                sent.host_tokens_per_local_expert)  # [N, L], prob-weighted
            out = self._from_latent(self.dispatcher.combine(rows, sent.handle))  # [T_local, L] -> [T_local, H]
            if self.shared_expert is not None:
                out = out + self._gated(hidden, self.shared_expert(hidden))
        if routing.zero_probs is not None:
            # Zero-computation experts return their input (LongCat-Flash): input x gate weight,
            # here where the token is, never dispatched. [T_local, 1] * [T_local, H]
            out = out + (hidden * routing.zero_probs.unsqueeze(1)).to(out.dtype)
        return out

    def _overlapped(self, hidden: torch.Tensor, x: torch.Tensor, probs: torch.Tensor,
                    routing_map: torch.Tensor) -> torch.Tensor:
        """:meth:`forward` after routing (``x`` the rows to dispatch: ``hidden``, or its latent
        projection), with the dispatcher's collectives in flight while the shared expert and
        the other chunks' experts run (module docstring)."""
        n = self.overlap_chunks
        # [T_local, ...] -> n consecutive chunks; every rank makes n, empty ones included.
        chunks = zip(x.tensor_split(n), probs.tensor_split(n), routing_map.tensor_split(n))
        dispatches = [self.dispatcher.dispatch_start(x, p, m) for x, p, m in chunks]
        overlap_shared = self.shared_expert is not None and self.shared_expert_overlap
        # Under the first chunk's dispatch: the shared expert's first half.
        act = self.shared_expert.activation(hidden) if overlap_shared else None  # [T, S/tp]
        combines = []
        for pending in dispatches:
            # Under the next chunk's dispatch and the previous chunk's combine.
            sent = pending.wait()  # [N_chunk, L] by local expert
            rows = self.experts(sent.tokens, sent.tokens_per_local_expert, sent.probs,
                                sent.host_tokens_per_local_expert)  # [N_chunk, L]
            combines.append(self.dispatcher.combine_start(rows, sent.handle))
        # Under the last chunk's combine: the shared expert's second half.
        shared = self._gated(hidden, self.shared_expert.project(act)) if overlap_shared else None  # [T_local, H]
        out = torch.cat([pending.wait() for pending in combines])  # n x [T_chunk, L] -> [T_local, L]
        out = self._from_latent(out)  # [T_local, L] -> [T_local, H]
        if self.shared_expert is not None:
            out = out + (shared if overlap_shared else self._gated(hidden, self.shared_expert(hidden)))
        return out

    def _from_latent(self, combined: torch.Tensor) -> torch.Tensor:
        """The combined rows back to the hidden width: ``[T_local, L] -> [T_local, H]``
        (unchanged without a latent MoE, where ``L = H``)."""
        return combined if self.latent_out is None else self.latent_out(combined)

    def _gated(self, hidden: torch.Tensor, shared: torch.Tensor) -> torch.Tensor:
        """The shared expert's output ``shared [T_local, H]``, scaled by its gate if any."""
        if self.shared_expert_gate is None:
            return shared
        return torch.sigmoid(hidden @ self.shared_expert_gate.t()) * shared  # [T_local, 1] * [T_local, H]
