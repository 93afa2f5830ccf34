"""Compute kernels behind one interface each (import as ``moe_fold.kernels``).

Nothing here knows about process groups."""
