"""The short conv's backends (kernels/short_conv.py): the device rule picks causal_conv1d only
on CUDA sm80+ where it runs, a conv shape its kernels do not take runs torch under auto and is
refused when named, an absent package is an ImportError naming the install; the conversion to
causal-conv1d's layout (channels innermost, packed documents as ``seq_idx``, the history
prepended) gives the torch conv's outputs and gradients through a stand-in with
``causal_conv1d_fn``'s contract. The real causal-conv1d against the torch conv on a GPU: the
gpu-marked test."""

from __future__ import annotations

import importlib.util
import sys

import pytest
import torch
import torch.nn.functional as F

from moe_fold.config import Config, ConfigError, validate
from moe_fold.kernels import backends
from moe_fold.kernels.short_conv import short_conv, torch_conv
from moe_fold.kernels.short_conv_causal_conv1d import causal_conv1d_function, library_conv

HAS_CAUSAL_CONV1D = importlib.util.find_spec("causal_conv1d") is not None


@pytest.mark.parametrize("device, capability, dtype, extras, want", [
    ("cpu", None, torch.float32, {"causal_conv1d"}, "torch"),
    ("cuda", (9, 0), torch.float32, set(), "torch"),  # causal-conv1d absent
    ("cuda", (9, 0), torch.float32, {"mamba_ssm", "fla"}, "torch"),  # other extras are not this one
    ("cuda", (9, 0), torch.float32, {"causal_conv1d"}, "causal_conv1d"),
    ("cuda", (8, 0), torch.bfloat16, {"causal_conv1d"}, "causal_conv1d"),
    ("cuda", (9, 0), torch.float64, {"causal_conv1d"}, "torch"),  # no float64 kernels
    ("cuda", (7, 5), torch.float32, {"causal_conv1d"}, "torch"),
    ("mps", None, torch.float32, {"causal_conv1d"}, "torch"),
])
def test_the_rule_picks_causal_conv1d_only_on_cuda_sm80_where_it_runs(device, capability, dtype, extras, want):
    assert backends.choose("conv", device, capability, dtype, frozenset(extras)) == want


def _recurrent_config(**model) -> Config:
    config = Config()
    config.model.num_layers = 2
    config.model.layer_types = ["mamba2", "gated_deltanet"]
    for name, value in model.items():
        setattr(config.model, name, value)
    return config


def test_a_named_causal_conv1d_off_cuda_is_refused_with_the_reason_and_the_fix():
    config = Config()
    config.model.conv_backend = "causal_conv1d"
    # A model without recurrent layers never calls the conv: nothing to resolve.
    assert backends.resolve_config(config, torch.device("cpu")).model.conv_backend == "causal_conv1d"
    config = _recurrent_config(conv_backend="causal_conv1d")
    with pytest.raises(ConfigError, match=r"model.conv_backend=causal_conv1d cannot run here: causal-conv1d's "
                                          r"kernels run on CUDA tensors, got cpu; fix: pip install "
                                          r"'moe-fold\[conv\]'.*or set model.conv_backend=torch"):
        backends.resolve_config(config, torch.device("cpu"))
    config.model.conv_backend = "auto"
    assert backends.resolve_config(config, torch.device("cpu")).model.conv_backend == "torch"
    with pytest.raises(backends.BackendUnavailable, match="conv backend 'causal_conv1d' cannot run here"):
        backends.resolve("conv", "causal_conv1d", torch.zeros(1))
    with pytest.raises(ValueError, match="short conv: backend='triton' is not one of auto, torch, causal_conv1d"):
        short_conv("triton", 4, 8)


