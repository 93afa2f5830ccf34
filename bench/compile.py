"""Compiled against eager, in the same run: one MoE layer, and one mixtral-tiny forward +
backward (the work of a training step, without the optimizer) with every block compiled
as ``train.compile=blocks`` does.

    python bench/compile.py [--shape 1024x256x512x8x2] [--dtypes float32,bfloat16]
                            [--rounds 5] [--iters 3] [--threads 2] [--only layer,model]

A shape is ``tokens x hidden x ffn x experts x topk`` (dropless routing, aux loss on). The
model is the mixtral-tiny preset at ``--seq`` tokens and ``--batch`` samples.

Timing: the compile time is the first compiled forward + backward (Dynamo, AOT autograd
and Inductor's code generation; the cache is cleared first), reported on its own. Then
``--rounds`` rounds, each timing ``--iters`` steps of eager and then of compiled (the
same module, the same input); medians over rounds. One JSON line per case: ``eager_ms``,
``compiled_ms``, ``ratio`` = compiled / eager (below 1: compiling wins), ``compile_s``,
and the largest relative difference of the output between the two (``max_rel_diff``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import time

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch._dynamo  # noqa: E402

from moe_fold.config import Config, ModelConfig, load_config  # noqa: E402
from moe_fold.layout import GROUP_NAMES, ParallelLayout, ProcessGroups  # noqa: E402
from moe_fold.models.model import build_model, compile_blocks  # noqa: E402
from moe_fold.models.moe_layer import MoELayer  # noqa: E402


def _groups() -> ProcessGroups:
    return ProcessGroups(ParallelLayout(world_size=1), 0, {name: None for name in GROUP_NAMES})


def _layer_case(shape: str, dtype: torch.dtype):
    tokens, hidden, ffn, experts, topk = (int(v) for v in shape.split("x"))
    config = Config()
    config.model = ModelConfig(vocab_size=64, hidden_size=hidden, num_layers=1, num_heads=4, num_kv_heads=4,
                               ffn_hidden_size=ffn, seq_length=8)
    config.moe.num_experts, config.moe.topk, config.moe.ffn_hidden_size = experts, topk, ffn
    config.moe.aux_loss_coeff = 0.01
    layer = MoELayer(config, _groups(), 0).to(dtype)
    x = torch.randn(tokens, hidden, generator=torch.Generator().manual_seed(0)).to(dtype).requires_grad_()

    def step(module):
        out = module(x)
        torch.autograd.grad(out.float().square().sum(), [x, *module.parameters()])
        return out.detach()
    return layer, torch.compile(layer, fullgraph=True), step


def _model_case(seq: int, batch: int, dtype: torch.dtype):
    config = load_config("mixtral-tiny", [f"model.seq_length={seq}"])
    eager = build_model(config, _groups()).to(dtype)
    compiled = build_model(config, _groups()).to(dtype)
    compiled.load_state_dict(eager.state_dict())
    compile_blocks(compiled)
    ids = torch.randint(0, config.model.vocab_size, (batch, seq), generator=torch.Generator().manual_seed(0))

    def step(model):
        loss = model(ids, ids.roll(-1, 1))
        loss.backward()
        model.zero_grad(set_to_none=True)
        return loss.detach()
    return eager, compiled, step


def _time(step, module, iters: int) -> float:
    begin = time.perf_counter()
    for _ in range(iters):
        step(module)
    return (time.perf_counter() - begin) / iters * 1e3


def measure(name: str, eager, compiled, step, rounds: int, iters: int, dtype: torch.dtype) -> dict:
    torch._dynamo.reset()
    want = step(eager)
    begin = time.perf_counter()
    got = step(compiled)
    compile_s = time.perf_counter() - begin
    diff = ((got.float() - want.float()).abs().max() / want.float().abs().max().clamp(min=1e-30)).item()
    eager_ms, compiled_ms = [], []
    for _ in range(rounds):
        eager_ms.append(_time(step, eager, iters))
        compiled_ms.append(_time(step, compiled, iters))
    e, c = statistics.median(eager_ms), statistics.median(compiled_ms)
    return {"bench": "compile", "case": name, "dtype": str(dtype).replace("torch.", ""), "eager_ms": round(e, 3),
            "compiled_ms": round(c, 3), "ratio": round(c / e, 3), "compile_s": round(compile_s, 2),
            "max_rel_diff": diff, "rounds": rounds, "iters": iters, "threads": torch.get_num_threads()}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--shape", default="1024x256x512x8x2")
    parser.add_argument("--seq", type=int, default=128)
    parser.add_argument("--batch", type=int, default=4)
    parser.add_argument("--dtypes", default="float32,bfloat16")
    parser.add_argument("--rounds", type=int, default=5)
    parser.add_argument("--iters", type=int, default=3)
    parser.add_argument("--threads", type=int, default=2)
    parser.add_argument("--only", default="layer,model")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    only = args.only.split(",")
    with torch._dynamo.config.patch(capture_scalar_outputs=True):
        for dtype in (getattr(torch, d) for d in args.dtypes.split(",")):
            if "layer" in only:
                print(json.dumps(measure(f"moe_layer {args.shape}", *_layer_case(args.shape, dtype),
                                         args.rounds, args.iters, dtype)), flush=True)
            if "model" in only:
                print(json.dumps(measure(f"mixtral-tiny seq{args.seq}xb{args.batch}",
                                         *_model_case(args.seq, args.batch, dtype), args.rounds, args.iters, dtype)),
                      flush=True)


if __name__ == "__main__":
    main()
