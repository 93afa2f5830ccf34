"""Is a checkpoint whole? Files against the manifest, and every expert of every MoE layer.

A checkpoint's ``index.json`` is its manifest (:mod:`moe_fold.training.checkpoint`): the
sha256 and size of every file, and for every tensor the pieces that hold it (file, global
offsets, sizes), signed with its own sha256. :func:`verify_checkpoint` checks that
signature (:func:`~moe_fold.training.checkpoint.read_index`), each listed file (present,
size, sha256) and then, for each MoE layer of the checkpoint's model (its ``config.yaml``),
that every expert's slice of every expert tensor (``model/layers.<i>.mlp.experts.fc1``,
``fc2``, and their AdamW moments when the optimizer was saved) is fully covered by pieces
in good files. An expert is missing when its tensor is absent from the index, when a
piece of it was dropped from the index, or when a file holding it is missing or corrupt
(under ep each rank's shard holds its own experts, so a lost shard loses experts).

``moe-fold checkpoint verify`` prints the report; ``moe-fold convert`` (checkpoint ->
Hugging Face) refuses a checkpoint with a missing expert.
"""

from __future__ import annotations

import re
from dataclasses import dataclass, field
from pathlib import Path
from typing import Optional, Union

from moe_fold.config import ConfigError, load_config, moe_layer_flags
from moe_fold.training.checkpoint import CheckpointError, file_problem, read_index

__all__ = ["CheckpointReport", "verify_checkpoint"]

_EXPERT_TENSOR = re.compile(r"(?:model|optim/exp_avg|optim/exp_avg_sq)/layers\.(\d+)\.mlp\.experts\.(fc1|fc2|fc1_bias|fc2_bias)")


@dataclass
class CheckpointReport:
    """What :func:`verify_checkpoint` found in one checkpoint directory."""

    path: Path
    files_checked: int = 0
    bad_files: dict[str, str] = field(default_factory=dict)  # file name -> what is wrong
    problems: list[str] = field(default_factory=list)  # the index itself, the config
    moe_layers: list[int] = field(default_factory=list)
    num_experts: int = 0
    # layer -> {expert: [tensor names whose slice of that expert is incomplete]}
    missing_experts: dict[int, dict[int, list[str]]] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        return not (self.bad_files or self.problems or self.missing_experts)

    def expert_message(self) -> str:
        """One line per layer with missing experts, naming the experts and a tensor."""
        lines = []
        for layer, experts in sorted(self.missing_experts.items()):
            names = sorted({n for ns in experts.values() for n in ns})
            lines.append(f"layer {layer}: experts {sorted(experts)} of {self.num_experts} missing "
                         f"(in {', '.join(names[:3])}{' ...' if len(names) > 3 else ''})")
        return "; ".join(lines)

    def lines(self) -> list[str]:
        """The report for a person: a status line, then one line per problem."""
        if self.ok:
            experts = (f"{len(self.moe_layers)} MoE layers x {self.num_experts} experts present"
                       if self.moe_layers else "no MoE layer")
            return [f"{self.path}: OK ({self.files_checked} files match the manifest; {experts})"]
        out = [f"{self.path}: DAMAGED"]
        out += [f"  {problem}" for problem in self.problems]
        out += [f"  file {name} {what}" for name, what in sorted(self.bad_files.items())]
        for layer, experts in sorted(self.missing_experts.items()):
            for expert, names in sorted(experts.items()):
                out.append(f"  layer {layer} expert {expert}: missing from {', '.join(names)}")
        return out


def verify_checkpoint(path: Union[str, Path], checksums: bool = True) -> CheckpointReport:
    """Check checkpoint directory ``path`` (see the module docstring). ``checksums=False``
    checks presence and sizes only (fast); a report, never an exception for damage."""
    report = CheckpointReport(Path(path))
    try:
        index = read_index(report.path)
    except CheckpointError as err:
        report.problems.append(str(err))
        return report
    files = index.get("files", {})
    for name, record in files.items():
        problem = file_problem(report.path / name, record, checksum=checksums)
        if problem is not None:
            report.bad_files[name] = problem
    report.files_checked = len(files)
    _check_experts(report, index)
    return report


def _expected_expert_tensors(report: CheckpointReport, index: dict) -> Optional[dict[str, int]]:
    """Expert tensor name -> layer, for every MoE layer of the checkpoint's config (its
    ``config.yaml``; without one, the expert tensors the index lists)."""
    stored = index["tensors"]
    config_path = report.path / "config.yaml"
    if not config_path.is_file():
        found = {name: int(m.group(1)) for name in stored if (m := _EXPERT_TENSOR.fullmatch(name))}
        report.moe_layers = sorted(set(found.values()))
        report.num_experts = max((stored[n]["shape"][0] for n in found), default=0)
        return found
    try:
        config = load_config(config_path)
        flags = moe_layer_flags(config)
    except (ConfigError, OSError) as err:
        report.problems.append(f"cannot read {config_path}: {err}")
        return None
    report.moe_layers = [i for i, moe in enumerate(flags) if moe]
    report.num_experts = config.moe.num_experts
    prefixes = ["model/"]
    if index.get("optimizer") is not None:
        prefixes += ["optim/exp_avg/", "optim/exp_avg_sq/"]
    # gpt-oss's experts also hold per-expert biases (moe.expert_linear_bias).
    fcs = ("fc1", "fc2", "fc1_bias", "fc2_bias") if config.moe.expert_linear_bias else ("fc1", "fc2")
    return {f"{prefix}layers.{layer}.mlp.experts.{fc}": layer
            for layer in report.moe_layers for prefix in prefixes for fc in fcs}


def _check_experts(report: CheckpointReport, index: dict) -> None:
    expected = _expected_expert_tensors(report, index)
    if expected is None:
        return
    stored = index["tensors"]
    for name, layer in expected.items():
        entry = stored.get(name)
        if entry is None:
            missing = range(report.num_experts)
        else:
            missing = _incomplete_experts(entry, report.bad_files)
        for expert in missing:
            report.missing_experts.setdefault(layer, {}).setdefault(expert, []).append(name)


def _incomplete_experts(entry: dict, bad_files: dict[str, str]) -> list[int]:
    """The experts (rows of dim 0 of ``[E, ...]``) not fully covered by pieces in good files."""
    shape = entry["shape"]
    per_expert = 1
    for s in shape[1:]:
        per_expert *= s
    covered = [0] * shape[0]
    for piece in entry["pieces"]:
        if piece["file"] in bad_files:
            continue
        rest = 1
        for s in piece["sizes"][1:]:
            rest *= s
        first = piece["offsets"][0]
        for expert in range(first, first + piece["sizes"][0]):
            covered[expert] += rest
    return [e for e, n in enumerate(covered) if n != per_expert]
