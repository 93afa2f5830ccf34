"""Route files: read route traces, compare two runs' routes, read and write routes for
router replay (docs/routes.md).

A route trace is what ``train.route_trace_every`` writes: under
``run_dir/routes/step_NNNNNN/`` one safetensors shard per rank, each holding the rank's
tokens of that step keyed by their place in the data (``sample``: the global sample
number the loader gave the row; ``position``: the token's index in the sample's
sequence), never by rank or micro-batch, and per MoE layer ``i`` the chosen experts
(``layer.i.experts [T, topk]``, ascending, the smallest integer type that holds
``num_experts - 1``), their gating probabilities (``layer.i.probs``, bf16) and whether
capacity dropped the assignment (``layer.i.dropped``, bool). :func:`load` merges the
shards into one :class:`RouteTable` sorted by ``(sample, position)``, so a trace reads
the same under any layout.

The inference format (routes from an inference engine, or from transformers with
:func:`moe_fold.models.hf.routes.routes_from_transformers`): one safetensors file with a
tensor ``sample.{i}`` per sample, integer ``[tokens, moe_layers, topk]`` (``tokens`` =
``model.seq_length``), and metadata ``format=moe-fold-routes``, ``num_experts``,
``topk`` and ``moe_layers`` (comma-separated layer indices).

This module only reads and writes files; the training side (recording, feeding the
routers) is :mod:`moe_fold.training.routes`.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from pathlib import Path
from typing import Optional

import torch

__all__ = [
    "RouteTable", "RouteSignature", "RouteDiff", "ReplayRoutes", "FORMAT",
    "expert_dtype", "step_dir", "steps", "load", "diff", "format_diff", "diff_json", "write_inference", "load_replay",
]

FORMAT = "moe-fold-routes"


@dataclass(frozen=True)
class RouteSignature:
    """What a set of routes must agree on with the model that reads or replays them."""
    num_experts: int
    topk: int
    moe_layers: tuple[int, ...]
    seq_length: int
    hidden_size: Optional[int] = None  # None: not recorded (the inference format)

    def metadata(self) -> dict[str, str]:
        meta = {"format": FORMAT, "num_experts": str(self.num_experts), "topk": str(self.topk),
                "moe_layers": ",".join(map(str, self.moe_layers)), "seq_length": str(self.seq_length)}
        if self.hidden_size is not None:
            meta["hidden_size"] = str(self.hidden_size)
        return meta

    @classmethod
    def from_metadata(cls, meta: Optional[dict], where: str) -> "RouteSignature":
        meta = meta or {}
        if meta.get("format") != FORMAT:
            raise ValueError(f"{where}: metadata format={meta.get('format')!r} must be {FORMAT!r} "
                             f"(a moe-fold route trace or routes file)")
        missing = [k for k in ("num_experts", "topk", "moe_layers") if k not in meta]
        if missing:
            raise ValueError(f"{where}: metadata lacks {', '.join(missing)}: a routes file must say the "
                             f"experts, top-k and MoE layers it was made for")
        layers = tuple(int(x) for x in meta["moe_layers"].split(",") if x)
        return cls(int(meta["num_experts"]), int(meta["topk"]), layers, int(meta.get("seq_length", 0)),
                   int(meta["hidden_size"]) if "hidden_size" in meta else None)


def expert_dtype(num_experts: int) -> torch.dtype:
    """The smallest integer type that holds every expert index."""
    if num_experts <= 256:
        return torch.uint8
    return torch.int16 if num_experts <= 2 ** 15 else torch.int32


def step_dir(run_dir: str | Path, step: int) -> Path:
    return Path(run_dir) / "routes" / f"step_{step:06d}"


def _routes_root(path: str | Path) -> Path:
    path = Path(path)
    return path if path.name == "routes" or not (path / "routes").is_dir() else path / "routes"


def steps(run_dir: str | Path) -> list[int]:
    """The steps a run traced, in order."""
    root = _routes_root(run_dir)
    found = (re.fullmatch(r"step_(\d+)", p.name) for p in root.iterdir()) if root.is_dir() else ()
    return sorted(int(m.group(1)) for m in found if m)


@dataclass
class RouteTable:
    """One step's routes of the whole job: ``N`` tokens sorted by ``(sample, position)``,
    ``L`` MoE layers (``layers``, global indices), ``k`` experts each."""
    step: int
    signature: RouteSignature
    layers: list[int]
    sample: torch.Tensor  # int64 [N]
    position: torch.Tensor  # int64 [N]
    experts: torch.Tensor  # int64 [N, L, k], ascending per token
    probs: torch.Tensor  # float32 [N, L, k] (stored as bf16)
    dropped: torch.Tensor  # bool [N, L, k]


def load(run_dir: str | Path, step: int) -> RouteTable:
    """The routes ``run_dir`` recorded at ``step``, merged over its ranks' shards."""
    from safetensors import safe_open

    folder = _routes_root(run_dir) / f"step_{step:06d}"
    shards = sorted(folder.glob("rank_*.safetensors"))
    if not shards:
        have = steps(run_dir)
        raise FileNotFoundError(f"no route trace of step {step} in {folder} (traced steps: {have or 'none'}; "
                                f"train.route_trace_every must be > 0 and divide the step)")
    signature, per_layer = None, {}
    for shard in shards:
        with safe_open(str(shard), framework="pt") as f:
            sig = RouteSignature.from_metadata(f.metadata(), str(shard))
            if signature is not None and sig != signature:
                raise ValueError(f"{shard}: metadata {sig} differs from the other shards' {signature}")
            signature = sig
            sample, position = f.get_tensor("sample").long(), f.get_tensor("position").long()
            for name in f.keys():
                m = re.fullmatch(r"layer\.(\d+)\.experts", name)
                if m:
                    i = int(m.group(1))
                    parts = per_layer.setdefault(i, [])
                    parts.append((sample, position, f.get_tensor(name).long(),
                                  f.get_tensor(f"layer.{i}.probs").float(), f.get_tensor(f"layer.{i}.dropped")))
    layers = sorted(per_layer)
    if layers != sorted(signature.moe_layers):
        raise ValueError(f"{folder}: the shards hold MoE layers {layers}, the trace was made for "
                         f"{list(signature.moe_layers)}: a rank's shard is missing")
    keys = None
    experts, probs, dropped = [], [], []
    S = signature.seq_length
    for i in layers:
        sample, position, e, p, d = (torch.cat(x) for x in zip(*per_layer[i]))
        key = sample * S + position
        order = torch.argsort(key)
        key = key[order]
        if keys is None:
            keys = key
            if bool((key[1:] == key[:-1]).any()):
                raise ValueError(f"{folder}: layer {i} holds a token twice: shards of two runs in one folder?")
        elif not torch.equal(key, keys):
            raise ValueError(f"{folder}: layer {i} holds other tokens than layer {layers[0]}")
        experts.append(e[order])
        probs.append(p[order])
        dropped.append(d[order])
    return RouteTable(step, signature, layers, keys // S, keys % S, torch.stack(experts, 1), torch.stack(probs, 1),
                      torch.stack(dropped, 1))


