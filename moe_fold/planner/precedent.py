"""Published measurements (``bench/published/*.csv``) as configs, and the closest one to a plan.

Each CSV row is one published training throughput with the layout it ran (the columns are
described in docs/planner.md). :func:`row_config` builds the moe-fold config of a row:
a preset with ``--set`` style overrides, or ``gpt:hidden=..,layers=..,heads=..,vocab=..``
for the GPT models of the Megatron-LM papers, built as a dense moe-fold model whose SwiGLU
MLP of width ``8h/3`` (rounded to a multiple of 64) has the FLOPs of GPT's ``4h`` GELU MLP
within 0.1%, with tied embeddings.

:func:`closest` names the row nearest a plan, so a user sees which measured run the
estimate leans on: the distance adds, in octaves (``|log2(a/b)|``), the world size, the
activated and total parameters, and half of each of tp, pp and ep, plus 2 for another GPU
and 2 for a dense row against an MoE plan (or the reverse).
"""

from __future__ import annotations

import csv
import functools
import math
from pathlib import Path
from typing import Optional

from moe_fold.config import Config, load_config
from moe_fold.planner.estimate import Assumptions, Plan, calibrated, estimate, model_params, with_layout
from moe_fold.planner.hardware import get_gpu

__all__ = ["PUBLISHED", "read_published", "find_row", "row_config", "row_assumptions", "row_plan", "closest"]

# The checkout's table; an installed package without the checkout has none (the CLI says so).
PUBLISHED = Path(__file__).resolve().parents[2] / "bench" / "published"


def read_published(folder: Optional[str | Path] = None) -> list[dict]:
    """Every row of every CSV in ``folder`` (default :data:`PUBLISHED`), in file then row
    order; ``[]`` when the folder does not exist."""
    folder = PUBLISHED if folder is None else Path(folder)
    if folder is not PUBLISHED and not folder.is_dir():
        raise ValueError(f"--published {folder}: not a folder")
    rows = []
    for path in sorted(folder.glob("*.csv")) if folder.is_dir() else []:
        with open(path, newline="") as f:
            for row in csv.DictReader(f):
                row["file"] = path.name
                rows.append(row)
    return rows


def find_row(rows: list[dict], row_id: str) -> dict:
    """The row whose ``id`` is ``row_id``; a ValueError naming the known ids otherwise."""
    for row in rows:
        if row["id"] == row_id:
            return row
    raise ValueError(f"--row={row_id!r} is not a row of the published measurements; known: "
                     f"{', '.join(r['id'] for r in rows) or 'none (no published folder)'}")


def row_config(row: dict, extra_sets: tuple[str, ...] = ()) -> Config:
    """The moe-fold config of a published row (see the module doc), with ``extra_sets``
    (``--set`` style overrides) applied after the row's own."""
    spec = row["config"]
    sets = [s for s in (row.get("set") or "").split(";") if s] + list(extra_sets)
    if spec.startswith("gpt:"):
        fields = dict(kv.split("=") for kv in spec[4:].split(","))
        h, layers, heads = int(fields["hidden"]), int(fields["layers"]), int(fields["heads"])
        ffn = round(8 * h / 3 / 64) * 64
        base = [f"model.hidden_size={h}", f"model.num_layers={layers}", f"model.num_heads={heads}",
                f"model.num_kv_heads={heads}", f"model.head_dim={h // heads}", f"model.ffn_hidden_size={ffn}",
                f"model.vocab_size={fields['vocab']}", "model.tie_embeddings=true", "moe.moe_layer_freq=0",
                "moe.num_experts=0"]
        config = load_config("mixtral-tiny", base + sets)
    else:
        config = load_config(spec, sets)
    config.train.precision = "bf16"  # 2-byte activations; the fp16 and fp8 rows included
    config = with_layout(config, tp=int(row["tp"]), cp=int(row["cp"]), pp=int(row["pp"]), ep=int(row["ep"]),
                         etp=int(row["etp"]), vpp=int(row["vpp"]), mbs=int(row["mbs"]), gbs=int(row["gbs"]),
                         seq=int(row["seq"]), recompute=row["recompute"],
                         distributed=row["distributed_optimizer"] == "true")
    config.parallel.sequence_parallel = row["sequence_parallel"] == "true"
    return config


def row_assumptions(row: dict, **overrides) -> Assumptions:
    """The shipped :func:`moe_fold.planner.estimate.calibrated` figures for the row's GPU,
    with what the row ran: its data-parallel overlap, its attention kernel, its GEMM dtype,
    and Megatron-LM's memory footprint (the papers' code); ``overrides`` last."""
    ran = {"overlap": row["dp_overlap"], "implementation": "megatron", "attention_kernel": row["attention_kernel"],
           "gemm_dtype": "fp8" if row["precision"] == "fp8" else "bf16"}
    return calibrated(row["gpu"], **{**ran, **overrides})


def row_plan(row: dict, assumptions: Optional[Assumptions] = None) -> Plan:
    """The plan of a published row: its config, world and GPU under ``assumptions`` (default
    :func:`row_assumptions`). ``moe-fold plan --row`` and ``bench/plan_validation.py`` both
    call this, so they print one MFU for one row."""
    return estimate(row_config(row), int(row["world"]), get_gpu(row["gpu"]),
                    row_assumptions(row) if assumptions is None else assumptions)


@functools.lru_cache(maxsize=256)
def _params(spec: str, sets: str) -> tuple[float, float]:
    row = {"config": spec, "set": sets, "tp": 1, "cp": 1, "pp": 1, "ep": 1, "etp": 1, "vpp": 1, "mbs": 1, "gbs": 1,
           "seq": 128, "recompute": "none", "distributed_optimizer": "false", "sequence_parallel": "false"}
    counts = model_params(row_config(row))
    return counts["activated"], counts["total"]


def _octaves(a: float, b: float) -> float:
    return abs(math.log2(max(a, 1e-9) / max(b, 1e-9)))


def closest(rows: list[dict], plan, gpu: str) -> Optional[dict]:
    """The published row nearest ``plan`` (a :class:`moe_fold.planner.estimate.Plan` on GPU
    key ``gpu``): its ``id``, ``source``, ``published`` value and ``metric``, and ``text``,
    one line for a reader; None without rows."""
    best = None
    lay = plan.layout
    moe = plan.params["experts"] > 0
    for row in rows:
        activated, total = _params(row["config"], row.get("set") or "")
        row_moe = total > activated
        distance = (_octaves(plan.world, float(row["world"])) + _octaves(plan.params["activated"], activated)
                    + _octaves(plan.params["total"], total)
                    + 0.5 * sum(_octaves(lay[k], float(row[k])) for k in ("tp", "pp", "ep"))
                    + 2 * (row["gpu"] != gpu.lower()) + 2 * (row_moe != moe))
        if best is None or distance < best[0]:
            best = (distance, row)
    if best is None:
        return None
    distance, row = best
    text = (f"{row['id']} ({row['source']}): {row['published']} {row['metric']} on {row['world']} "
            f"{row['gpu'].upper()}, tp{row['tp']} pp{row['pp']} ep{row['ep']}")
    return {"id": row["id"], "source": row["source"], "published": float(row["published"]),
            "metric": row["metric"], "distance": round(distance, 3), "text": text}
