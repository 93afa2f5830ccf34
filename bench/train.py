"""Training-step benchmark: our model against transformers' MixtralForCausalLM with the same
weights and batch, on one process, and our model FLOP/s against a large dense matmul.

    python bench/train.py [--preset mixtral-tiny] [--set model.seq_length=256 ...]
                          [--micro-batch 8] [--rounds 7] [--iters 2] [--threads 2]

One training step = forward, backward, clip by global norm, AdamW step, zero grads, all
in float32, on one micro-batch of ``--micro-batch`` sequences of the preset's
``model.seq_length`` from the demo corpus. Candidates:

- ``ours``: :func:`moe_fold.models.model.build_model` (single process, the preset with
  ep=1) with :mod:`moe_fold.training.optim`'s AdamW, loss = LM loss + aux loss (z-loss off: the
  transformers model has none);
- ``hf:<impl>``: the same weights exported with :func:`moe_fold.models.to_hf` and loaded as
  ``MixtralForCausalLM`` (SDPA attention), once per experts implementation transformers
  registers (``eager`` and ``ALL_EXPERTS_FUNCTIONS``; one that cannot run here gets a
  ``skipped`` line), ``torch.optim.AdamW(fused=True)`` (the kernel ours runs, so both
  optimizer steps cost the same), loss = cross entropy + its router aux loss;
- ``matmul``: an ``--mm`` x ``--mm`` float32 matmul, the machine's dense FLOP/s.

Both sides time the same step: train mode, no router jitter, the aux loss in the loss,
clipping, the same AdamW kernel, ``zero_grad(set_to_none=True)``; ours also computes the
routing statistics its training loop logs. On a shared machine wall time swings with the
other processes; ``--threads 1`` and the ``cpu_ms`` columns are the steadier comparison.

Before timing, the first forward's LM loss of every transformers model is checked
against ours (same weights, same batch). Candidates run interleaved, round after round,
each round the mean of ``--iters`` steps; medians over rounds are reported, from wall
time and from process CPU time (on a shared machine wall time also counts waiting for a
core). Output: one JSON line per candidate, then a summary line with ``tokens_per_s``,
``hf_tokens_per_s``, ``ratio_vs_hf`` (the fastest transformers implementation's step
time / ours), ``ratio_vs_hf_each``, our achieved model FLOP/s and
``flops_fraction_of_matmul`` (ours / the matmul's FLOP/s).

What the kernels allow: one extra step of ours runs under a dispatch mode that records
every matrix multiply (``mm``, ``addmm``, ``bmm``, ``_grouped_mm``) and attention kernel
(SDPA forward and backward) with copies of its inputs; the candidate ``kernels`` replays
exactly those calls, timed interleaved with the others. ``flops_fraction_ceiling`` is the
fraction a step would reach if everything else (norms, activations, routing, permutation,
the optimizer, Python) took no time, and ``kernels_share_of_step`` the part of our step
those calls take. (The copies keep their strides where the originals are dense; a view
into a larger tensor is replayed from a compact copy.)

Model FLOPs per step (PaLM's convention): ``6 * N * T + 12 * L * heads * head_dim * S * T``
with ``N`` the parameters a token passes through (experts counted top-k times, the
embedding lookup not counted, the LM head counted), ``T`` tokens, ``S`` sequence length.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import tempfile
import time

# Threads that spin at OpenMP barriers on a loaded machine starve the thread they wait
# for; libgomp reads this when torch loads it.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

from moe_fold.config import head_dim, load_config, moe_layer_flags  # noqa: E402
from moe_fold.layout import ProcessGroups  # noqa: E402


def parse_args() -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--preset", default="mixtral-tiny", help="a preset or YAML file (Mixtral-style: no shared expert)")
    p.add_argument("--set", action="append", default=[], dest="overrides", metavar="KEY=VALUE",
                   help="config override, repeatable")
    p.add_argument("--micro-batch", type=int, default=8, help="sequences per step (default 8)")
    p.add_argument("--rounds", type=int, default=7, help="interleaved rounds (default 7)")
    p.add_argument("--iters", type=int, default=2, help="steps per candidate per round (default 2)")
    p.add_argument("--warmup", type=int, default=2, help="untimed steps per candidate first (default 2)")
    p.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's)")
    p.add_argument("--mm", type=int, default=2048, help="size of the reference square matmul (default 2048)")
    p.add_argument("--impls", default=None, help="comma-separated transformers experts implementations "
                                                 "(default: every registered one)")
    return p.parse_args()


def hf_implementations() -> list[str]:
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    return ["eager"] + [name for name in ALL_EXPERTS_FUNCTIONS if name != "eager"]


def model_flops(config, model, tokens: int) -> float:
    """Training FLOPs of one step of ``tokens`` tokens (see the module docstring)."""
    m, moe = config.model, config.moe
    per_token = 0
    for name, p in model.named_parameters():
        if name == "embed.weight" and not m.tie_embeddings:
            continue
        if ".experts." in name:
            per_token += p.numel() * moe.topk // moe.num_experts
        else:
            per_token += p.numel()
    attention = 12 * m.num_layers * m.num_heads * head_dim(config) * m.seq_length
    return float(6 * per_token * tokens + attention * tokens)


def build(args):
    from moe_fold.data.loader import DataLoader, dataset_from_config
    from moe_fold.models.model import build_model
    from moe_fold.training.optim import build_optimizer

    config = load_config(args.preset, ["parallel.ep=1", "parallel.tp=1", "moe.z_loss_coeff=0", "wandb.mode=disabled",
                                       *args.overrides])
    if any(moe_layer_flags(config)) and config.moe.shared_expert_ffn_hidden_size:
        raise SystemExit(f"--preset {args.preset}: MixtralForCausalLM has no shared expert; use a Mixtral-style preset")
    config.train.micro_batch_size = config.train.global_batch_size = args.micro_batch
    groups = ProcessGroups.single_process()
    torch.manual_seed(config.train.seed)
    model = build_model(config, groups).train()
    optimizer = build_optimizer(model, config.optimizer, groups)
    batch = next(iter(DataLoader(dataset_from_config(config), args.micro_batch, args.micro_batch)))
    return config, groups, model, optimizer, batch


def load_hf(config, model, impl: str, folder: str):
    from transformers import MixtralForCausalLM

    hf = MixtralForCausalLM.from_pretrained(folder, dtype=torch.float32, attn_implementation="sdpa")
    hf.config._experts_implementation = impl
    hf.config.output_router_logits = True
    hf.config.router_aux_loss_coef = config.moe.aux_loss_coeff
    hf.config.router_jitter_noise = 0.0
    return hf.train()


def hf_loss(hf, batch, with_aux: bool) -> torch.Tensor:
    out = hf(input_ids=batch.tokens, output_router_logits=with_aux)
    lm = F.cross_entropy(out.logits.flatten(0, 1), batch.labels.flatten())
    return lm + hf.config.router_aux_loss_coef * out.aux_loss if with_aux else lm


def main() -> None:
    args = parse_args()
    if args.threads is not None:
        torch.set_num_threads(args.threads)
    from moe_fold.models import to_hf
    from moe_fold.training.optim import apply_gradients

    config, groups, model, optimizer, batch = build(args)
    tokens = batch.tokens.numel()
    clip = config.optimizer.clip_grad

    def ours_step():
        loss = model(batch.tokens, batch.labels, positions=batch.positions)
        loss.backward()
        for layer in model.layers:
            if hasattr(layer.mlp, "router"):
                layer.mlp.router.finish_step()
        apply_gradients(list(model.parameters()), optimizer, groups, clip)
        optimizer.zero_grad(set_to_none=True)

    steps = {"ours": ours_step}
    info = {"ours": {}}
    impls = args.impls.split(",") if args.impls else hf_implementations()
    with tempfile.TemporaryDirectory() as folder:
        to_hf(model, folder)
        with torch.no_grad():
            ours_lm = float(model.logits(batch.tokens, batch.positions).flatten(0, 1).log_softmax(-1)
                            .gather(1, batch.labels.flatten()[:, None]).neg().mean())
        for impl in impls:
            name = f"hf:{impl}"
            try:
                hf = load_hf(config, model, impl, folder)
                with torch.no_grad():
                    lm = float(hf_loss(hf, batch, with_aux=False))
                hf_step_fn = _hf_step(hf, batch, clip, config)
                hf_step_fn()
            except Exception as err:  # an implementation transformers registers but this machine cannot run
                print(json.dumps({"bench": "train", "candidate": name, "skipped": f"{type(err).__name__}: {err}"}))
                continue
            if abs(lm - ours_lm) > 1e-3 * abs(ours_lm):
                raise SystemExit(f"{name}: first LM loss {lm} differs from ours {ours_lm}: not the same model")
            steps[name] = hf_step_fn
            info[name] = {"first_lm_loss_diff": lm - ours_lm}

    a = torch.randn(args.mm, args.mm)
    b = torch.randn(args.mm, args.mm)
    steps["matmul"] = lambda: torch.mm(a, b)
    steps["kernels"] = record_kernels(ours_step)

    for step in steps.values():
        for _ in range(args.warmup):
            step()
    wall = {name: [] for name in steps}
    cpu = {name: [] for name in steps}
    for _ in range(args.rounds):
        for name, step in steps.items():
            t0, c0 = time.perf_counter(), time.process_time()
            for _ in range(args.iters):
                step()
            wall[name].append((time.perf_counter() - t0) / args.iters)
            cpu[name].append((time.process_time() - c0) / args.iters)
    med = {name: statistics.median(v) for name, v in wall.items()}
    med_cpu = {name: statistics.median(v) for name, v in cpu.items()}

    flops = model_flops(config, model, tokens)
    mm_flops = 2.0 * args.mm ** 3
    for name in steps:
        line = {"bench": "train", "candidate": name, "ms": med[name] * 1e3, "cpu_ms": med_cpu[name] * 1e3,
                **info.get(name, {})}
        if name == "matmul":
            line["flops_per_s"] = mm_flops / med[name]
        elif name == "kernels":  # the model's FLOPs over the time of its kernels alone
            line["flops_per_s"] = flops / med[name]
        else:
            line["tokens_per_s"] = tokens / med[name]
        print(json.dumps(line))
    hf_names = [n for n in steps if n.startswith("hf:")]
    ours_flops_per_s = flops / med["ours"]
    summary = {
        "bench": "train", "preset": args.preset, "micro_batch": args.micro_batch, "seq_length": config.model.seq_length,
        "threads": torch.get_num_threads(), "tokens_per_step": tokens,
        "tokens_per_s": tokens / med["ours"],
        "hf_tokens_per_s": {n: tokens / med[n] for n in hf_names},
        "ratio_vs_hf": min(med[n] for n in hf_names) / med["ours"] if hf_names else None,
        "ratio_vs_hf_each": {n: med[n] / med["ours"] for n in hf_names},
        "ratio_vs_hf_cpu": min(med_cpu[n] for n in hf_names) / med_cpu["ours"] if hf_names else None,
        "model_flops_per_step": flops, "flops_per_s": ours_flops_per_s,
        "matmul_flops_per_s": mm_flops / med["matmul"],
        "flops_fraction_of_matmul": ours_flops_per_s / (mm_flops / med["matmul"]),
        "flops_fraction_of_matmul_cpu": (flops / med_cpu["ours"]) / (mm_flops / med_cpu["matmul"]),
        "kernels_ms": med["kernels"] * 1e3, "kernels_share_of_step": med["kernels"] / med["ours"],
        "flops_fraction_ceiling": (flops / (mm_flops / med["matmul"])) / med["kernels"],
    }
    print(json.dumps(summary))


# The calls ``kernels`` replays: matrix multiplies and attention (flash SDPA on CPU). Our
# grouped GEMMs are the custom ops ``moe_fold::gmm`` and ``moe_fold::gmm_wgrad``: the
# dispatch mode sees them whole, as it sees torch's ``_grouped_mm``.
GROUPED_GEMM_OPS = ("_grouped_mm", "gmm", "gmm_wgrad")
KERNEL_OPS = ("mm", "addmm", "bmm", *GROUPED_GEMM_OPS, "_scaled_dot_product_flash_attention_for_cpu",
              "_scaled_dot_product_flash_attention_for_cpu_backward")


def record_kernels(step):
    """Run ``step`` once, recording each :data:`KERNEL_OPS` call with copies of its inputs;
    return a function that makes exactly those calls again."""
    from torch.utils._python_dispatch import TorchDispatchMode
    from torch.utils._pytree import tree_map

    def copy(v):
        return v.detach().clone() if isinstance(v, torch.Tensor) else v

    class Recorder(TorchDispatchMode):
        def __init__(self):
            super().__init__()
            self.calls = []

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            kwargs = kwargs or {}
            if func.overloadpacket.__name__ in KERNEL_OPS:  # calls nested in func are not seen
                self.calls.append((func, tree_map(copy, args), tree_map(copy, kwargs)))
            return func(*args, **kwargs)

    with Recorder() as recorder:
        step()
    calls = recorder.calls
    if not any(func.overloadpacket.__name__ in GROUPED_GEMM_OPS for func, _, _ in calls):
        raise SystemExit("bench/train.py: no grouped GEMM recorded in our step; the kernel list is out of date")

    def replay():
        with torch.no_grad():
            for func, args, kwargs in calls:
                func(*args, **kwargs)
    return replay


def _hf_step(hf, batch, clip: float, config):
    o = config.optimizer
    optimizer = torch.optim.AdamW(hf.parameters(), lr=o.lr, betas=(o.beta1, o.beta2), eps=o.eps,
                                  weight_decay=o.weight_decay, fused=True)

    def step():
        loss = hf_loss(hf, batch, with_aux=True)
        loss.backward()
        if clip > 0:
            torch.nn.utils.clip_grad_norm_(hf.parameters(), clip)
        optimizer.step()
        optimizer.zero_grad(set_to_none=True)
    return step


if __name__ == "__main__":
    main()
