"""Gated DeltaNet, KDA and Mamba2 built with the GPU libraries' backends
(``model.linear_backend=fla``, ``model.mamba_backend=mamba_ssm``,
``model.conv_backend=causal_conv1d``) equal the same layers on the torch backends, forward
and gradients, with packed documents, on the CPU: torch stand-ins with each library's call
signature and tensor layout are installed where the layers import them (``sys.modules``).
A forward and backward through them reads nothing back from the device beyond what the
batch made once (tests/helpers/host_syncs.py). The real libraries on a GPU: the gpu-marked test."""

from __future__ import annotations

import importlib.util
import sys
import types

import pytest
import torch

from moe_fold.config import ModelConfig
from moe_fold.models.gated_deltanet import GatedDeltaNet
from moe_fold.models.kda import KimiDeltaAttention
from moe_fold.models.mamba2 import Mamba2
from moe_fold.parallel.varlen import Documents, sequence_starts
from tests.helpers.host_syncs import count_host_syncs
from tests.kernels.test_delta_rule import fake_fla
from tests.kernels.test_short_conv import fake_causal_conv1d_fn
from tests.kernels.test_ssd_scan import fake_mamba

HAS_ALL = all(importlib.util.find_spec(name) is not None for name in ("fla", "mamba_ssm", "causal_conv1d"))
LIBRARIES = dict(linear_backend="fla", mamba_backend="mamba_ssm", conv_backend="causal_conv1d")
TORCH = dict(linear_backend="torch", mamba_backend="torch", conv_backend="torch")
# Conv channels in multiples of 8, as causal-conv1d's layout wants: 2*2*4 + 4*6, 3*2*4 (KDA: one
# count and width of heads), 4*4 + 2*2*4.
SIZES = dict(hidden_size=12, linear_num_key_heads=2, linear_key_head_dim=4, linear_num_value_heads=4,
             linear_value_head_dim=6, linear_conv_kernel=4, linear_chunk_size=4, mamba_num_heads=4,
             mamba_head_dim=4, mamba_num_groups=2, mamba_state_size=4, mamba_conv_kernel=4, mamba_chunk_size=4)
LAYERS = {"gated_deltanet": GatedDeltaNet, "kda": KimiDeltaAttention, "mamba2": Mamba2}
KIND_SIZES = {"kda": dict(linear_num_value_heads=2, linear_value_head_dim=4)}


@pytest.fixture
def stand_ins(monkeypatch):
    """The libraries' modules, each function a torch stand-in with the library's contract."""
    def module(name, **functions):
        monkeypatch.setitem(sys.modules, name, types.SimpleNamespace(**functions))

    for name in ("fla", "fla.ops", "mamba_ssm", "mamba_ssm.ops", "mamba_ssm.ops.triton"):
        module(name)
    module("fla.ops.gated_delta_rule", chunk_gated_delta_rule=fake_fla)
    module("fla.ops.kda", chunk_kda=fake_fla)
    module("mamba_ssm.ops.triton.ssd_combined", mamba_chunk_scan_combined=fake_mamba)
    module("causal_conv1d", causal_conv1d_fn=fake_causal_conv1d_fn)


def _layer(kind: str, backends: dict, device="cpu"):
    config = ModelConfig(**{**SIZES, **KIND_SIZES.get(kind, {})}, **backends)
    layer = LAYERS[kind](config, None, False, seed=0, name="l").to(device)
    with torch.no_grad():
        if kind == "mamba2":  # a live conv bias and skip, as trained ones
            layer.conv_bias.normal_(generator=torch.Generator().manual_seed(1))
            layer.D.normal_(generator=torch.Generator().manual_seed(2))
    return layer


# Document starts of the two rows: row 0 at 0, 5 and 6 (a one-token document), row 1 at 0 and 11.
ROW_STARTS = [[0, 5, 6], [0, 11]]


def _documents(S: int, device) -> Documents:
    """The batch's documents as the model makes them: ids on the host, their sequences made
    there once (``sequence_starts``), both then copied to ``device``."""
    ids = []
    for b, starts in enumerate(ROW_STARTS):
        row = [0] * S
        for s in starts[1:]:
            row[s] = 1
        ids.append([10 * b + sum(row[:t + 1]) for t in range(S)])
    host = torch.tensor(ids)  # [B, S]
    return Documents(host.to(device, non_blocking=True), None, None, sequence_starts(host, None, device))


def _run(layer, x, docs, probe):
    out = layer(x, None, None, docs)
    grads = torch.autograd.grad((out * probe).sum(), [x] + list(layer.parameters()))
    return out, grads


@pytest.mark.parametrize("packed", [False, True])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_the_library_backends_give_the_torch_layer(stand_ins, kind, packed):
    """Each layer through the stand-ins equals the torch layer (same weights): output and the
    gradients of the input and every parameter."""
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(17, 2, 12, generator=gen).requires_grad_()
    probe = torch.randn(17, 2, 12, generator=gen)
    docs = _documents(17, x.device) if packed else None
    want, want_grads = _run(_layer(kind, TORCH), x, docs, probe)
    library = _layer(kind, LIBRARIES)
    got, got_grads = _run(library, x, docs, probe)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)
    names = ["x"] + [name for name, _ in library.named_parameters()]
    for name, a, b in zip(names, got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5, msg=lambda m: f"grad of {name}: {m}")


@pytest.mark.parametrize("backends", [LIBRARIES, TORCH], ids=["libraries", "torch"])
@pytest.mark.parametrize("kind", list(LAYERS))
def test_a_packed_forward_and_backward_read_nothing_back_from_the_device(stand_ins, kind, backends):
    """Making the batch's documents (on the host, copied over) and a layer's forward and
    backward over them: no call that would make the host wait for a GPU (fla's grid comes from
    the host copy of cu_seqlens the batch made, not from reading the device once per layer)."""
    layer = _layer(kind, backends)
    x = torch.randn(17, 2, 12, requires_grad=True)
    with count_host_syncs() as syncs:
        docs = _documents(17, x.device)
        batch_time = list(syncs.calls)
        out = layer(x, None, None, docs)
        out.square().sum().backward()
    assert batch_time == [] and syncs.calls == [], syncs.calls


@pytest.mark.gpu
@pytest.mark.skipif(not HAS_ALL, reason="flash-linear-attention, mamba-ssm and causal-conv1d are not all installed "
                                        "(pip install 'moe-fold[fla,mamba,conv]')")
@pytest.mark.parametrize("kind", list(LAYERS))
def test_the_real_libraries_give_the_torch_layer_on_the_gpu(kind):
    """Each layer through the real fla / mamba-ssm / causal-conv1d kernels in float32 on CUDA
    against the torch layer there, with packed documents: output and gradients."""
    device = torch.device("cuda")
    gen = torch.Generator().manual_seed(3)
    x = torch.randn(17, 2, 12, generator=gen).to(device).requires_grad_()
    probe = torch.randn(17, 2, 12, generator=gen).to(device)
    docs = _documents(17, device)
    want, want_grads = _run(_layer(kind, TORCH, device), x, docs, probe)
    library = _layer(kind, LIBRARIES, device)
    got, got_grads = _run(library, x, docs, probe)
    torch.testing.assert_close(got, want, rtol=2e-3, atol=2e-3)
    names = ["x"] + [name for name, _ in library.named_parameters()]
    for name, a, b in zip(names, got_grads, want_grads):
        torch.testing.assert_close(a, b, rtol=5e-3, atol=5e-3, msg=lambda m: f"grad of {name}: {m}")
