"""Batch dependence on the CPU: how much a sequence's routes and logits, and a row's
result in each kernel, change with the other rows computed beside it.

    python -m bench.batch_invariance [--preset mixtral-tiny] [--threads N] [--rows 1024] [--rounds 5]

Output:

- one JSON line per kernel (``mm``/``linear`` at several hidden sizes, the expert
  grouped GEMM of each CPU backend, RMSNorm, softmax, SDPA): the row counts ``M`` in
  ``1..--rows`` whose first rows differ from the same rows computed among ``--rows``,
  and the largest absolute difference;
- one JSON line per GEMM backend (``moe.gemm_backend``) of the preset's model (one
  process, float32): sequence 0 alone and among 1, 3 and 7 others, the largest logit
  difference and whether its routes (every MoE layer's expert set per token) are equal,
  with ``train.batch_invariant`` off and on;
- the cost of the mode: one training forward and backward of a micro-batch of the preset,
  mode on against off, interleaved over ``--rounds`` rounds, medians of wall and process
  CPU time (``overhead``: on / off - 1).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moe_fold.config import load_config  # noqa: E402
from moe_fold.layout import ProcessGroups  # noqa: E402
from tests.helpers.router_outputs import first_sequence_outputs  # noqa: E402


def rows_dependence(name: str, fn, x: torch.Tensor, sizes) -> dict:
    """``fn(x[:M])[:M]`` against ``fn(x)[:M]`` for each M."""
    ref = fn(x)
    bad, worst = [], 0.0
    for m in sizes:
        got = fn(x[:m])
        if not torch.equal(got, ref[:m]):
            bad.append(m)
            worst = max(worst, (got - ref[:m]).abs().max().item())
    return {"bench": "batch_invariance", "kernel": name, "rows": x.shape[0], "differing_M": bad[:16],
            "num_differing_M": len(bad), "max_abs_diff": worst}


def kernels(rows: int) -> list[dict]:
    from moe_fold.kernels.gmm import available_backends, gmm
    from moe_fold.models.norm import RMSNorm

    g = torch.Generator().manual_seed(0)
    sizes = list(range(1, 65)) + [96, 128, 255, 256, rows // 2]
    out = []
    for k, n in ((64, 128), (128, 264), (128, 8)):
        x, w = torch.randn(rows, k, generator=g), torch.randn(n, k, generator=g)
        out.append(rows_dependence(f"linear[{k}x{n}]", lambda t: F.linear(t, w), x, sizes))
    norm = RMSNorm(128, 1e-5, "replicated")
    x = torch.randn(rows, 128, generator=g)
    with torch.no_grad():
        out.append(rows_dependence("rmsnorm[128]", norm, x, sizes))
    out.append(rows_dependence("softmax[264]", lambda t: torch.softmax(t, -1), torch.randn(rows, 264, generator=g),
                               sizes))
    q = torch.randn(16, 4, 32, 32, generator=g)
    out.append(rows_dependence("sdpa[b,4h,32x32]", lambda t: F.scaled_dot_product_attention(t, t, t, is_causal=True),
                               q, range(1, 16)))
    # The experts' grouped GEMM: expert 0's rows first, then a growing number of rows of
    # the other experts (what other sequences add).
    w = torch.randn(8, 128, 64, generator=g)
    x = torch.randn(rows, 128, generator=g)
    for backend in [b for b in available_backends("cpu") if b != "auto"]:
        def grouped(t, backend=backend):
            counts = torch.zeros(8, dtype=torch.int64)
            counts[0] = min(32, t.shape[0])
            rest = t.shape[0] - counts[0]
            counts[1:] = rest // 7
            counts[1] += rest - counts[1:].sum()
            return gmm(t, w, counts, backend=backend)[:counts[0]]

        ref = grouped(x)
        bad, worst = [], 0.0
        for m in range(33, rows, 37):
            got = grouped(x[:m])
            if not torch.equal(got, ref):
                bad.append(m)
                worst = max(worst, (got - ref).abs().max().item())
        out.append({"bench": "batch_invariance", "kernel": f"grouped_mm[{backend}]", "rows": rows,
                    "differing_M": bad[:16], "num_differing_M": len(bad), "max_abs_diff": worst})
    return out


def _model(preset: str, backend: str, invariant: bool):
    from moe_fold.models.model import build_model

    config = load_config(preset, ["parallel.ep=1", f"moe.gemm_backend={backend}", "moe.swiglu_backend=torch",
                                  "moe.topk_backend=torch", "moe.permute_backend=torch",
                                  f"train.batch_invariant={str(invariant).lower()}"])
    torch.manual_seed(0)
    return config, build_model(config, ProcessGroups.single_process())


def model_rows(preset: str) -> list[dict]:
    from moe_fold.kernels.gmm import available_backends

    out = []
    for backend in [b for b in available_backends("cpu") if b in ("torch", "loop")]:
        for invariant in (False, True):
            config, model = _model(preset, backend, invariant)
            model.eval()
            ids = torch.randint(0, config.model.vocab_size, (8, config.model.seq_length),
                                generator=torch.Generator().manual_seed(1))
            alone, alone_routes = first_sequence_outputs(model, ids, 1)
            for b in (2, 4, 8):
                logits, found = first_sequence_outputs(model, ids, b)
                out.append({"bench": "batch_invariance", "model": preset, "gemm_backend": backend,
                            "batch_invariant": invariant, "batch": b,
                            "max_abs_logit_diff_vs_alone": (logits - alone).abs().max().item(),
                            "routes_equal": all(torch.equal(a, c) for a, c in zip(alone_routes, found))})
    return out


def cost(preset: str, rounds: int) -> list[dict]:
    """A training forward and backward of one micro-batch, mode on against off."""
    models = {inv: _model(preset, "auto", inv) for inv in (False, True)}
    config = models[False][0]
    B, S = config.train.micro_batch_size, config.model.seq_length
    ids = torch.randint(0, config.model.vocab_size, (B, S + 1), generator=torch.Generator().manual_seed(2))

    def step(model):
        model.zero_grad(set_to_none=True)
        model(ids[:, :-1], ids[:, 1:]).backward()

    wall = {inv: [] for inv in models}
    cpu = {inv: [] for inv in models}
    for inv, (_, model) in models.items():
        model.train()
        step(model)
    for _ in range(rounds):
        for inv, (_, model) in models.items():
            w0, c0 = time.perf_counter(), time.process_time()
            step(model)
            wall[inv].append(time.perf_counter() - w0)
            cpu[inv].append(time.process_time() - c0)
    med = {inv: (statistics.median(wall[inv]), statistics.median(cpu[inv])) for inv in models}
    return [{"bench": "batch_invariance", "cost": True, "model": preset, "micro_batch": B,
             "off_ms": med[False][0] * 1e3, "on_ms": med[True][0] * 1e3,
             "overhead": med[True][0] / med[False][0] - 1, "overhead_cpu": med[True][1] / med[False][1] - 1}]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="mixtral-tiny")
    p.add_argument("--threads", type=int, default=None)
    p.add_argument("--rows", type=int, default=1024)
    p.add_argument("--rounds", type=int, default=5)
    args = p.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    for row in kernels(args.rows) + model_rows(args.preset) + cost(args.preset, args.rounds):
        print(json.dumps({**row, "threads": torch.get_num_threads()}))


if __name__ == "__main__":
    main()
