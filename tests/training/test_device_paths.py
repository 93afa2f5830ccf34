"""What a first run on a GPU meets, checked on the CPU: every collective gets tensors on
the compute device (NCCL reduces only GPU tensors), and bf16 autocast works with every
grouped GEMM backend.

The device check: a GPU run makes a tensor on the host when a factory call
(``torch.tensor``, ``zeros``, ``full`` ...) names no device. Here such calls land on the
``meta`` device instead (``torch.set_default_device``), while the model and its inputs
live on the CPU, the stand-in compute device; every ``torch.distributed`` collective is
wrapped to assert that each of its tensors is on the CPU. A host-built tensor that reaches
a collective is then caught by name, on CPU ranks, exactly where NCCL would refuse it.
"""

from __future__ import annotations

import contextlib
import math
import os

import pytest
import torch
import torch.distributed as dist

from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, create_process_groups
from moe_fold.models.moe_layer import MoELayer
from moe_fold.training.train import read_metrics, train

from tests.models.test_moe_layer import H, _config, _inputs
from tests.training.test_train import small_config

# The torch.distributed calls that take tensors (comm.py wraps them all). isend/irecv stay
# as they are: P2POp checks their identity; batch_isend_irecv checks the P2POps' tensors.
_COLLECTIVES = ("all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single",
                "all_gather_into_tensor", "reduce_scatter_tensor", "broadcast", "send", "recv",
                "all_gather", "reduce_scatter", "all_to_all", "batch_isend_irecv", "reduce", "gather", "scatter")


def _tensors_of(values):
    for v in values:
        if isinstance(v, torch.Tensor):
            yield v
        elif isinstance(v, dist.P2POp):
            yield v.tensor
        elif isinstance(v, (list, tuple)):
            yield from _tensors_of(v)


@contextlib.contextmanager
def collectives_on(device: torch.device, seen: list):
    """Inside: every collective asserts its tensors are on ``device``; ``seen`` gets its name."""
    originals = {name: getattr(dist, name) for name in _COLLECTIVES if hasattr(dist, name)}

    def checked(name, fn):
        def call(*args, **kwargs):
            wrong = [t.device for t in _tensors_of(list(args) + list(kwargs.values())) if t.device != device]
            assert not wrong, f"torch.distributed.{name} got a tensor on {wrong[0]}, not the compute device {device}"
            seen.append(name)
            return fn(*args, **kwargs)
        return call
    try:
        for name, fn in originals.items():
            setattr(dist, name, checked(name, fn))
        yield seen
    finally:
        for name, fn in originals.items():
            setattr(dist, name, fn)


@contextlib.contextmanager
def host_factories_on_meta():
    """Tensors made without a device land on ``meta``: where a GPU run would hold them on
    the host, they now differ from the compute device (the CPU) and are caught."""
    previous = torch.get_default_device()
    torch.set_default_device("meta")
    try:
        yield
    finally:
        torch.set_default_device(previous)


def _guarded(fn):
    def call(*args, **kwargs):
        with host_factories_on_meta():
            return fn(*args, **kwargs)
    return call


# --------------------------------------------------------------------------- collectives

LAYER_CASES = {
    "allgather": dict(dispatcher="allgather"),
    "allgather-capacity": dict(dispatcher="allgather", capacity_factor=1.0),
    "alltoall": dict(dispatcher="alltoall"),
    "alltoall-pad": dict(dispatcher="alltoall", capacity_factor=1.0, pad_to_capacity=True),
    "alltoall-dedup": dict(dispatcher="alltoall", dedup=True),
}
# Every router loss on: each all-reduces its counts over tp x cp (global aux over tp x dp x cp).
LOSSES = dict(aux_loss_coeff=0.01, z_loss_coeff=0.001, seq_aux_loss_coeff=0.01, global_aux_loss_coeff=0.01)


def _layer_rank(rank, world_size):
    groups = create_process_groups(ParallelLayout(world_size, ep=2))
    names = {}
    for case, moe in LAYER_CASES.items():
        layer = MoELayer(_config(**moe, **LOSSES), groups, 0)
        x = _inputs(rank).requires_grad_()
        seen = []
        with collectives_on(torch.device("cpu"), seen), host_factories_on_meta():
            seq_ids = torch.arange(x.shape[0], device=x.device) % 2
            y = layer(x, seq_ids=seq_ids, num_seqs=2)
            (y * torch.linspace(-1, 1, H, device=x.device)).sum().backward()
        names[case] = sorted(set(seen))
    return names


