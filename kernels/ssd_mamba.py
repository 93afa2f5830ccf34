"""mamba-ssm as the ``mamba_ssm`` backend of Mamba2's SSD scan (:mod:`moe_fold.kernels.ssd_scan`):
its ``mamba_chunk_scan_combined``, imported when asked for, and the conversion of the scan's
arguments to mamba-ssm's layout and back:

- ``x [B, H, S, P]`` -> ``[B, S, H, P]``, the step ``dt [B, H, S]`` -> ``[B, S, H]`` (already
  through softplus and the floor: ``dt_softplus=False``, no ``dt_bias``, no ``dt_limit``), B and C
  ``[B, G, S, N]`` -> ``[B, S, G, N]`` (mamba-ssm shares a group among ``H / G`` consecutive heads,
  as Mamba2 does), no D and no z (the layer adds the skip and the gate itself);
- documents: ``seq_idx [B, S]`` counts the document starts up to each token (``resets``'
  cumulative sum), so the state passes only between tokens of the same index; the initial
  state enters where the index is 0, so a document starting at token 0 (index 1 from there)
  discards it, as the torch scan does;
- states ``[B, H, N, P]`` are mamba-ssm's ``[B, H, P, N]`` transposed, both ways; the final
  state of a row is that after its last token.
"""

from __future__ import annotations

import importlib
from typing import Callable, Optional

import torch

__all__ = ["MAMBA_INSTALL", "mamba_function", "mamba_ssd"]

MAMBA_INSTALL = "pip install 'moe-fold[mamba]' (mamba-ssm's Triton SSD kernels; needs CUDA)"
_MODULE, _NAME = "mamba_ssm.ops.triton.ssd_combined", "mamba_chunk_scan_combined"


def mamba_function() -> Callable:
    """mamba-ssm's ``mamba_chunk_scan_combined``, imported here; an ImportError naming the
    install when mamba-ssm is absent or does not import."""
    try:
        imported = importlib.import_module(_MODULE)
    except Exception as err:  # a missing or broken install, or a Triton that does not match
        raise ImportError(f"import {_MODULE} failed ({type(err).__name__}: {err}); {MAMBA_INSTALL}") from err
    return getattr(imported, _NAME)


def mamba_ssd(scan: Callable, x: torch.Tensor, dt: torch.Tensor, A: torch.Tensor, b: torch.Tensor, c: torch.Tensor,
              resets: Optional[torch.Tensor] = None, initial_state: Optional[torch.Tensor] = None,
              chunk_size: int = 64) -> tuple[torch.Tensor, torch.Tensor]:
    """:func:`~moe_fold.kernels.ssd_scan.torch_ssd` through ``scan`` (mamba-ssm's
    ``mamba_chunk_scan_combined`` or a function of the same contract), in the layout the
    module docstring describes."""
    def tokens_first(t: torch.Tensor) -> torch.Tensor:  # [B, H or G, S, ...] -> [B, S, H or G, ...]
        return t.transpose(1, 2).contiguous()

    seq_idx = None if resets is None else resets.to(torch.int32).cumsum(-1, dtype=torch.int32)
    init = None if initial_state is None else initial_state.transpose(-1, -2).contiguous()
    y, final = scan(tokens_first(x), tokens_first(dt), A.contiguous(), tokens_first(b), tokens_first(c), chunk_size,
                    D=None, z=None, dt_bias=None, initial_states=init, seq_idx=seq_idx, dt_softplus=False,
                    return_final_states=True)
    return y.transpose(1, 2), final.transpose(-1, -2)
