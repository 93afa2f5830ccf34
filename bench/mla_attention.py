"""MLA-shaped attention on one rank: q/k heads ``qk_nope + qk_rope`` wide, v heads
``v_head_dim`` wide. Times forward + backward of ``moe_fold.parallel.varlen.sdpa`` (v and
the narrower side padded with zero columns to one width, so SDPA can use its fused
kernel) against plain ``F.scaled_dot_product_attention`` on the unpadded tensors (which
falls back to the math path when the widths differ), interleaved, in the same run.

    python bench/mla_attention.py [--seq 1024 --batch 1 --heads 8 --qk-head-dim 48
                                   --v-head-dim 32 --repeats 5 --threads 1]

One JSON line: ``{"bench": "mla_attention", "seq", "heads", "qk_head_dim", "v_head_dim",
"ms", "unpadded_ms", "ratio_to_unpadded", "max_abs_diff"}``; ``ratio_to_unpadded`` is
unpadded_ms / ms (above 1: padding is faster), ``max_abs_diff`` between the two outputs.
"""

import argparse
import json
import statistics
import time

import torch
import torch.nn.functional as F

from moe_fold.parallel.varlen import sdpa


def _step(attend, q, k, v, dout) -> tuple[float, torch.Tensor]:
    q, k, v = (t.detach().requires_grad_() for t in (q, k, v))
    t0 = time.perf_counter()
    out = attend(q, k, v)
    torch.autograd.grad(out, (q, k, v), dout)
    return (time.perf_counter() - t0) * 1e3, out.detach()


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--seq", type=int, default=1024)
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--heads", type=int, default=8)
    parser.add_argument("--qk-head-dim", type=int, default=48)
    parser.add_argument("--v-head-dim", type=int, default=32)
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--threads", type=int, default=1)
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    gen = torch.Generator().manual_seed(0)
    shape = (args.batch, args.heads, args.seq)
    q, k = (torch.randn(*shape, args.qk_head_dim, generator=gen) for _ in range(2))
    v, dout = (torch.randn(*shape, args.v_head_dim, generator=gen) for _ in range(2))

    def padded(q, k, v):
        return sdpa(q, k, v, is_causal=True)

    def unpadded(q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)

    times = {"padded": [], "unpadded": []}
    outs = {}
    for r in range(args.repeats + 1):  # the first round warms up
        for name, attend in (("padded", padded), ("unpadded", unpadded)):
            ms, outs[name] = _step(attend, q, k, v, dout)
            if r:
                times[name].append(ms)
    ms, base = statistics.median(times["padded"]), statistics.median(times["unpadded"])
    print(json.dumps({"bench": "mla_attention", "seq": args.seq, "batch": args.batch, "heads": args.heads,
                      "qk_head_dim": args.qk_head_dim, "v_head_dim": args.v_head_dim, "threads": args.threads,
                      "ms": round(ms, 3), "unpadded_ms": round(base, 3), "ratio_to_unpadded": round(base / ms, 3),
                      "max_abs_diff": (outs["padded"] - outs["unpadded"]).abs().max().item()}))


if __name__ == "__main__":
    main()