def test_a_conv_shape_causal_conv1d_does_not_take_runs_torch_under_auto_and_is_refused_when_named(monkeypatch):
    """Widths 2 to 4 and channels in multiples of 8 (per tp rank): auto resolves to torch with
    the reason, a named causal_conv1d is a config error naming the layers, and the layer's
    factory builds the torch conv for auto without importing the package."""
    # A device where causal-conv1d runs: the shape alone decides.
    monkeypatch.setattr(backends, "choose_for", lambda op, device, dtype, **kw: "causal_conv1d" if op == "conv"
                        else "torch")
    monkeypatch.setattr(backends, "problem", lambda name, device: None)
    fits = _recurrent_config(mamba_conv_kernel=4, linear_conv_kernel=4)  # 64+2*16=96 and 2*64+128=256 channels
    assert backends.resolve_config(fits, torch.device("cpu")).model.conv_backend == "causal_conv1d"
    for misfit, why in ((dict(mamba_conv_kernel=5), "mamba2 width 5"),
                        (dict(linear_key_head_dim=3), "gated_deltanet width 4 x 140 channels")):
        config = _recurrent_config(**misfit)
        assert backends.resolve_config(config, torch.device("cpu")).model.conv_backend == "torch", why
        config.model.conv_backend = "causal_conv1d"
        with pytest.raises(ConfigError, match=r"model.conv_backend=causal_conv1d cannot take the short conv of the "
                                              r"(mamba2|gated_deltanet) layers: causal-conv1d takes"):
            validate(config, 1)
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)
    assert short_conv("auto", 5, 8) is torch_conv and short_conv("auto", 4, 12) is torch_conv
    with pytest.raises(ValueError, match="causal-conv1d takes kernel widths 2 to 4, got 5"):
        short_conv("causal_conv1d", 5, 8)


def test_causal_conv1d_absent_is_an_import_error_naming_the_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "causal_conv1d", None)  # `import causal_conv1d` fails as where it is absent
    with pytest.raises(ImportError, match=r"import causal_conv1d failed .*pip install 'moe-fold\[conv\]'"):
        causal_conv1d_function()
    with pytest.raises(ImportError, match="causal_conv1d"):
        short_conv("causal_conv1d", 4, 16)
    # auto on the CPU never imports causal-conv1d
    x, weight, bias = torch.randn(9, 2, 16), torch.randn(16, 4), torch.randn(16)
    torch.testing.assert_close(short_conv("auto", 4, 16)(x, weight, bias), torch_conv(x, weight, bias))


def fake_causal_conv1d_fn(x, weight, bias=None, seq_idx=None, initial_states=None, return_final_states=False,
                          final_states_out=None, activation=None):
    """``causal_conv1d_fn``'s contract on the CPU: ``x (batch, dim, seqlen)``, ``weight (dim,
    width)`` with widths 2 to 4, ``bias (dim,)``; ``seq_idx (batch, seqlen)`` int32 and
    contiguous, taken only with the channels innermost (``x.stride(1) == 1``, dim a multiple
    of 8, as its batch and token strides) and without ``initial_states``: a tap reads a token only where its index equals the
    output token's; ``activation`` None or silu. The output is laid out as ``x``."""
    batch, dim, seqlen = x.shape
    width = weight.shape[1]
    assert weight.shape == (dim, width) and 2 <= width <= 4, "causal_conv1d only supports width between 2 and 4"
    assert activation in (None, "silu", "swish")
    channel_last = x.stride(1) == 1 and x.stride(2) > 1
    if channel_last:
        assert dim % 8 == 0, "causal_conv1d only supports channel dimension divisible by 8 for now"
        assert x.stride(2) % 8 == 0 and x.stride(0) % 8 == 0, \
            "causal_conv1d with channel last layout requires strides (x.stride(0) and x.stride(2)) to be multiples of 8"
    if seq_idx is not None:
        assert channel_last, "seq_idx is only supported for channel last layout"
        assert seq_idx.dtype == torch.int32 and seq_idx.is_contiguous() and seq_idx.shape == (batch, seqlen)
        assert initial_states is None and not return_final_states
    assert initial_states is None, "the stand-in takes no initial_states (our conversion passes none)"
    out = torch.zeros_like(x)
    for shift in range(width):  # tap width-1-shift reads the token `shift` back
        term = F.pad(x, (shift, 0))[..., :seqlen]
        if seq_idx is not None and shift:
            earlier = F.pad(seq_idx, (shift, 0), value=torch.iinfo(torch.int32).min)[..., :seqlen]
            term = term * (earlier == seq_idx).unsqueeze(1).to(x.dtype)
        out = out + weight[:, width - 1 - shift, None] * term
    if bias is not None:
        out = out + bias[:, None]
    out = F.silu(out) if activation in ("silu", "swish") else out
    return torch.empty_like(x).copy_(out)


