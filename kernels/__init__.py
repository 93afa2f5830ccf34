"""Compute kernels behind one interface each (import as ``moe_fold.kernels``).

Nothing here knows about process groups."""

from .gmm import gmm
from .permute import chunk_order, permute, permute_padded, sort_chunks, unpermute
from .swiglu import swiglu
from .topk_triton import topk_softmax_triton
