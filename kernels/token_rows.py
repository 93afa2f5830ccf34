"""Which permuted rows belong to each token, in CSR form: the index both permute backends
(torch in ``permute.py``, Triton in ``permute_triton.py``) use to sum a token's rows in
unpermute, so every output row is written by one program and no atomics are needed."""

from __future__ import annotations

import torch


def rows_by_token(sorted_indices: torch.Tensor, num_tokens: int
                  ) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows of each token in CSR form: ``rows[N]`` (row ids grouped by token,
    expert order kept) and ``row_ptr[T + 2]`` (token t owns
    ``rows[row_ptr[t]:row_ptr[t + 1]]``; the padding rows, index T, come last).

    No host sync (counts by scatter_add_, not bincount, whose output size is data
    dependent); an index outside ``[0, num_tokens]`` raises in scatter_add_.
    """
    rows = torch.argsort(sorted_indices, stable=True)
    counts = torch.zeros(num_tokens + 1, dtype=torch.long, device=sorted_indices.device)
    counts.scatter_add_(0, sorted_indices, torch.ones_like(sorted_indices))
    row_ptr = torch.zeros(num_tokens + 2, dtype=torch.long, device=sorted_indices.device)
    torch.cumsum(counts, 0, out=row_ptr[1:])
    return rows, row_ptr
