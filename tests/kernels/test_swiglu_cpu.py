"""The C SwiGLU backend for CPUs (kernels/swiglu_cpu.py): float32 against float64 at size over
1 to 3 threads, strided rows and an expanded grad, NaN and inf kept, one build into the cache,
what it cannot run refused, and its thread pool in a forked child."""

import math

import pytest
import torch

from moe_fold.kernels.swiglu import swiglu

from tests.kernels.test_swiglu import _torch_reference


@pytest.mark.parametrize("threads", [1, 2, 3])
def test_cpu_backend_float32_matches_float64_at_size(threads):
    """Rows split over threads (3 does not divide the rows), F not a multiple of the
    vector width, gate values over exp's whole finite range."""
    g = torch.Generator().manual_seed(3)
    x = torch.randn(1001, 2 * 77, generator=g) * 8
    x[0, :77] = torch.linspace(-120, 120, 77)
    p = torch.rand(1001, generator=g)
    upstream = torch.randn(1001, 77, generator=g)
    before = torch.get_num_threads()
    torch.set_num_threads(threads)
    try:
        xc, pc = x.clone().requires_grad_(), p.clone().requires_grad_()
        out = swiglu(xc, pc, backend="cpu")
        out.backward(upstream)
    finally:
        torch.set_num_threads(before)
    ref_out, ref_x, ref_p = _torch_reference(x, p, upstream)
    for got, ref in ((out, ref_out), (xc.grad, ref_x), (pc.grad, ref_p)):
        assert got.dtype == torch.float32
        torch.testing.assert_close(got.double(), ref, rtol=1e-5, atol=1e-5 * ref.abs().max().item())


def test_cpu_backend_strided_rows_and_expanded_grad():
    """x a column slice of a wider tensor (row stride > 2F); the grad of a .sum() (strides 0)."""
    g = torch.Generator().manual_seed(4)
    wide = torch.randn(50, 40, generator=g)
    x = wide[:, 4:36].clone().requires_grad_()
    strided = wide[:, 4:36].requires_grad_(False)
    torch.testing.assert_close(swiglu(strided, backend="cpu"), swiglu(strided, backend="torch"))
    swiglu(x, backend="cpu").sum().backward()
    xr = wide[:, 4:36].clone().requires_grad_()
    swiglu(xr, backend="torch").sum().backward()
    torch.testing.assert_close(x.grad, xr.grad)


def test_cpu_backend_keeps_nan_and_inf():
    """A NaN or an infinity in stays non-finite out (exp's clamp must not hide it), so the
    training loop's non-finite checks still see it; finite neighbours are untouched."""
    x = torch.tensor([[float("nan"), 1.0, 2.0, 3.0], [float("inf"), float("-inf"), 1.0, 1.0]])
    out = swiglu(x, backend="cpu")
    assert torch.isnan(out[0, 0]) and out[0, 1].item() == pytest.approx(1.0 / (1 + math.exp(-1.0)) * 3.0)
    assert out[1, 0].item() == float("inf") and not torch.isfinite(out[1, 1])


def test_cpu_backend_builds_once_into_the_cache(monkeypatch, tmp_path):
    from moe_fold.kernels import swiglu_cpu

    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    swiglu_cpu._library.cache_clear()
    try:
        swiglu(torch.randn(2, 4), backend="cpu")
        (built,) = (tmp_path / "moe_fold").iterdir()
        assert built.name.startswith("swiglu_cpu-") and built.suffix == ".so"
        stamp = built.stat().st_mtime_ns
        swiglu_cpu._library.cache_clear()
        swiglu(torch.randn(2, 4), backend="cpu")
        assert [p.name for p in (tmp_path / "moe_fold").iterdir()] == [built.name] and built.stat().st_mtime_ns == stamp
    finally:
        swiglu_cpu._library.cache_clear()


def test_cpu_backend_rejects_what_it_cannot_run():
    with pytest.raises(TypeError, match="float32, float64, bfloat16 or float16, got torch.int32"):
        swiglu(torch.ones(2, 4, dtype=torch.int32), backend="cpu")


def test_cpu_backend_thread_pool_works_in_a_forked_child():
    """A forked child has none of its parent's pool threads: it must start its own pool
    rather than wait forever on the parent's. The child runs only the row split with a
    Python kernel (no torch op: OpenMP itself is not fork-safe once the parent used it),
    and is killed if it does not finish, so a regression fails instead of hanging."""
    import os
    import time

    from moe_fold.kernels import swiglu_cpu

    before = torch.get_num_threads()
    torch.set_num_threads(2)
    try:
        swiglu(torch.randn(512, 2 * 256), backend="cpu")  # the parent's pool now exists
        assert swiglu_cpu._pool is not None
        pid = os.fork()
        if pid == 0:  # the child: exit 0 only if both halves of the rows ran
            ranges = []
            swiglu_cpu._run_rows(lambda r0, r1: ranges.append((r0, r1)), rows=8, elements=1 << 20)
            os._exit(0 if sorted(ranges) == [(0, 4), (4, 8)] else 1)
        deadline = time.monotonic() + 30
        while True:
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                break
            if time.monotonic() > deadline:
                os.kill(pid, 9)
                os.waitpid(pid, 0)
                pytest.fail("the forked child hung on the parent's thread pool")
            time.sleep(0.05)
    finally:
        torch.set_num_threads(before)
    assert os.waitstatus_to_exitcode(status) == 0
