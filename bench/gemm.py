"""Grouped GEMM benchmark: the expert MLP GEMMs (fc1 and fc2, forward and backward) per backend.

    python bench/gemm.py [--tokens 2048 --hidden 256 --ffn 256 --experts 8 --topk 2
                          --backends auto,torch,loop --repeats 7 --routing balanced,skewed --bias]

Prints one JSON line per (backend, routing). The workload is the six GEMMs of a SwiGLU
expert MLP over ``tokens * topk`` routed rows: fc1 ``[E, H, 2F]`` and fc2 ``[E, F, H]``,
each forward, dx and dw. ``ratio_to_dense`` is the time of the same GEMMs done as plain
dense matmuls of the same total FLOPs (all rows against one weight), measured in the same
run, divided by the backend's time: 1.0 is the physical limit. Candidates are timed
interleaved, round after round, and medians are reported because the machine is noisy;
``ms_cpu`` / ``ratio_to_dense_cpu`` are the same from process CPU time, which a loaded
machine disturbs less. ``path`` names the op the ``torch`` backend ran (``bmm`` for equal
groups on CPU, else ``grouped_mm``; see kernels/gmm_torch.py), null for other backends.

``--bias`` also times every backend with per-expert biases on fc1 and fc2 (gpt-oss's
experts; their grads included) in the same rounds, and prints those lines with
``"bias": true`` and ``bias_overhead``, the biased time over the same backend's unbiased
time (CPU time in ``bias_overhead_cpu``).
"""

import argparse
import json
import os
import statistics
import time

# On a shared CPU with fewer free cores than threads, OpenMP threads that spin at a barrier
# starve the thread they wait for, so each parallel region can cost a scheduler slice. A
# grouped GEMM opens E regions per op where the dense matmul opens one, so with spinning
# threads this benchmark would measure the machine's load, not the kernels (measured here:
# ratio_to_dense 0.37 spinning vs 0.97 passive, same run conditions otherwise). Set it
# before torch starts OpenMP; an OMP_WAIT_POLICY already in the environment wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402

from moe_fold.kernels.gmm import available_backends, gmm, resolve_backend  # noqa: E402
from moe_fold.kernels.gmm_torch import torch_path  # noqa: E402


