"""Permute + unpermute benchmark: how close the token shuffle gets to a plain copy.

    python -m bench.permute [--tokens 4096 --hidden 1024 --experts 16 --topk 4
                             --backends torch --dtype float32 --repeats 9]

One MoE layer moves each routed row twice: ``permute`` (tokens -> expert-major rows,
``[T, H] -> [N, H]``) and ``unpermute`` (weighted by the probs and summed back,
``[N, H] -> [T, H]``), with ``N = T * topk``. The floor is copying the ``[N, H]``
buffer once per direction, so ``copy_ms`` is a plain ``dst.copy_(src)`` of that
buffer done twice (four times for forward+backward, which moves the rows twice
more), measured in the same run; ``ratio_to_copy = ms / copy_ms``. The index work
(which row goes where) is included in ``ms``. Candidates are timed interleaved,
round after round, and medians are reported because the machine is noisy.

Prints one JSON line per (backend, pass): ``bench, backend, pass, ms, copy_ms,
ratio_to_copy`` plus the shape and the allocator setting.
"""

import argparse
import json
import os

# Both settings must be in place before torch starts (an existing value wins):
# - spinning OpenMP threads starve each other on a shared CPU (see bench/gemm.py);
# - every [N, H] result is a fresh multi-MB allocation, and with 4 KiB pages the
#   first touch of each page dominates a memory-bound op (measured here: a fresh
#   64 MiB tensor filled once costs ~2x a copy into an existing one). Torch's
#   THP_MEM_ALLOC_ENABLE asks for transparent huge pages, as a CPU training run would.
#   The copy baseline allocates nothing, so this only removes a cost from our side;
#   run with THP_MEM_ALLOC_ENABLE=0 to see it (the field `thp` records the setting).
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
os.environ.setdefault("THP_MEM_ALLOC_ENABLE", "1")

import torch  # noqa: E402

from bench.timing import interleaved_medians_ms, sync  # noqa: E402
from moe_fold.kernels.permute import permute, unpermute  # noqa: E402


def random_routing(tokens: int, experts: int, topk: int, seed: int
                   ) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-k of uniform scores: ``routing_map[T, E]`` and softmax-like ``probs``."""
    g = torch.Generator().manual_seed(seed)
    scores = torch.rand(tokens, experts, generator=g)
    top = scores.topk(topk, dim=1).indices
    routing_map = torch.zeros(tokens, experts, dtype=torch.bool).scatter_(1, top, True)
    probs = scores * routing_map
    return routing_map, probs / probs.sum(1, keepdim=True)


def make_steps(backend, tokens, routing_map, probs, upstream):
    def forward():
        permuted, permuted_probs, idx = permute(tokens, routing_map, probs, backend=backend)
        return unpermute(permuted, idx, tokens.shape[0], probs=permuted_probs,
                         backend=backend)

    def forward_backward():
        x = tokens.detach().requires_grad_()
        p = probs.detach().requires_grad_()
        permuted, permuted_probs, idx = permute(x, routing_map, p, backend=backend)
        out = unpermute(permuted, idx, tokens.shape[0], probs=permuted_probs,
                        backend=backend)
        torch.autograd.grad(out, [x, p], upstream)

    return {"forward": forward, "forward_backward": forward_backward}


def main(argv=None) -> None:
    p = argparse.ArgumentParser(description=__doc__,
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--tokens", type=int, default=4096)
    p.add_argument("--hidden", type=int, default=1024)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--topk", type=int, default=4)
    p.add_argument("--backends", default="torch", help="comma list of torch, triton")
    p.add_argument("--dtype", default="float32", choices=["float32", "bfloat16"])
    p.add_argument("--device", default="cuda" if torch.cuda.is_available() else "cpu")
    p.add_argument("--repeats", type=int, default=9, help="interleaved rounds (median)")
    p.add_argument("--threads", type=int, default=2, help="torch CPU threads")
    args = p.parse_args(argv)
    if not 1 <= args.topk <= args.experts:
        raise SystemExit(f"--topk {args.topk} must be in [1, --experts {args.experts}]")
    backends = args.backends.split(",")
    for b in backends:
        if b not in ("torch", "triton"):
            raise SystemExit(f"--backends: {b!r} is not one of torch, triton")
        if b == "triton" and args.device != "cuda":
            raise SystemExit("--backends triton needs --device cuda (on CPU Triton only "
                             "runs in its interpreter, which is not a benchmark)")

    torch.set_num_threads(args.threads)
    device = torch.device(args.device)
    dtype = getattr(torch, args.dtype)
    routing_map, probs = random_routing(args.tokens, args.experts, args.topk, seed=0)
    routing_map, probs = routing_map.to(device), probs.to(device)
    g = torch.Generator().manual_seed(1)
    tokens = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype)
    upstream = torch.randn(args.tokens, args.hidden, generator=g).to(device, dtype)
    rows = int(routing_map.sum())
    src = torch.randn(rows, args.hidden, generator=g).to(device, dtype)
    dst = torch.empty_like(src)

    def copy_both_ways():
        dst.copy_(src)
        src.copy_(dst)

    candidates = {("copy", "forward"): copy_both_ways}
    for b in backends:
        for name, fn in make_steps(b, tokens, routing_map, probs, upstream).items():
            candidates[(b, name)] = fn
    for fn in candidates.values():  # warm-up (and Triton compilation)
        fn()
    sync(device)
    ms = interleaved_medians_ms(candidates, args.repeats, device)

    copy_ms = ms[("copy", "forward")]
    for (b, name), t in ms.items():
        if b == "copy":
            continue
        # Forward+backward moves the rows twice as often as forward alone.
        ref = copy_ms * (2 if name == "forward_backward" else 1)
        print(json.dumps({
            "bench": "permute", "backend": b, "pass": name, "ms": round(t, 3),
            "copy_ms": round(ref, 3), "ratio_to_copy": round(t / ref, 3),
            "tokens": args.tokens, "hidden": args.hidden, "experts": args.experts,
            "topk": args.topk, "rows": rows, "dtype": args.dtype, "device": args.device,
            "threads": args.threads, "repeats": args.repeats,
            "thp": os.environ.get("THP_MEM_ALLOC_ENABLE")}), flush=True)


if __name__ == "__main__":
    main()
