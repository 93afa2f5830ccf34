"""The host staging arena of async checkpoints (moe_fold/training/host_staging.py): the staged
copies hold every piece's bytes, share one buffer, and the buffer grows only with the state."""

import torch

from moe_fold.training.host_staging import StagingArena


def test_staging_arena_grows_only_when_the_state_does():
    """The arena's bytes are the pieces' (every dtype, odd sizes, a scalar, empty), it
    keeps its buffer for a smaller or equal state and replaces it for a larger one."""
    gen = torch.Generator().manual_seed(0)

    def pieces(n):
        return [("a", torch.randn(n, 3, generator=gen)), ("b", torch.randint(0, 9, (n + 1,), generator=gen)),
                ("c", torch.randn(5, generator=gen).to(torch.bfloat16)), ("d", torch.tensor(True)),
                ("e", torch.empty(0, 4)), ("f", torch.randn(2, 3, generator=gen, dtype=torch.float64).t())]

    arena = StagingArena()
    for n, allocations in ((7, 1), (7, 1), (2, 1), (40, 2), (3, 2)):
        src = pieces(n)
        staged = arena.stage(src)
        staged.wait()
        assert arena.allocations == allocations, n
        assert [k for k, _ in staged.pieces] == [k for k, _ in src]
        for (_, want), (_, got) in zip(src, staged.pieces):
            assert got.dtype == want.dtype and got.shape == want.shape and torch.equal(got, want)
            assert got.untyped_storage().data_ptr() == arena.buffer.untyped_storage().data_ptr()
        before = [t.clone() for _, t in src]
        for _, t in src:  # the copies are copies: changing the source leaves them
            t.logical_not_() if t.dtype == torch.bool else t.add_(1)
        assert all(torch.equal(g, b) for (_, g), b in zip(staged.pieces, before))