# --------------------------------------------------------------------------- diff

@dataclass
class RouteDiff:
    """Two runs' routes at their common traced steps (see :func:`diff`)."""
    steps: list[int]
    layers: list[int]
    # step -> per layer, the fraction of tokens whose expert set differs
    differing: dict[int, list[float]]
    first: Optional[tuple[int, int]]  # (step, layer) where the runs first route a token apart; None: never
    # The tokens with the largest probability change: (step, layer, sample, position,
    # experts_a, experts_b, max |p_a - p_b| over the experts of either).
    largest: list[tuple[int, int, int, int, list[int], list[int], float]]


def _dense(table: RouteTable, layer: int) -> torch.Tensor:
    """``[N, E]`` probabilities of one layer (0 off the chosen experts)."""
    e, p = table.experts[:, layer], table.probs[:, layer]
    return torch.zeros(e.shape[0], table.signature.num_experts).scatter_(1, e, p)


def diff(run_a: str | Path, run_b: str | Path, step: Optional[int] = None, top: int = 5) -> RouteDiff:
    """Compare the routes of two runs of the same model and data: at ``step`` (None:
    every step both traced), per MoE layer the fraction of tokens whose expert set
    differs, the first (step, layer) where they part, and the ``top`` tokens whose
    gating probabilities changed most."""
    common = sorted(set(steps(run_a)) & set(steps(run_b)))
    if step is not None:
        common = [s for s in common if s == step]
    if not common:
        raise ValueError(f"no traced step in common between {run_a} (steps {steps(run_a)}) and {run_b} "
                         f"(steps {steps(run_b)})" + ("" if step is None else f" at --step {step}"))
    differing, first, largest, layers = {}, None, [], []
    for s in common:
        a, b = load(run_a, s), load(run_b, s)
        if a.signature.num_experts != b.signature.num_experts or a.layers != b.layers:
            raise ValueError(f"step {s}: {run_a} routes {a.signature.num_experts} experts in layers {a.layers}, "
                             f"{run_b} {b.signature.num_experts} in {b.layers}: not the same model")
        if not (torch.equal(a.sample, b.sample) and torch.equal(a.position, b.position)):
            raise ValueError(f"step {s}: the runs traced different tokens ({len(a.sample)} and {len(b.sample)}): "
                             f"not the same data (train.seed, data, global_batch_size)")
        layers = a.layers
        apart = (a.experts != b.experts).any(dim=2)  # [N, L]
        differing[s] = apart.float().mean(dim=0).tolist()
        if first is None and bool(apart.any()):
            first = (s, a.layers[int(apart.any(dim=0).nonzero()[0])])
        for j, layer in enumerate(a.layers):
            change = (_dense(a, j) - _dense(b, j)).abs().amax(dim=1)  # [N]
            for t in torch.topk(change, min(top, len(change))).indices.tolist():
                if change[t] == 0:
                    break
                largest.append((s, layer, int(a.sample[t]), int(a.position[t]), a.experts[t, j].tolist(),
                                b.experts[t, j].tolist(), float(change[t])))
    largest = sorted(largest, key=lambda r: -r[-1])[:top]
    return RouteDiff(common, layers, differing, first, largest)


