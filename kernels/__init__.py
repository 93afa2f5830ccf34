"""Compute kernels behind one interface each (import as ``moe_fold.kernels``).

Nothing here knows about process groups. Import from the interface modules:

- :mod:`moe_fold.kernels.gmm`: ``gmm`` grouped GEMM (backends grouped_gemm, torch, triton, loop);
- :mod:`moe_fold.kernels.permute`: ``permute``/``unpermute`` (and padded variants), ``sort_chunks``;
- :mod:`moe_fold.kernels.swiglu`: ``swiglu``, the prob-weighted SwiGLU of the experts;
- :mod:`moe_fold.kernels.topk`: the router top-k's backend switch (the fused kernel is
  :mod:`moe_fold.kernels.topk_triton`);
- :mod:`moe_fold.kernels.backends`: what ``auto`` means for each of them (one rule by device,
  CUDA capability and dtype) and whether a backend runs here.

The package itself re-exports nothing, so ``moe_fold.kernels.gmm`` stays the module and
importing a torch kernel never imports Triton.
"""