def _window_ids(B, back, S, starts):
    """``[B, back+S]`` document ids: the history's positions first (-1, -2, ...: none's),
    then row b's documents starting at ``starts[b]``."""
    rows = []
    for b in range(B):
        flags = torch.zeros(S, dtype=torch.int64)
        flags[starts[b]] = 1
        rows.append(torch.cat([-torch.arange(back, 0, -1), flags.cumsum(0) + 100 * b]))
    return torch.stack(rows)


@pytest.mark.parametrize("with_history", [False, True])
@pytest.mark.parametrize("packed", [False, True])
def test_causal_conv1d_layout_gives_the_torch_conv(packed, with_history):
    """Through a stand-in with causal-conv1d's contract, the conversion gives the torch conv's
    outputs and gradients (of x, weight, bias and the history): 16 channels, width 4; row 0 has
    documents starting at 0, 5 and 6, row 1 at 3 and 10 (its first reads the history)."""
    gen = torch.Generator().manual_seed(0)
    S, B, C, K = 13, 2, 16, 4
    inputs = [torch.randn(S, B, C, generator=gen), torch.randn(C, K, generator=gen), torch.randn(C, generator=gen),
              torch.randn(K - 1, B, C, generator=gen)]
    inputs = [t.requires_grad_() for t in inputs]
    x, weight, bias, history = inputs
    history = history if with_history else None
    doc_ids = _window_ids(B, K - 1, S, [[0, 5, 6], [3, 10]]) if packed else None
    probe = torch.randn(S, B, C, generator=gen)
    used = inputs if with_history else inputs[:3]
    want = torch_conv(x, weight, bias, history, doc_ids)
    want_grads = torch.autograd.grad((want * probe).sum(), used)
    got = library_conv(fake_causal_conv1d_fn, x, weight, bias, history, doc_ids)
    got_grads = torch.autograd.grad((got * probe).sum(), used)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)
    for name, a, b in zip(["x", "weight", "bias", "history"], got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-5, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_CAUSAL_CONV1D, reason="causal-conv1d is not installed (pip install 'moe-fold[conv]')")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_causal_conv1d_on_the_gpu_equals_the_torch_conv(dtype):
    """causal-conv1d's CUDA kernels against the torch conv there: 64 channels, width 4, packed
    documents and a history; outputs and gradients of x, weight, bias and the history."""
    device = torch.device("cuda")
    assert backends.choose_for("conv", device, dtype) == "causal_conv1d"
    gen = torch.Generator().manual_seed(0)
    S, B, C, K = 300, 2, 64, 4
    x = torch.randn(S, B, C, generator=gen).to(device, dtype).requires_grad_()
    weight, bias = (t.to(device).requires_grad_() for t in (torch.randn(C, K, generator=gen),
                                                             torch.randn(C, generator=gen)))
    history = torch.randn(K - 1, B, C, generator=gen).to(device, dtype).requires_grad_()
    doc_ids = _window_ids(B, K - 1, S, [[0, 50, 51, 299], [90, 130]]).to(device)
    probe = torch.randn(S, B, C, generator=gen).to(device, dtype)
    results = []
    for conv in (short_conv("causal_conv1d", K, C), torch_conv):
        out = conv(x, weight, bias, history, doc_ids)
        results.append((out, torch.autograd.grad((out * probe).float().sum(), (x, weight, bias, history))))
    (got, grads), (want, want_grads) = results
    # In bf16 the torch conv promotes to the float32 weight, the kernel returns x's dtype.
    tol = 1e-4 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.float(), want.float(), rtol=tol, atol=tol)
    for name, a, b in zip(["x", "weight", "bias", "history"], grads, want_grads):
        torch.testing.assert_close(a.float(), b.float(), rtol=tol, atol=tol * 10, msg=lambda m: f"grad of {name}: {m}")
