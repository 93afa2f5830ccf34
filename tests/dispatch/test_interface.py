"""The dispatcher interface (dispatch/interface.py): the expert-major order in which received
chunks are laid out for the experts, and its inverse."""

from moe_fold.dispatch.interface import expert_major_order


def test_expert_major_order_is_a_permutation_and_its_inverse():
    for etp, ep, el in [(1, 1, 1), (2, 4, 3), (1, 8, 2), (2, 1, 1)]:
        fwd = expert_major_order(etp, ep, el)
        inv = expert_major_order(etp, ep, el, inverse=True)
        n = etp * ep * el
        assert sorted(fwd) == list(range(n))
        # Chunk fwd[i] lands at i; the inverse order puts it back at fwd[i].
        assert [fwd[i] for i in inv] == list(range(n))
        # Received chunk (t, j, le) goes to expert position (le, j, t).
        for i, c in enumerate(fwd):
            t, j, le = c // (ep * el), c // el % ep, c % el
            assert i == (le * ep + j) * etp + t
