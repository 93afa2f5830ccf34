"""Mamba2's SSD scan backends (kernels/ssd_scan.py): the device rule picks torch on the CPU,
without mamba-ssm and in float64, mamba_ssm on CUDA sm80+ where it runs, and says why a named
mamba_ssm cannot run; the conversion to mamba-ssm's layout (documents as ``seq_idx``, states
transposed, the step passed as is, groups of heads) gives the torch scan's outputs, final
states and gradients through a stand-in with ``mamba_chunk_scan_combined``'s contract, in the
layer too. The real mamba-ssm against the torch scan on a GPU: the gpu-marked test."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from moe_fold.config import Config, ConfigError
from moe_fold.kernels import backends
from moe_fold.kernels.ssd_mamba import mamba_function, mamba_ssd
from moe_fold.kernels.ssd_scan import ssd_scan, torch_ssd
from moe_fold.parallel.varlen import Documents
from tests.kernels.test_ssd import _resets
from tests.models.test_mamba2 import _layer

HAS_MAMBA = importlib.util.find_spec("mamba_ssm") is not None


@pytest.mark.parametrize("device, capability, dtype, extras, want", [
    ("cpu", None, torch.float32, {"mamba_ssm"}, "torch"),
    ("cuda", (9, 0), torch.float32, set(), "torch"),  # mamba-ssm absent
    ("cuda", (9, 0), torch.float32, {"fla"}, "torch"),  # another extra is not this one
    ("cuda", (9, 0), torch.float32, {"mamba_ssm"}, "mamba_ssm"),
    ("cuda", (8, 0), torch.bfloat16, {"mamba_ssm"}, "mamba_ssm"),
    ("cuda", (9, 0), torch.float64, {"mamba_ssm"}, "torch"),  # no float64 kernels
    ("cuda", (7, 5), torch.float32, {"mamba_ssm"}, "torch"),
    ("mps", None, torch.float32, {"mamba_ssm"}, "torch"),
])
def test_the_rule_picks_mamba_ssm_only_on_cuda_sm80_where_it_runs(device, capability, dtype, extras, want):
    assert backends.choose("ssd", device, capability, dtype, frozenset(extras)) == want


def test_a_named_mamba_ssm_off_cuda_is_refused_with_the_reason_and_the_fix():
    config = Config()
    config.model.mamba_backend = "mamba_ssm"
    # A model without Mamba2 layers never calls the scan: nothing to resolve.
    assert backends.resolve_config(config, torch.device("cpu")).model.mamba_backend == "mamba_ssm"
    config.model.layer_types = ["mamba2", "attention"]
    with pytest.raises(ConfigError, match=r"model.mamba_backend=mamba_ssm cannot run here: mamba-ssm's Triton "
                                          r"kernels run on CUDA tensors, got cpu; fix: pip install "
                                          r"'moe-fold\[mamba\]'.*or set model.mamba_backend=torch"):
        backends.resolve_config(config, torch.device("cpu"))
    config.model.mamba_backend = "auto"
    assert backends.resolve_config(config, torch.device("cpu")).model.mamba_backend == "torch"
    with pytest.raises(backends.BackendUnavailable, match="ssd backend 'mamba_ssm' cannot run here"):
        backends.resolve("ssd", "mamba_ssm", torch.zeros(1))
    with pytest.raises(ValueError, match="ssd scan: backend='triton' is not one of auto, torch, mamba_ssm"):
        ssd_scan("triton")


def _inputs(B=2, H=4, G=2, S=41, P=5, N=3, seed=0):
    gen = torch.Generator().manual_seed(seed)
    x = torch.randn(B, H, S, P, generator=gen)
    dt = torch.rand(B, H, S, generator=gen) * 0.5 + 0.01
    A = -torch.rand(H, generator=gen) * 2 - 0.1
    b = torch.randn(B, G, S, N, generator=gen)
    c = torch.randn(B, G, S, N, generator=gen)
    return [t.requires_grad_() for t in (x, dt, A, b, c)]


def test_mamba_absent_is_an_import_error_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "mamba_ssm", None)  # `import mamba_ssm...` fails as where it is not installed
    with pytest.raises(ImportError, match=r"import mamba_ssm.ops.triton.ssd_combined failed .*"
                                          r"pip install 'moe-fold\[mamba\]'"):
        mamba_function()
    with pytest.raises(ImportError, match="mamba_ssm"):
        ssd_scan("mamba_ssm")
    with pytest.raises(ImportError, match="mamba_ssm"):  # a layer builds the scan its config names
        _layer(mamba_backend="mamba_ssm")
    # auto on the CPU never imports mamba-ssm
    inputs = [t.detach() for t in _inputs()]
    torch.testing.assert_close(ssd_scan("auto")(*inputs)[0], torch_ssd(*inputs)[0])


def fake_mamba(x, dt, A, B, C, chunk_size, D=None, z=None, dt_bias=None, initial_states=None, seq_idx=None,
               dt_softplus=False, dt_limit=(0.0, float("inf")), return_final_states=False):
    """``mamba_chunk_scan_combined``'s contract on the CPU, one token at a time: ``x [B, L, H, P]``,
    ``dt [B, L, H]`` (plus ``dt_bias``, through softplus if asked, clamped to ``dt_limit``),
    ``A [H]``, ``B, C [B, L, G, N]`` (group ``h // (H / G)`` for head h), state ``[B, H, P, N]``
    from ``initial_states`` (or zeros), zeroed before a token whose ``seq_idx`` differs from the
    token before's (0 before the first), ``y = C . state + D x``, times ``silu(z)``."""
    Bsz, L, H, P = x.shape
    assert dt.shape == (Bsz, L, H) and A.shape == (H,) and B.shape[:2] == (Bsz, L) and C.shape == B.shape
    heads_group = torch.arange(H) // (H // B.shape[2])
    if dt_bias is not None:
        dt = dt + dt_bias
    if dt_softplus:
        dt = F.softplus(dt)
    dt = dt.clamp(*dt_limit)
    state = x.new_zeros(Bsz, H, P, B.shape[-1]) if initial_states is None else initial_states
    prev = torch.zeros(Bsz, dtype=torch.int64)
    ys = []
    for t in range(L):
        if seq_idx is not None:
            same = (seq_idx[:, t].to(torch.int64) == prev).to(x.dtype)
            state = state * same[:, None, None, None]
            prev = seq_idx[:, t].to(torch.int64)
        Bt, Ct = B[:, t][:, heads_group], C[:, t][:, heads_group]  # [B, H, N]
        decay = (dt[:, t] * A).exp()[..., None, None]
        state = decay * state + (dt[:, t, :, None] * x[:, t])[..., None] * Bt[:, :, None, :]
        y = (state * Ct[:, :, None, :]).sum(-1)  # [B, H, P]
        if D is not None:
            y = y + (D[:, None] if D.dim() == 1 else D) * x[:, t]
        ys.append(y)
    out = torch.stack(ys, dim=1)
    if z is not None:
        out = out * F.silu(z)
    return (out, state) if return_final_states else out


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("with_state", [False, True])
def test_mamba_layout_gives_the_torch_scan(packed, with_state):
    """Through a stand-in with mamba-ssm's contract, the conversion gives the torch scan's
    outputs, final states and gradients: 4 heads in 2 groups; row 0 has documents starting at
    0, 5, 16 and 36 (the first discards its initial state), row 1 at 9, 10 and 30 (its first
    carries the initial state)."""
    inputs = _inputs()
    B, H, S, P = inputs[0].shape
    resets = _resets(B, S, [[0, 5, 16, 36], [9, 10, 30]]) if packed else None
    init = torch.randn(B, H, 3, P, generator=torch.Generator().manual_seed(3)) if with_state else None
    probe = torch.randn(B, H, S, P, generator=torch.Generator().manual_seed(4))
    want, want_state = torch_ssd(*inputs, resets=resets, initial_state=init, chunk_size=8)
    want_grads = torch.autograd.grad((want * probe).sum() + want_state.sum(), inputs)
    got, got_state = mamba_ssd(fake_mamba, *inputs, resets=resets, initial_state=init)
    got_grads = torch.autograd.grad((got * probe).sum() + got_state.sum(), inputs)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(got_state, want_state, rtol=1e-5, atol=1e-5)
    for name, a, b in zip(["x", "dt", "A", "B", "C"], got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-4, msg=lambda m: f"grad of {name}: {m}")


def test_the_layer_through_the_mamba_layout_equals_the_torch_scan():
    """The Mamba2 layer (6 heads in 3 groups, packed documents) gives the same output when its
    scan is the mamba-ssm conversion over the stand-in: the layer hands the scan the raw x,
    the step after softplus and the floor, A and the per-group B and C."""
    layer = _layer(mamba_backend="torch")
    with torch.no_grad():
        layer.dt_bias[:2] = -8.0  # below mamba_dt_min: the floor is the layer's, before the scan
    x = torch.randn(17, 2, 21)
    doc_ids = torch.repeat_interleave(torch.arange(3), torch.tensor([5, 3, 9]))[None].expand(2, -1)
    docs = Documents(doc_ids, None, None)
    want = layer(x, None, None, docs)
    layer.scan = lambda *args, **kwargs: mamba_ssd(fake_mamba, *args, **kwargs)
    torch.testing.assert_close(layer(x, None, None, docs), want, rtol=1e-5, atol=1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_MAMBA, reason="mamba-ssm is not installed (pip install 'moe-fold[mamba]')")
def test_mamba_ssm_on_the_gpu_equals_the_torch_scan():
    """mamba-ssm's mamba_chunk_scan_combined in float32 on CUDA against the torch scan there:
    8 heads in 2 groups, head dim 64, state 64, packed documents and initial states; outputs,
    final states and gradients."""
    device = torch.device("cuda")
    assert backends.choose_for("ssd", device, torch.float32) == "mamba_ssm"
    inputs = [t.detach().to(device).requires_grad_() for t in _inputs(B=2, H=8, G=2, S=300, P=64, N=64)]
    B, H, S, P = inputs[0].shape
    resets = _resets(B, S, [[0, 50, 64, 299], [90, 130]]).to(device)
    init = torch.randn(B, H, 64, P, device=device) * 0.1
    probe = torch.randn(B, H, S, P, device=device)
    results = []
    for scan in (ssd_scan("mamba_ssm"), torch_ssd):
        y, state = scan(*inputs, resets=resets, initial_state=init, chunk_size=64)
        grads = torch.autograd.grad((y * probe).sum() + state.sum(), inputs)
        results.append((y, state, grads))
    (y, state, grads), (want, want_state, want_grads) = results
    torch.testing.assert_close(y, want, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(state, want_state, rtol=2e-3, atol=2e-3)
    for name, a, b in zip(["x", "dt", "A", "B", "C"], grads, want_grads):
        torch.testing.assert_close(a, b, rtol=5e-3, atol=5e-3, msg=lambda m: f"grad of {name}: {m}")