def format_diff(d: RouteDiff) -> str:
    """:func:`diff`'s result as the table ``moe-fold routes diff`` prints."""
    lines = ["step  " + "  ".join(f"layer {i:>3}" for i in d.layers) + "   (fraction of tokens routed apart)"]
    for s in d.steps:
        lines.append(f"{s:>4}  " + "  ".join(f"{x:>9.4f}" for x in d.differing[s]))
    lines.append("first apart: never" if d.first is None else f"first apart: step {d.first[0]}, layer {d.first[1]}")
    lines.append("largest probability changes (step layer sample position experts_a experts_b max|dp|):"
                 + ("" if d.largest else " none"))
    for s, layer, sample, pos, ea, eb, change in d.largest:
        lines.append(f"  {s} {layer} {sample} {pos} {ea} {eb} {change:.3e}")
    return "\n".join(lines)


def diff_json(d: RouteDiff) -> str:
    return json.dumps({"steps": d.steps, "layers": d.layers, "differing": {str(k): v for k, v in d.differing.items()},
                       "first": d.first, "largest": d.largest})


# --------------------------------------------------------------------------- replay

def write_inference(path: str | Path, routes: dict[int, torch.Tensor], signature: RouteSignature) -> None:
    """Write ``routes`` (sample number -> integer ``[tokens, moe_layers, topk]``) in the
    inference format."""
    from safetensors.torch import save_file

    tensors = {f"sample.{i}": r.to(expert_dtype(signature.num_experts)).contiguous() for i, r in routes.items()}
    save_file(tensors, str(path), metadata=signature.metadata())


