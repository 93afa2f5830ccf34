"""Comparisons the layout-invariance tests share: a rank's global grads, grad norm and
losses against the single-process reference's."""

import numpy as np
import torch


def assert_grads_match(got: dict, ref: dict, where: str, rtol: float = 1e-4, atol: float = 2e-6) -> None:
    """``got`` and ``ref``: parameter name -> numpy grad. Same names; every reference grad
    non-zero (a zero one would make the comparison vacuous); each grad within tolerance."""
    assert got.keys() == ref.keys(), where
    for name, g in ref.items():
        assert np.abs(g).max() > 0, f"{where}: reference grad {name} is zero"
        torch.testing.assert_close(torch.from_numpy(got[name]), torch.from_numpy(g), rtol=rtol, atol=atol,
                                   msg=lambda m: f"{where} grad {name}: {m}")


def assert_run_matches(got: dict, ref: dict, where: str, norm: str = "norm") -> None:
    """A rank's run (``grads``, grad ``norm`` and ``losses``) against the reference's."""
    assert_grads_match(got["grads"], ref["grads"], where)
    for key in (norm, "losses"):
        torch.testing.assert_close(got[key], ref[key], rtol=1e-5, atol=0, msg=lambda m: f"{where} {key}: {m}")
