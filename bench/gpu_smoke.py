"""The GPU proof in one command: the gpu tests, the kernel benches and one MoE layer on
the GPU, summed up in one table (docs/gpu.md says what each row means).

    python -m bench.gpu_smoke [--shapes 8192x2048x1024x8x2,8192x2048x512x64x8] [--rounds 7]
                              [--skip-tests] [--skip-benches]

Rows: the device; torch, triton, CUDA and driver versions; the backend each kernel's
``auto`` resolves to for bfloat16 and float32 inputs (``resolve_backend`` of each module
of :data:`BACKEND_MODULES`); pass/fail of each group of gpu tests (``pytest -m gpu``, run
compiled in a process of their own: tests/helpers/gpu_support.py); bench/gemm.py and
bench/permute.py on the GPU in bfloat16; and per MoE layer shape (``tokens x hidden x
ffn x experts x topk``, bfloat16, :func:`bench.moe_layer.build_ours`): the host
synchronisations of one forward and of its backward, counted by
``torch.cuda.set_sync_debug_mode`` (each CUDA call that blocks the host), and the ms of
forward + backward against the same expert GEMMs done by ``torch._grouped_mm`` on equal
groups (``dense``: the grouped GEMM FLOPs with no routing, permutation or imbalance),
``overhead_vs_dense`` = ours / dense; compiled blocks (``train.compile=blocks``) of
mixtral-tiny against eager (:func:`compiled_block_rows`); and the first shape's MoE layer,
padded to static shapes, captured forward and backward in one CUDA graph and replayed
against eager (:func:`cuda_graph_rows`). Times are CUDA-event medians over ``--rounds``.

Exit code: 0 every test passed and every compiled or replayed row equalled eager, 1 one
did not (the table is printed all the same), 2 no CUDA device: nothing is run, and the
reason is printed.
"""

from __future__ import annotations

import argparse
import importlib
import json
import os
import platform
import statistics
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path
from typing import Callable, Optional

ROOT = Path(__file__).resolve().parents[1]

from tests.helpers import gpu_support  # noqa: E402
import torch  # noqa: E402

# Kernel -> the module whose resolve_backend(backend, x) says what "auto" runs.
BACKEND_MODULES = {
    "gemm": "moe_fold.kernels.gmm",
    "swiglu": "moe_fold.kernels.swiglu",
    "permute": "moe_fold.kernels.permute",
    "router top-k": "moe_fold.kernels.topk",
}
DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def no_cuda_reason() -> Optional[str]:
    """Why nothing can run here (None: a GPU is visible)."""
    count = torch.cuda.device_count() if torch.cuda.is_available() else 0
    return gpu_support.cuda_missing_reason(torch.__version__, torch.version.cuda, count)


# --------------------------------------------------------------------------- rows

def device_rows() -> list[tuple[str, str]]:
    props = torch.cuda.get_device_properties(0)
    return [("device", f"{props.name}, sm{props.major}{props.minor}, {props.total_memory / 2**30:.1f} GiB, "
                       f"{torch.cuda.device_count()} visible; host {platform.node()}")]