@dataclass
class ReplayRoutes:
    """Routes to replay: per sample number, ``[seq_length, L, k]`` int64 (``L`` = the MoE
    layers of ``signature``)."""
    path: str
    signature: RouteSignature
    samples: dict[int, torch.Tensor]

    def of(self, sample: int, step: int) -> torch.Tensor:
        found = self.samples.get(sample)
        if found is None:
            raise ValueError(f"moe.router_replay={self.path} has no routes for sample {sample}, which step {step} "
                             f"trains on: replay needs the routes of every sample the run reads "
                             f"({len(self.samples)} recorded)")
        return found


def load_replay(path: str | Path, expected: RouteSignature) -> ReplayRoutes:
    """The routes of ``path`` (a route trace: a run folder or its ``routes/``; or a file of
    the inference format), checked against the model (``expected``): every mismatch is
    refused with the field, the value and the rule."""
    from safetensors import safe_open

    where = f"moe.router_replay={path}"
    p = Path(path)
    samples: dict[int, torch.Tensor] = {}
    if p.is_file():
        with safe_open(str(p), framework="pt") as f:
            signature = RouteSignature.from_metadata(f.metadata(), where)
            _check_signature(signature, expected, where)
            for name in f.keys():
                m = re.fullmatch(r"sample\.(\d+)", name)
                if m is None:
                    raise ValueError(f"{where}: tensor {name!r} is not named sample.<number>")
                samples[int(m.group(1))] = f.get_tensor(name)
    elif p.is_dir() and steps(p):
        for s in steps(p):
            table = load(p, s)
            signature = table.signature
            _check_signature(signature, expected, where)
            S = expected.seq_length
            for sample in table.sample.unique().tolist():
                rows = table.sample == sample
                if int(rows.sum()) != S:
                    raise ValueError(f"{where}: step {s} recorded {int(rows.sum())} of sample {sample}'s "
                                     f"{S} tokens: a trace must hold whole samples")
                samples[sample] = table.experts[rows]  # sorted by position: [S, L, k]
    else:
        raise ValueError(f"{where}: no such routes file, and no route trace (routes/step_*/) in that folder")
    L, k, E, S = len(expected.moe_layers), expected.topk, expected.num_experts, expected.seq_length
    for i, r in samples.items():
        if r.dtype.is_floating_point or r.dtype == torch.bool or tuple(r.shape) != (S, L, k):
            raise ValueError(f"{where}: sample.{i} is {r.dtype} {list(r.shape)}; the rule: integer "
                             f"[tokens={S}, moe_layers={L}, topk={k}] (model.seq_length, the model's MoE layers, "
                             f"moe.topk)")
        r = r.long().sort(dim=-1).values
        bad = (r < 0) | (r >= E)
        if bool(bad.any()):
            raise ValueError(f"{where}: sample.{i} names expert {int(r[bad][0])}; the rule: experts lie in "
                             f"[0, moe.num_experts={E})")
        if k > 1 and bool((r[..., 1:] == r[..., :-1]).any()):
            raise ValueError(f"{where}: sample.{i} names an expert twice for one token; the rule: a token's "
                             f"moe.topk={k} experts are distinct")
        samples[i] = r
    return ReplayRoutes(str(path), signature, samples)


def _check_signature(got: RouteSignature, expected: RouteSignature, where: str) -> None:
    rules = [("num_experts", "moe.num_experts", "replayed experts must be this model's experts"),
             ("topk", "moe.topk", "a token is replayed to as many experts as the model routes it to"),
             ("moe_layers", "the model's MoE layers", "one route per MoE layer of this model"),
             ("hidden_size", "model.hidden_size", "routes of another model do not replay")]
    for field, setting, rule in rules:
        a, b = getattr(got, field), getattr(expected, field)
        if a is not None and b is not None and a != b:
            raise ValueError(f"{where}: the routes' {field}={_show(a)} but {setting}={_show(b)}; the rule: {rule}")
    if got.seq_length and got.seq_length != expected.seq_length:
        raise ValueError(f"{where}: the routes' seq_length={got.seq_length} but model.seq_length="
                         f"{expected.seq_length}; the rule: one route per token of each sample")


def _show(value) -> str:
    return ",".join(map(str, value)) if isinstance(value, tuple) else str(value)
