"""flash-linear-attention (fla) as the ``fla`` backend of the delta rule
(:mod:`moe_fold.kernels.delta_rule`): its functions, imported when asked for, and the
conversion of :func:`~moe_fold.kernels.delta_rule.torch_delta_rule`'s arguments to fla's
layout and back:

- tokens ``[B, H, S, d]`` -> ``[1, B*S, H, d]``: every row is one varlen sequence, and every
  document start (``starts``) begins another, in ``cu_seqlens`` (the state resets there);
- ``initial_state [B, H, dk, dv]`` -> one per sequence ``[N, H, dk, dv]``: a row's own for the
  sequence at its start (unless a document starts there too), zeros for the others;
- the final state of a row is that of its last sequence;
- q arrives scaled (``scale=1``); the rule's chunk size is fla's own (results do not depend on it).

``cu_seqlens`` and its host copy ``cu_seqlens_cpu`` (fla sizes its grid by the sequences)
come made from the batch's :class:`~moe_fold.parallel.varlen.SequenceStarts`, so no call
reads the device back.
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch

from moe_fold.parallel.varlen import SequenceStarts

__all__ = ["FLA_INSTALL", "fla_function", "fla_delta_rule"]

FLA_INSTALL = "pip install 'moe-fold[fla]' (flash-linear-attention's Triton kernels; needs CUDA)"

# Our decay kind -> fla's function (in fla.ops)
_FLA_FUNCTIONS = {"gated_delta_rule": ("fla.ops.gated_delta_rule", "chunk_gated_delta_rule"),
                  "kda": ("fla.ops.kda", "chunk_kda")}


def fla_function(kind: str) -> Callable:
    """fla's chunked function for ``kind`` (``gated_delta_rule``: a decay per head; ``kda``:
    per key channel), imported here; an ImportError naming the install when fla is absent."""
    module, name = _FLA_FUNCTIONS[kind]
    try:
        imported = importlib.import_module(module)
    except Exception as err:  # a missing or broken install, or a Triton that does not match
        raise ImportError(f"import {module} failed ({type(err).__name__}: {err}); {FLA_INSTALL}") from err
    return getattr(imported, name)


def fla_delta_rule(fla: Callable, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, g: torch.Tensor,
                   beta: torch.Tensor, starts: Optional[SequenceStarts] = None,
                   initial_state: Optional[torch.Tensor] = None,
                   chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~moe_fold.kernels.delta_rule.torch_delta_rule` through ``fla`` (fla's
    ``chunk_gated_delta_rule`` or ``chunk_kda``, or a function of the same contract), in the
    layout the module docstring describes. ``chunk_size`` is fla's to choose."""
    B, H, S, dk = k.shape

    def flat(t: torch.Tensor) -> torch.Tensor:  # [B, H, S, ...] -> [1, B*S, H, ...]
        return t.transpose(1, 2).reshape(1, B * S, H, *t.shape[3:])

    if starts is None:  # one sequence per row
        cu_seqlens_cpu = torch.arange(0, B * S + 1, S)
        cu_seqlens = torch.arange(0, B * S + 1, S, device=q.device)
    else:
        cu_seqlens, cu_seqlens_cpu = starts.cu_seqlens, starts.cu_seqlens_cpu
    first = cu_seqlens[:-1]  # [N]: each sequence's first token
    row = torch.div(first, S, rounding_mode="floor")  # [N]: the row of each sequence
    init = None
    if initial_state is not None:
        # A row's state carries into its first sequence unless a document starts at token 0.
        carried = first % S == 0
        if starts is not None:
            carried &= ~starts.resets[:, 0][row]
        init = initial_state[row] * carried.to(initial_state.dtype)[:, None, None, None]
    o, final = fla(flat(q), flat(k), flat(v), flat(g), flat(beta), scale=1.0, initial_state=init,
                   output_final_state=True, cu_seqlens=cu_seqlens, cu_seqlens_cpu=cu_seqlens_cpu)
    last = torch.searchsorted(first, (torch.arange(B, device=q.device) + 1) * S) - 1  # [B]
    return o.reshape(B, S, H, -1).transpose(1, 2), final[last]
