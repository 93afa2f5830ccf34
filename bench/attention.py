"""Packed-document attention benchmark: the device's kernel against the per-document loop
that ran before issue 26.

    python -m bench.attention [--batch 1 --seq 4096 --docs 2048,2048 --heads 8 --kv-heads 4
                               --head-dim 64 --dtype float32 --repeats 7]

Causal attention confined to documents (``--docs``: the document lengths of a row,
repeated until the row is full; the last one is cut to fit). Candidates:

- ``loop``: the implementation before issue 26, kept here as the baseline: the batch
  flattened to ``[H, B*S, D]``, one SDPA call per document on 3-D slices.
- ``default``: :func:`moe_fold.parallel.varlen.varlen_attention`, the kernel the device
  rule picks (:mod:`moe_fold.parallel.document_attention`): on CPU one fused CPU flash call
  per document on 4-D slices; on CUDA one compiled flex_attention call with a document
  block mask.
- ``masked_sdpa``: one SDPA call with a block-diagonal additive mask ``[B, 1, S, S]``:
  one kernel call, but every block of the mask computed.

Outputs and grads of every candidate are checked against ``loop`` before timing
(``max_abs_diff``; the run stops if one exceeds ``--tol``). Candidates are timed
interleaved, round after round, medians reported (the machine may be shared).

Prints one JSON line per (candidate, pass): ``bench, candidate, pass, ms, loop_ms,
ratio_vs_loop`` (``ms / loop_ms``; below 1 is faster), ``max_abs_diff`` and the shape.
"""

import argparse
import json
import math
import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # spinning OpenMP threads starve each other on a shared CPU

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from bench.timing import interleaved_medians_ms  # noqa: E402
from moe_fold.parallel.document_attention import document_kernel  # noqa: E402
from moe_fold.parallel.varlen import segment_bounds, varlen_attention  # noqa: E402


def loop_attention(q, k, v, doc_ids):
    """The per-document loop as it was before issue 26 (the baseline)."""
    B, _, S, _ = q.shape
    bounds = segment_bounds(doc_ids)
    qf, kf, vf = (t.transpose(0, 1).flatten(1, 2) for t in (q, k, v))  # [H, B*S, D]
    outs = [F.scaled_dot_product_attention(qf[:, a:b], kf[:, a:b], vf[:, a:b], is_causal=True,
                                           enable_gqa=q.shape[1] != k.shape[1])
            for a, b in zip(bounds[:-1], bounds[1:])]
    return torch.cat(outs, dim=1).view(q.shape[1], B, S, v.shape[3]).transpose(0, 1)


def masked_sdpa(q, k, v, doc_ids):
    """One SDPA call with a block-diagonal causal mask."""
    S = q.shape[2]
    allowed = (doc_ids[:, None, :, None] == doc_ids[:, None, None, :]) & torch.ones(
        S, S, dtype=torch.bool, device=q.device).tril()
    mask = torch.zeros(allowed.shape, dtype=q.dtype, device=q.device).masked_fill_(~allowed, -math.inf)
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=q.shape[1] != k.shape[1])


CANDIDATES = {"loop": loop_attention, "default": varlen_attention, "masked_sdpa": masked_sdpa}


def doc_ids_for(batch: int, seq: int, lengths: list[int], device) -> torch.Tensor:
    """``[batch, seq]`` ids: each row is ``lengths`` repeated and cut at ``seq``; documents
    numbered over the batch."""
    ids, n = [], 0
    for _ in range(batch):
        row, i = [], 0
        while len(row) < seq:
            take = min(lengths[i % len(lengths)], seq - len(row))
            row += [n] * take
            n, i = n + 1, i + 1
        ids.append(row)
    return torch.tensor(ids, device=device)


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--batch", type=int, default=1)
    p.add_argument("--seq", type=int, default=4096)
    p.add_argument("--docs", default="2048,2048", help="document lengths of a row, comma list, repeated")
    p.add_argument("--heads", type=int, default=8)
    p.add_argument("--kv-heads", type=int, default=4)
    p.add_argument("--head-dim", type=int, default=64)
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--candidates", default="loop,default,masked_sdpa")
    p.add_argument("--repeats", type=int, default=7, help="interleaved rounds (median)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    p.add_argument("--tol", type=float, default=None, help="max abs diff allowed against loop "
                   "(default 1e-4 float32, 5e-2 bfloat16)")
    args = p.parse_args(argv)
    lengths = [int(x) for x in args.docs.split(",")]
    if not lengths or min(lengths) < 1:
        raise SystemExit(f"--docs {args.docs!r} must be positive lengths")
    if args.heads % args.kv_heads:
        raise SystemExit(f"--heads {args.heads} must be a multiple of --kv-heads {args.kv_heads}")
    names = args.candidates.split(",")
    for name in names:
        if name not in CANDIDATES:
            raise SystemExit(f"--candidates: {name!r} is not one of {', '.join(CANDIDATES)}")
    if "loop" not in names:
        names.insert(0, "loop")
    tol = args.tol if args.tol is not None else (1e-4 if args.dtype == "float32" else 5e-2)

    torch.set_num_threads(args.threads)
    device, dtype = torch.device(args.device), getattr(torch, args.dtype)
    ids = doc_ids_for(args.batch, args.seq, lengths, device)
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(args.batch, h, args.seq, args.head_dim, generator=g).to(device, dtype)
               for h in (args.heads, args.kv_heads, args.kv_heads))
    dout = torch.randn(args.batch, args.heads, args.seq, args.head_dim, generator=g).to(device, dtype)

    def steps(fn):
        def forward():
            with torch.no_grad():
                return fn(q, k, v, ids)

        def forward_backward():
            leaves = [t.detach().requires_grad_() for t in (q, k, v)]
            out = fn(*leaves, ids)
            return [out.detach(), *torch.autograd.grad(out, leaves, dout)]

        return {"forward": forward, "forward_backward": forward_backward}

    candidates = {(name, step): f for name in names for step, f in steps(CANDIDATES[name]).items()}
    # Equal results first (this also warms up, and compiles flex on CUDA).
    expected = candidates[("loop", "forward_backward")]()
    diffs = {}
    for name in names:
        got = candidates[(name, "forward_backward")]()
        diffs[name] = max((a.float() - b.float()).abs().max().item() for a, b in zip(got, expected))
        if diffs[name] > tol:
            raise SystemExit(f"{name}: output/grads differ from loop by {diffs[name]:.3g} > --tol {tol}")
    for fn in candidates.values():
        fn()
    ms = interleaved_medians_ms(candidates, args.repeats, device)
    for (name, step), t in ms.items():
        loop_ms = ms[("loop", step)]
        print(json.dumps({
            "bench": "attention", "candidate": name, "pass": step, "ms": round(t, 3), "loop_ms": round(loop_ms, 3),
            "ratio_vs_loop": round(t / loop_ms, 3), "max_abs_diff": diffs[name],
            "kernel": document_kernel(device) if name == "default" else name,
            "batch": args.batch, "seq": args.seq, "docs": args.docs, "num_docs": int(ids.max()) + 1,
            "heads": args.heads, "kv_heads": args.kv_heads, "head_dim": args.head_dim, "dtype": args.dtype,
            "device": args.device, "threads": args.threads, "repeats": args.repeats}), flush=True)


if __name__ == "__main__":
    main()