def _driver_version() -> str:
    try:
        out = subprocess.run(["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                             capture_output=True, text=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired) as e:
        return f"unknown ({type(e).__name__}: nvidia-smi)"
    return out.stdout.strip().splitlines()[0] if out.returncode == 0 and out.stdout.strip() else "unknown"


def version_rows() -> list[tuple[str, str]]:
    import triton

    return [("versions", f"torch {torch.__version__}, triton {triton.__version__}, CUDA {torch.version.cuda}, "
                         f"driver {_driver_version()}, python {platform.python_version()}")]


def backend_rows() -> list[tuple[str, str]]:
    rows = []
    for kernel, name in BACKEND_MODULES.items():
        resolve = importlib.import_module(name).resolve_backend
        picks = []
        for label, dtype in DTYPES.items():
            x = torch.zeros(64, 128, device="cuda", dtype=dtype)
            try:
                picks.append(f"{label} -> {resolve('auto', x)}")
            except Exception as e:  # noqa: BLE001 - the row reports it
                picks.append(f"{label} -> error {type(e).__name__}: {e}")
        rows.append((f"auto backend: {kernel}", ", ".join(picks)))
    return rows


def group_outcomes(outcomes: dict) -> dict[str, dict[str, int]]:
    """``{nodeid: {"outcome": ...}}`` -> ``{"file::test": {"passed": n, "failed": n, "skipped": n}}``
    (the parameter sets of one test function are one group)."""
    groups: dict[str, dict[str, int]] = {}
    for nodeid, got in sorted(outcomes.items()):
        path, _, name = nodeid.partition("::")
        key = f"{Path(path).stem}::{name.split('[')[0]}"
        counts = groups.setdefault(key, {"passed": 0, "failed": 0, "skipped": 0})
        counts[got["outcome"]] += 1
    return groups


def test_rows() -> tuple[list[tuple[str, str]], bool, str]:
    """One row per group of gpu tests; whether all ran and passed; pytest's output."""
    with tempfile.TemporaryDirectory(prefix="moe-fold-gpu-smoke-") as tmp:
        report = Path(tmp) / "report.json"
        env = {**gpu_support.host_environ(dict(os.environ)), gpu_support.REPORT_ENV: str(report)}
        proc = subprocess.run([sys.executable, "-m", "pytest", "tests", "-m", "gpu", "-q", "-rs",
                               "-p", "no:cacheprovider"], cwd=ROOT, env=env, capture_output=True, text=True,
                              timeout=3600)
        outcomes = json.loads(report.read_text()) if report.is_file() else {}
    output = proc.stdout + proc.stderr
    if not outcomes:
        return [("tests", f"FAIL: pytest reported nothing (exit {proc.returncode})")], False, output
    rows = []
    for group, c in group_outcomes(outcomes).items():
        total = sum(c.values())
        verdict = "FAIL" if c["failed"] else ("PASS" if c["passed"] else "SKIP")
        rows.append((f"tests {group}", f"{verdict} {c['passed']}/{total} passed"
                                       + (f", {c['failed']} failed" if c["failed"] else "")
                                       + (f", {c['skipped']} skipped" if c["skipped"] else "")))
    ok = proc.returncode == 0 and all(c["failed"] == 0 for c in group_outcomes(outcomes).values())
    return rows, ok, output


def _bench_lines(script: str, args: list[str]) -> list[dict]:
    proc = subprocess.run([sys.executable, "-m", f"bench.{script.removesuffix('.py')}", *args], cwd=ROOT,
                          env={k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"},
                          capture_output=True, text=True, timeout=1800)
    if proc.returncode != 0:
        raise RuntimeError(f"bench/{script} failed (exit {proc.returncode}): {proc.stderr[-2000:]}")
    return [json.loads(line) for line in proc.stdout.splitlines() if line.startswith("{")]


def _grouped_rows(name: str, args: list[str], field: str, cell: Callable[[dict], str]) -> list[tuple[str, str]]:
    """bench/<name>.py's records on the GPU in bfloat16, one row per value of ``field`` (in
    the order the bench prints them), its records' ``cell`` joined; one FAIL row if it fails."""
    try:
        records = _bench_lines(f"{name}.py", ["--device", "cuda", "--dtype", "bfloat16", *args])
        if not records:
            raise RuntimeError(f"bench/{name}.py printed no records")
        values = list(dict.fromkeys(r[field] for r in records))
        return [(f"bench {name} bf16 {v}", "; ".join(cell(r) for r in records if r[field] == v)) for v in values]
    except (RuntimeError, KeyError, subprocess.TimeoutExpired) as e:
        return [(f"bench {name}", f"FAIL: {e}")]


def kernel_bench_rows() -> list[tuple[str, str]]:
    gemm = _grouped_rows("gemm", ["--tokens", "8192", "--hidden", "2048", "--ffn", "1024", "--experts", "8",
                                  "--topk", "2"], "routing",
                         lambda r: f"{r['backend']}->{r['resolved']} {r['ms']:.3f} ms ratio_to_dense "
                                   f"{r['ratio_to_dense']:.2f}")
    permute = _grouped_rows("permute", ["--backends", "torch,triton"], "pass",
                            lambda r: f"{r['backend']} {r['ms']:.3f} ms ({r['ratio_to_copy']:.2f}x copy)")
    return gemm + permute


def count_host_syncs(fn: Callable[[], object]) -> int:
    """CUDA calls that block the host during ``fn()`` (torch.cuda.set_sync_debug_mode)."""
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            fn()
        finally:
            torch.cuda.set_sync_debug_mode("default")
    return sum("synchronizing CUDA operation" in str(w.message) for w in caught)


def cuda_ms(fn: Callable[[], object], rounds: int, iters: int = 3) -> float:
    """Median over ``rounds`` of the mean CUDA-event time of ``iters`` calls, in ms."""
    fn()  # warm-up: compilation, allocator, autotuning
    samples = []
    for _ in range(rounds):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        for _ in range(iters):
            fn()
        end.record()
        end.synchronize()
        samples.append(start.elapsed_time(end) / iters)
    return statistics.median(samples)


def _grouped_mm_dense_step(shape: dict) -> Callable[[], object]:
    """fc1 -> SwiGLU -> fc2 and its backward by torch._grouped_mm on ``tokens * topk`` rows in
    equal groups: the expert GEMMs' FLOPs with no routing, permutation or imbalance."""
    e, h, f = shape["experts"], shape["hidden"], shape["ffn"]
    rows = shape["tokens"] * shape["topk"] // e * e
    gen = torch.Generator().manual_seed(2)
    x = torch.randn(rows, h, generator=gen).to("cuda", torch.bfloat16).requires_grad_()
    w1 = (torch.randn(e, h, 2 * f, generator=gen) * 0.02).to("cuda", torch.bfloat16).requires_grad_()
    w2 = (torch.randn(e, f, h, generator=gen) * 0.02).to("cuda", torch.bfloat16).requires_grad_()
    grad = torch.randn(rows, h, generator=gen).to("cuda", torch.bfloat16)
    offs = torch.arange(1, e + 1, device="cuda", dtype=torch.int32) * (rows // e)

    def step():
        gate, up = torch._grouped_mm(x, w1, offs=offs).chunk(2, dim=-1)  # [rows, H] -> [rows, F] each
        y = torch._grouped_mm(torch.nn.functional.silu(gate) * up, w2, offs=offs)  # [rows, H]
        return torch.autograd.grad(y, [x, w1, w2], grad)

    return step


def moe_layer_rows(shapes: list[dict], rounds: int) -> list[tuple[str, str]]:
    from bench.moe_layer import build_ours

    rows = []
    for shape in shapes:
        name = "x".join(str(shape[k]) for k in ("tokens", "hidden", "ffn", "experts", "topk"))
        layer = build_ours(shape).to("cuda", torch.bfloat16)
        gen = torch.Generator().manual_seed(1)
        x = torch.randn(shape["tokens"], shape["hidden"], generator=gen).to("cuda", torch.bfloat16)
        x.requires_grad_()
        grad = torch.randn(shape["tokens"], shape["hidden"], generator=gen).to("cuda", torch.bfloat16)
        params = [x, *layer.parameters()]

        def step():
            return torch.autograd.grad(layer(x), params, grad)

        step()  # warm-up: first-call syncs (compilation, caches) are not the layer's
        held = {}
        forward = count_host_syncs(lambda: held.setdefault("out", layer(x)))
        backward = count_host_syncs(lambda: torch.autograd.grad(held["out"], params, grad))
        rows.append((f"host syncs / MoE layer {name}", f"forward {forward}, backward {backward}"))
        ours, dense = cuda_ms(step, rounds), cuda_ms(_grouped_mm_dense_step(shape), rounds)
        rows.append((f"ms / MoE layer {name} bf16 fwd+bwd",
                     f"ours {ours:.3f}, torch._grouped_mm dense {dense:.3f}, overhead_vs_dense {ours / dense:.2f}"))
    return rows


# The tolerances for compiled against eager: relative to the largest magnitude.
COMPILE_TOL = {torch.float32: 1e-5, torch.bfloat16: 2e-2}


def _worst(got: list[torch.Tensor], want: list[torch.Tensor]) -> float:
    """The largest difference over the tensors, each relative to its largest magnitude."""
    return max(float((g.float() - w.float()).abs().max()) / max(float(w.float().abs().max()), 1e-6)
               for g, w in zip(got, want))


def _model_step(model, batch: dict) -> list[torch.Tensor]:
    """The loss of one forward + backward of ``model`` on ``batch``, then every gradient
    (taken and cleared)."""
    loss = model(**batch)
    loss.backward()
    grads = [p.grad.clone() for p in model.parameters() if p.grad is not None]
    model.zero_grad(set_to_none=True)
    return [loss.detach(), *grads]


def compiled_block_rows(rounds: int) -> tuple[list[tuple[str, str]], bool]:
    """``train.compile=blocks`` on CUDA (:func:`moe_fold.models.model.compile_blocks`: every
    block ``fullgraph=True``, Inductor): mixtral-tiny's forward + backward, dropless and padded
    MoE, in float32 and bfloat16. The loss and every gradient against an eager build of the
    same weights, within the issue's tolerances; the first compiled call's seconds; ms of
    eager and compiled. Returns the rows and whether every one held."""
    rows, ok = [], True
    routings = {"dropless": [], "padded": ["moe.capacity_factor=1.0", "moe.pad_to_capacity=true"]}
    for routing, extra in routings.items():
        for label, dtype in DTYPES.items():
            try:
                cells, held = _compiled_blocks(extra, dtype, rounds)
            except Exception as e:  # noqa: BLE001 - the row reports it
                cells, held = f"FAIL {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", False
            ok &= held
            rows.append((f"compiled blocks mixtral-tiny {routing} {label} fwd+bwd", cells))
    return rows, ok


def _compiled_blocks(extra: list[str], dtype: torch.dtype, rounds: int) -> tuple[str, bool]:
    import torch._dynamo as dynamo

    from moe_fold.config import load_config
    from moe_fold.kernels.backends import resolve_config
    from moe_fold.layout import ProcessGroups
    from moe_fold.models.model import build_model, compile_blocks

    config = resolve_config(load_config("mixtral-tiny", ["model.seq_length=128", *extra]), torch.device("cuda"))
    # Two builds of one config: every parameter is drawn from its own seed, so the same weights.
    eager = build_model(config, ProcessGroups.single_process()).to("cuda", dtype)
    compiled = build_model(config, ProcessGroups.single_process()).to("cuda", dtype)
    gen = torch.Generator().manual_seed(3)
    B, S = 4, config.model.seq_length
    tokens = torch.randint(0, config.model.vocab_size, (B, S + 1), generator=gen).cuda()
    batch = dict(input_ids=tokens[:, :-1], labels=tokens[:, 1:], positions=torch.arange(S, device="cuda").expand(B, S),
                 loss_mask=torch.ones(B, S, device="cuda"), num_loss_tokens=float(B * S))
    want = _model_step(eager, batch)
    dynamo.reset()
    # The dropless layer's per-expert counts trace as unbacked sizes (as train() runs it).
    with dynamo.config.patch(capture_scalar_outputs=True):
        compile_blocks(compiled)
        torch.cuda.synchronize()
        began = time.perf_counter()
        got = _model_step(compiled, batch)
        torch.cuda.synchronize()
        compile_s = time.perf_counter() - began
        worst = _worst(got, want)
        held = len(got) == len(want) and worst <= COMPILE_TOL[dtype]
        eager_ms = cuda_ms(lambda: _model_step(eager, batch), rounds)
        compiled_ms = cuda_ms(lambda: _model_step(compiled, batch), rounds)
    return (f"{'PASS' if held else 'FAIL'} worst relative difference {worst:.2e} over the loss and "
            f"{len(want) - 1} grads (tolerance {COMPILE_TOL[dtype]:g}); first call {compile_s:.1f} s; "
            f"eager {eager_ms:.3f} ms, compiled {compiled_ms:.3f} ms, ratio {compiled_ms / eager_ms:.2f}"), held


def cuda_graph_rows(shape: dict, rounds: int) -> tuple[list[tuple[str, str]], bool]:
    """One padded MoE layer step (``moe.pad_to_capacity``: static shapes, no host sync)
    captured whole in one CUDA graph, forward and backward, and replayed on a new input:
    its output and every gradient against eager on that input (bfloat16's default
    tolerances of ``torch.testing.assert_close``), the host syncs of a replay, ms of eager
    and of a replay (:func:`_graphed_layer_step`). Returns the row and whether the replay
    equalled eager."""
    name = "x".join(str(shape[k]) for k in ("tokens", "hidden", "ffn", "experts", "topk"))
    row = f"cuda graph / padded MoE layer {name} bf16 fwd+bwd"
    try:
        cells, held = _graphed_layer_step(shape, rounds)
    except Exception as e:  # noqa: BLE001 - the row reports it (a capture that meets a sync raises)
        cells, held = f"FAIL {type(e).__name__}: {str(e).splitlines()[0] if str(e) else ''}", False
    return [(row, cells)], held


def _graphed_layer_step(shape: dict, rounds: int) -> tuple[str, bool]:
    """The capture as torch.cuda.graphs' whole-network example does it: warm-up on a side
    stream, grads set to None before the capture so that the graph allocates and owns them,
    and static buffers for the input (a replay reads ``static_x``: new data is copied in)."""
    from bench.moe_layer import build_ours

    layer = build_ours(shape, capacity_factor=1.0, pad_to_capacity=True).to("cuda", torch.bfloat16)
    gen = torch.Generator().manual_seed(4)
    captured_x, fresh_x, grad = (torch.randn(shape["tokens"], shape["hidden"], generator=gen).to("cuda", torch.bfloat16)
                                 for _ in range(3))
    params = list(layer.parameters())
    static_x = captured_x.clone().requires_grad_()

    def step():
        layer(static_x).backward(grad)

    def taken(out: torch.Tensor) -> list[torch.Tensor]:
        return [out.detach().clone(), static_x.grad.clone(), *(p.grad.clone() for p in params if p.grad is not None)]

    def cleared():
        layer.zero_grad(set_to_none=True)
        static_x.grad = None

    # Eager on the new input first, grads from None, as the graph makes them.
    with torch.no_grad():
        static_x.copy_(fresh_x)
    cleared()
    out = layer(static_x)
    out.backward(grad)
    want = taken(out)
    eager_ms = cuda_ms(lambda: (cleared(), step()), rounds)
    # Warm-up on a side stream: lazy initialisation, workspaces and autotuning happen
    # outside the capture.
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(3):
            cleared()
            step()
    torch.cuda.current_stream().wait_stream(side)
    with torch.no_grad():
        static_x.copy_(captured_x)
    cleared()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_out = layer(static_x)
        static_out.backward(grad)
    with torch.no_grad():
        static_x.copy_(fresh_x)  # replays read the static buffer: new data goes into it
    graph.replay()
    torch.cuda.synchronize()
    got = taken(static_out)
    try:
        for a, b in zip(got, want, strict=True):
            torch.testing.assert_close(a, b)
        verdict = "PASS"
    except AssertionError as e:
        verdict = f"FAIL {str(e).splitlines()[0]}"
    syncs = count_host_syncs(graph.replay)
    replay_ms = cuda_ms(graph.replay, rounds)
    bitwise = all(torch.equal(a, b) for a, b in zip(got, want))
    return (f"{verdict}: replay {'equals eager bit for bit' if bitwise else 'within tolerance of eager'} "
            f"(output, input grad, {len(params)} weight grads); host syncs per replay {syncs}; "
            f"eager {eager_ms:.3f} ms, replay {replay_ms:.3f} ms"), verdict == "PASS"


def render(rows: list[tuple[str, str]]) -> str:
    width = max(len(k) for k, _ in rows)
    lines = [f"| {'row'.ljust(width)} | result |", f"|{'-' * (width + 2)}|--------|"]
    lines += [f"| {k.ljust(width)} | {v} |" for k, v in rows]
    return "\n".join(lines)


def main(argv: Optional[list[str]] = None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--shapes", default="8192x2048x1024x8x2,8192x2048x512x64x8",
                   help="MoE layer shapes, tokens x hidden x ffn x experts x topk (comma list)")
    p.add_argument("--rounds", type=int, default=7, help="timing rounds (median reported)")
    p.add_argument("--skip-tests", action="store_true", help="no gpu tests (benches only)")
    p.add_argument("--skip-benches", action="store_true", help="no kernel benches (tests and MoE layer only)")
    args = p.parse_args(argv)
    # The kernels must compile: Triton reads this when they are defined (imported below).
    os.environ.pop("TRITON_INTERPRET", None)
    reason = no_cuda_reason()
    if reason is not None:
        print(f"gpu_smoke: no CUDA device here, nothing was run: {reason}", file=sys.stderr)
        return 2
    from bench.moe_layer import parse_shape

    shapes = [parse_shape(s) for s in args.shapes.split(",")]
    rows = device_rows() + version_rows() + backend_rows()
    ok, output = True, ""
    if not args.skip_tests:
        test_table, ok, output = test_rows()
        rows += test_table
    if not args.skip_benches:
        rows += kernel_bench_rows()
    rows += moe_layer_rows(shapes, args.rounds)
    compiled, compiled_ok = compiled_block_rows(args.rounds)
    graphed, graphed_ok = cuda_graph_rows(shapes[0], args.rounds)
    rows += compiled + graphed
    print(render(rows))
    if not ok:
        print(f"\ngpu tests failed; pytest's output ends with:\n{output[-6000:]}", file=sys.stderr)
    return 0 if ok and compiled_ok and graphed_ok else 1


if __name__ == "__main__":
    sys.exit(main())
