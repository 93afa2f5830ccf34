"""The delta rule's backends (kernels/delta_rule.py): the device rule picks torch on the CPU,
without flash-linear-attention and in float64, fla on CUDA sm80+ where it runs, and says why
a named fla cannot run; the conversion to fla's layout (varlen sequences at every row and
document start, per-sequence initial states, a row's final state from its last sequence,
q already scaled) gives the torch rule's outputs, states and gradients through a stand-in
with fla's contract. The real fla against the torch rule on a GPU: the gpu-marked test."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch

from moe_fold.config import Config, ConfigError
from moe_fold.kernels import backends
from moe_fold.kernels.delta_rule import delta_rule
from moe_fold.kernels.delta_rule_fla import fla_delta_rule, fla_function
from moe_fold.kernels.gated_delta import chunk_gated_delta_rule
from moe_fold.parallel.varlen import starts_from_resets
from tests.helpers.host_syncs import uncounted
from tests.models.test_gated_deltanet import _inputs, _resets

HAS_FLA = importlib.util.find_spec("fla") is not None


@pytest.mark.parametrize("device, capability, dtype, extras, want", [
    ("cpu", None, torch.float32, {"fla"}, "torch"),
    ("cuda", (9, 0), torch.float32, set(), "torch"),  # fla absent
    ("cuda", (9, 0), torch.float32, {"fla"}, "fla"),
    ("cuda", (8, 0), torch.bfloat16, {"fla"}, "fla"),
    ("cuda", (9, 0), torch.float64, {"fla"}, "torch"),  # fla has no float64 kernels
    ("cuda", (7, 5), torch.float32, {"fla"}, "torch"),  # Triton's bf16/tf32 kernels want sm80
    ("mps", None, torch.float32, {"fla"}, "torch"),
])
def test_the_rule_picks_fla_only_on_cuda_sm80_where_it_runs(device, capability, dtype, extras, want):
    assert backends.choose("delta_rule", device, capability, dtype, frozenset(extras)) == want


def test_a_named_fla_off_cuda_is_refused_with_the_reason_and_the_fix():
    config = Config()
    config.model.linear_backend = "fla"
    # A model without Gated DeltaNet or KDA layers never calls the rule: nothing to resolve.
    assert backends.resolve_config(config, torch.device("cpu")).model.linear_backend == "fla"
    config.model.layer_types = ["kda", "attention"]
    with pytest.raises(ConfigError, match=r"model.linear_backend=fla cannot run here: flash-linear-attention's "
                                          r"Triton kernels run on CUDA tensors, got cpu; fix: pip install "
                                          r"'moe-fold\[fla\]'.*or set model.linear_backend=torch"):
        backends.resolve_config(config, torch.device("cpu"))
    config.model.linear_backend = "auto"
    assert backends.resolve_config(config, torch.device("cpu")).model.linear_backend == "torch"
    with pytest.raises(backends.BackendUnavailable, match="delta_rule backend 'fla' cannot run here"):
        backends.resolve("delta_rule", "fla", torch.zeros(1))


def test_fla_absent_is_an_import_error_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "fla", None)  # `import fla...` fails as where it is not installed
    with pytest.raises(ImportError, match=r"import fla.ops.kda failed .*pip install 'moe-fold\[fla\]'"):
        fla_function("kda")
    with pytest.raises(ImportError, match="fla.ops.gated_delta_rule"):
        delta_rule("fla", "gated_delta_rule")
    # auto on the CPU never imports fla
    q, k, v, g, beta = (t.detach().float() for t in _inputs(S=9))
    got = delta_rule("auto", "kda")(q, k, v, g, beta)[0]
    torch.testing.assert_close(got, chunk_gated_delta_rule(q, k, v, g, beta)[0])


def fake_fla(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
             cu_seqlens_cpu=None):
    """fla's contract (``chunk_gated_delta_rule`` / ``chunk_kda``) on the CPU: ``[1, T, H, d]``
    tokens cut into the sequences of ``cu_seqlens`` (each from its ``initial_state`` row, or
    zeros), q multiplied by ``scale`` (default ``dk**-0.5``), the final state of every sequence.
    The sequences are read from ``cu_seqlens_cpu``, the host copy that spares fla a device
    read, which must equal ``cu_seqlens``."""
    assert q.shape[0] == 1 and cu_seqlens is not None and cu_seqlens.dtype == torch.int64
    assert cu_seqlens_cpu is not None and cu_seqlens_cpu.device.type == "cpu"
    with uncounted():
        assert torch.equal(cu_seqlens_cpu, cu_seqlens.cpu())
        bounds = cu_seqlens_cpu.tolist()
    assert bounds[0] == 0 and bounds[-1] == q.shape[1]
    assert g.shape[:3] == q.shape[:3] and beta.shape == q.shape[:3]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    outs, finals = [], []
    for n, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:])):
        def seq(t):  # [1, T, H, ...] -> [1, H, len, ...]
            return t[:, lo:hi].transpose(1, 2)
        init = None if initial_state is None else initial_state[n:n + 1]
        o, final = chunk_gated_delta_rule(seq(q) * scale, seq(k), seq(v), seq(g), seq(beta), initial_state=init,
                                          chunk_size=5)
        outs.append(o.transpose(1, 2))
        finals.append(final)
    return torch.cat(outs, dim=1), (torch.cat(finals) if output_final_state else None)


@pytest.mark.parametrize("decay", ["head", "channel"])
@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_fla_layout_gives_the_torch_rule(decay, packed, with_state):
    """Through a stand-in with fla's contract, the conversion gives the torch rule's outputs,
    final states and gradients: row 0 has documents starting at 0, 5, 16 and 36 (the first
    discards its initial state), row 1 at 9, 10 and 30 (its first carries the initial state)."""
    inputs = [t.detach().float().requires_grad_() for t in _inputs(decay=decay)]
    B, H, S, dk = inputs[1].shape
    resets = _resets(B, S, [[0, 5, 16, 36], [9, 10, 30]]) if packed else None
    init = torch.randn(B, H, dk, 7, generator=torch.Generator().manual_seed(3)) if with_state else None
    probe = torch.randn(B, H, S, 7, generator=torch.Generator().manual_seed(4))
    want, want_state = chunk_gated_delta_rule(*inputs, resets=resets, initial_state=init, chunk_size=8)
    want_grads = torch.autograd.grad((want * probe).sum() + want_state.sum(), inputs)
    starts = None if resets is None else starts_from_resets(resets, torch.device("cpu"))
    got, got_state = fla_delta_rule(fake_fla, *inputs, starts=starts, initial_state=init)
    got_grads = torch.autograd.grad((got * probe).sum() + got_state.sum(), inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-6)
    for name, a, b in zip("qkvgb", got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_FLA, reason="flash-linear-attention is not installed (pip install 'moe-fold[fla]')")
@pytest.mark.parametrize("decay", ["head", "channel"])
def test_fla_on_the_gpu_equals_the_torch_rule(decay):
    """fla's kernels (chunk_gated_delta_rule, chunk_kda) in float32 on CUDA against the torch
    rule there: packed documents and initial states, outputs, final states and gradients."""
    device = torch.device("cuda")
    assert backends.choose_for("delta_rule", device, torch.float32) == "fla"
    inputs = [t.detach().float().to(device).requires_grad_() for t in _inputs(B=2, H=4, S=200, dk=64, dv=64,
                                                                              decay=decay)]
    B, H, S, dk = inputs[1].shape
    resets = _resets(B, S, [[0, 50, 64, 199], [90, 130]]).to(device)
    init = torch.randn(B, H, dk, 64, device=device) * 0.1
    probe = torch.randn(B, H, S, 64, device=device)
    kind = "kda" if decay == "channel" else "gated_delta_rule"
    results = []
    starts = starts_from_resets(resets, device)
    for rule in (delta_rule("fla", kind), delta_rule("torch", kind)):
        o, state = rule(*inputs, starts=starts, initial_state=init)
        grads = torch.autograd.grad((o * probe).sum() + state.sum(), inputs)
        results.append((o, state, grads))
    (o, state, grads), (want, want_state, want_grads) = results
    torch.testing.assert_close(o, want, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(state, want_state, rtol=2e-3, atol=2e-3)
    for name, a, b in zip("qkvgb", grads, want_grads):
        torch.testing.assert_close(a, b, rtol=5e-3, atol=5e-3, msg=lambda m: f"grad of {name}: {m}")