def test_moe_layer_collectives_get_device_tensors():
    """ep 2 on two gloo ranks, forward and backward of the MoE layer under each dispatcher,
    every router loss on: no tensor built on the host reaches a collective (the all-gather
    dispatcher's token count did, before it was built on the device)."""
    for names in run_ranks(_layer_rank, 2, timeout=120):
        assert "all_gather_single" in names["allgather"], names
        assert "all_reduce" in names["allgather"], names
        assert "all_to_all_single" in names["alltoall"], names
        assert "all_to_all_single" in names["alltoall-dedup"], names


def _train_rank(rank, world_size, config):
    import moe_fold.training.train as train_module
    from moe_fold.training.metrics import RoutingCollector
    from moe_fold.training.replace import ExpertReplacer
    from moe_fold.training.step import forward_backward
    from moe_fold.training.step_losses import StepLosses
    from moe_fold.training.stop import StopRule

    # Everything a step runs, from the forward to the re-placement; not the model's
    # construction or the checkpoint (they build their own tensors on the host on purpose).
    train_module.reduce_gradients = _guarded(train_module.reduce_gradients)
    train_module.close_routers = _guarded(train_module.close_routers)
    for cls, name in ((StepLosses, "reduce"), (RoutingCollector, "reduce"), (ExpertReplacer, "after_step"),
                      (StopRule, "check")):
        setattr(cls, name, _guarded(getattr(cls, name)))
    seen = []
    with collectives_on(torch.device("cpu"), seen):
        result = train(config, progress=False, forward_backward=_guarded(forward_backward))
    return sorted(set(seen)), result.losses


TRAIN_LAYOUTS = {
    # the all-gather dispatcher over etp x ep, experts re-placed after every step
    "ep2-allgather-replace": (["parallel.ep=2", "moe.dispatcher=allgather", "moe.replace_every=1"],
                              {"all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single"}),
    "tp2-sp-ep2": (["parallel.tp=2", "parallel.sequence_parallel=true", "parallel.ep=2", "parallel.etp=1"],
                   {"all_reduce", "all_gather_single", "reduce_scatter_single", "all_to_all_single"}),
    "pp2": (["parallel.pp=2"], {"all_reduce", "batch_isend_irecv"}),
    "cp2": (["parallel.cp=2"], {"all_reduce", "batch_isend_irecv"}),
}


@pytest.mark.parametrize("layout", TRAIN_LAYOUTS)
def test_training_step_collectives_get_device_tensors(tmp_path, cache_dir, layout):
    """Two steps on two ranks: every collective of a step (the MoE dispatch, the tp/sp,
    pipeline and ring-attention exchanges, the grad sync, the norm, the routing statistics,
    the stop check, the expert re-placement's moves and byte total) gets device tensors."""
    settings, expected = TRAIN_LAYOUTS[layout]
    config = small_config(tmp_path, cache_dir, "train.steps=2", *settings)
    results = run_ranks(_train_rank, 2, config, timeout=300)
    for names, losses in results:
        assert expected <= set(names), names
        assert len(losses) == 2 and all(math.isfinite(v) for v in losses)
    if "moe.replace_every=1" in settings:
        assert any(r.get("replace_bytes") for r in read_metrics(tmp_path)), \
            "no expert was re-placed: the byte total's all-reduce did not run"


# --------------------------------------------------------------------------- autocast

GEMM_BACKENDS = ["loop", "torch", "triton",
                 pytest.param("grouped_gemm", marks=pytest.mark.skipif(
                     not torch.cuda.is_available(), reason="the grouped_gemm backend needs CUDA"))]