def routing_counts(rows: int, experts: int, routing: str) -> list[int]:
    """Rows per expert: equal shares, or Zipf-like shares (expert e gets ~ 1/(e+1))."""
    if routing == "balanced":
        weights = [1.0] * experts
    elif routing == "skewed":
        weights = [1.0 / (e + 1) for e in range(experts)]
    else:
        raise ValueError(f"--routing {routing!r}: allowed balanced, skewed")
    total = sum(weights)
    counts = [int(rows * wt / total) for wt in weights]
    counts[0] += rows - sum(counts)
    return counts


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def make_step(backend, counts, x, h, w1, w2, g1, g2, b1=None, b2=None):
    """One forward + backward of fc1 and fc2; ``backend`` None is the dense reference;
    ``b1 [E, 2F]``, ``b2 [E, H]``: per-expert biases (their grads are computed too).

    autograd.grad returns the gradients instead of accumulating them into ``.grad``, so
    only the GEMMs (and the backend's own overhead) are timed."""
    if backend is None:
        w1d, w2d = w1[0].detach().requires_grad_(), w2[0].detach().requires_grad_()

        def step():
            y1 = x @ w1d  # [rows, H] -> [rows, 2F]
            y2 = h @ w2d  # [rows, F] -> [rows, H]
            torch.autograd.grad([y1, y2], [x, h, w1d, w2d], [g1, g2])

    else:

        wrt = [x, h, w1, w2] + ([b1, b2] if b1 is not None else [])

        def step():
            y1 = gmm(x, w1, counts, backend=backend, bias=b1)  # [rows, H] -> [rows, 2F]
            y2 = gmm(h, w2, counts, backend=backend, bias=b2)  # [rows, F] -> [rows, H]
            torch.autograd.grad([y1, y2], wrt, [g1, g2])

    return step


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--ffn", type=int, default=256)
    p.add_argument("--experts", type=int, default=8)
    p.add_argument("--topk", type=int, default=2)
    p.add_argument("--backends", default=None, help="comma list; default: every available backend")
    p.add_argument("--repeats", type=int, default=7, help="interleaved timing rounds (median reported)")
    p.add_argument("--routing", default="balanced,skewed", help="balanced, skewed or both (comma list)")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16", "float16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--threads", type=int, default=2)
    p.add_argument("--bias", action="store_true", help="also time each backend with per-expert biases")
    args = p.parse_args(argv)

    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    backends = args.backends.split(",") if args.backends else available_backends(device)
    rows, e, hd, f = args.tokens * args.topk, args.experts, args.hidden, args.ffn
    flops = 3 * 2 * rows * (hd * 2 * f + f * hd)  # forward, dx, dw of fc1 and fc2

    gen = torch.Generator().manual_seed(0)

    def rand(*shape, grad=False):
        t = torch.randn(*shape, generator=gen).to(device=device, dtype=dtype)
        return t.requires_grad_(grad)

    x, h = rand(rows, hd, grad=True), rand(rows, f, grad=True)
    w1, w2 = rand(e, hd, 2 * f, grad=True), rand(e, f, hd, grad=True)
    g1, g2 = rand(rows, 2 * f), rand(rows, hd)
    b1, b2 = rand(e, 2 * f, grad=True), rand(e, hd, grad=True)

    for routing in args.routing.split(","):
        counts = routing_counts(rows, e, routing)
        steps = {"dense": make_step(None, counts, x, h, w1, w2, g1, g2)}
        steps.update({b: make_step(b, counts, x, h, w1, w2, g1, g2) for b in backends})
        if args.bias:
            steps.update({f"{b}+bias": make_step(b, counts, x, h, w1, w2, g1, g2, b1, b2) for b in backends})
        times = {name: [] for name in steps}
        cpu_times = {name: [] for name in steps}
        for name, step in steps.items():  # warm-up: caches, allocator, Triton compilation
            step()
        for _ in range(args.repeats):
            for name, step in steps.items():
                _sync(device)
                t0, c0 = time.perf_counter(), time.process_time()
                step()
                _sync(device)
                times[name].append(time.perf_counter() - t0)
                cpu_times[name].append(time.process_time() - c0)
        ms_dense = statistics.median(times["dense"]) * 1e3
        cpu_ms_dense = statistics.median(cpu_times["dense"]) * 1e3
        for b, biased in [(b, biased) for b in backends for biased in ([False, True] if args.bias else [False])]:
            name = f"{b}+bias" if biased else b
            ms = statistics.median(times[name]) * 1e3
            cpu_ms = statistics.median(cpu_times[name]) * 1e3
            resolved = resolve_backend(b, x)
            extra = {}
            if biased:
                extra = {"bias_overhead": round(ms / (statistics.median(times[b]) * 1e3), 3),
                         "bias_overhead_cpu": round(cpu_ms / (statistics.median(cpu_times[b]) * 1e3), 3)}
            print(json.dumps({
                "bench": "gemm",
                "backend": b,
                "bias": biased,
                "resolved": resolved,
                "path": torch_path(x, counts) if resolved == "torch" else None,
                "routing": routing,
                "device": str(device),
                "dtype": args.dtype,
                "threads": args.threads,
                "omp_wait_policy": os.environ["OMP_WAIT_POLICY"],
                "tokens": args.tokens,
                "topk": args.topk,
                "experts": e,
                "hidden": hd,
                "ffn": f,
                "tokens_per_expert_mean": rows / e,
                "tokens_per_expert_min": min(counts),
                "tokens_per_expert_max": max(counts),
                "ms": round(ms, 3),
                "gflops": round(flops / ms / 1e6, 2),
                "ms_dense": round(ms_dense, 3),
                "gflops_dense": round(flops / ms_dense / 1e6, 2),
                "ratio_to_dense": round(ms_dense / ms, 3),
                "ms_cpu": round(cpu_ms, 3),
                "ms_dense_cpu": round(cpu_ms_dense, 3),
                "ratio_to_dense_cpu": round(cpu_ms_dense / cpu_ms, 3),
                "rounds": args.repeats,
                **extra,
            }), flush=True)


if __name__ == "__main__":
    main()