@pytest.mark.parametrize("backend", GEMM_BACKENDS)
@pytest.mark.parametrize("trans_b", [False, True])
def test_gmm_under_autocast_is_the_gemm_of_cast_operands(backend, trans_b):
    """Under bf16 autocast, gmm of float32 operands equals gmm of the operands cast to
    bf16 by hand, bit for bit (what F.linear does), and the grads keep the operands' dtype."""
    from moe_fold.kernels.gmm import gmm, grouped_mm

    device = "cuda" if backend == "grouped_gemm" else "cpu"
    gen = torch.Generator().manual_seed(0)
    counts = [5, 0, 9, 3]
    x = torch.randn(sum(counts), 16, generator=gen).to(device).requires_grad_()
    w = torch.randn(4, 8, 16, generator=gen).to(device) if trans_b else torch.randn(4, 16, 8, generator=gen).to(device)
    w.requires_grad_()
    with torch.autocast(device, dtype=torch.bfloat16):
        y = gmm(x, w, torch.tensor(counts), trans_b=trans_b, backend=backend)
    y.float().square().sum().backward()
    xb, wb = x.detach().bfloat16().requires_grad_(), w.detach().bfloat16().requires_grad_()
    want = gmm(xb, wb, torch.tensor(counts), trans_b=trans_b, backend=backend)
    want.float().square().sum().backward()
    assert y.dtype == torch.bfloat16
    torch.testing.assert_close(y, want, rtol=0, atol=0)
    assert x.grad.dtype == w.grad.dtype == torch.float32
    torch.testing.assert_close(x.grad, xb.grad.float(), rtol=0, atol=0)
    torch.testing.assert_close(w.grad, wb.grad.float(), rtol=0, atol=0)
    # The forward path (experts call grouped_mm with checked arguments) casts the same way.
    with torch.autocast(device, dtype=torch.bfloat16):
        direct = grouped_mm(x.detach(), w.detach(), torch.tensor(counts, device=device), counts, trans_b=trans_b,
                            backend=backend)
    torch.testing.assert_close(direct, want.detach(), rtol=0, atol=0)


def test_autocast_leaves_float64_alone():
    from moe_fold.kernels.gmm import gmm

    x, w = torch.randn(6, 4, dtype=torch.float64), torch.randn(2, 4, 3, dtype=torch.float64)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = gmm(x, w, [2, 4], backend="loop")
    assert y.dtype == torch.float64
    torch.testing.assert_close(y, torch.cat([x[:2] @ w[0], x[2:] @ w[1]]), rtol=0, atol=0)


_AUTOCAST_STEPS = ["train.steps=3", "optimizer.lr=3e-3"]


@pytest.fixture(scope="module")
def autocast_runs(tmp_path_factory, cache_dir):
    """Three steps of the small model: bf16 autocast per CPU GEMM backend, and the float32
    loop run (the float32 backends agree within 1e-6 here, tests/kernels/test_gmm.py)."""
    root = tmp_path_factory.mktemp("autocast")
    runs = {}
    for backend, precision in (("loop", "fp32"), ("loop", "bf16-autocast"), ("torch", "bf16-autocast"),
                               ("triton", "bf16-autocast")):
        cfg = small_config(root / f"{backend}-{precision}", cache_dir, *_AUTOCAST_STEPS,
                           f"moe.gemm_backend={backend}", f"train.precision={precision}")
        runs[backend, precision] = train(cfg, progress=False).losses
    return runs


@pytest.mark.slow  # 15 s on a quiet machine, 90 s on a loaded one (the Triton interpreter)
@pytest.mark.parametrize("backend", ["loop", "torch", "triton"])
def test_bf16_autocast_trains_on_every_gemm_backend(autocast_runs, backend):
    """bf16 autocast trains with each grouped GEMM backend (the loop backend crashed on
    mixed dtypes before): each step's loss within 0.005 of the float32 run (bf16 rounding
    of the matmul operands; measured gap 7e-4) and within 0.002 of the loop backend's
    bf16-autocast run (the same bf16 operands, accumulated in float32 in each backend's
    order; measured: torch equal, triton 5e-4)."""
    got = autocast_runs[backend, "bf16-autocast"]
    assert len(got) == 3 and got[-1] < got[0] - 0.3, got
    assert got == pytest.approx(autocast_runs["loop", "fp32"], abs=0.005)
    assert got == pytest.approx(autocast_runs["loop", "bf16-autocast"], abs=0.002)
