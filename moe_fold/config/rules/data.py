"""Rules of the data: the dataset paths and their weights, the tokenizer, the end-of-document
id, and the validation set."""

from __future__ import annotations

from ..derived import data_paths
from ..schema import Config, _fmt


def _check_validation_data(config: Config, out: list[str]) -> None:
    """Another dataset or a held-out fraction of the training data, for train.eval_every."""
    t, d = config.train, config.data
    if not 0 <= d.valid_fraction < 1:
        out.append(f"data.valid_fraction={_fmt(d.valid_fraction)} must be in [0, 1)")
    if d.valid_path is not None and d.valid_fraction > 0:
        out.append(f"data.valid_path={_fmt(d.valid_path)} and data.valid_fraction={_fmt(d.valid_fraction)} are "
                   f"exclusive: validate on another dataset or on a held-out fraction of the training data")
    if d.valid_path == "":
        out.append("data.valid_path='' must be a dataset path, or null")
    if t.eval_every > 0 and d.valid_path is None and not d.valid_fraction > 0:
        out.append(f"train.eval_every={t.eval_every} needs validation data: set data.valid_path or "
                   f"data.valid_fraction > 0")


def _check_data(config: Config, out: list[str]) -> None:
    d = config.data
    paths = data_paths(config)
    if isinstance(d.path, list) and not paths:
        out.append("data.path=[] must name at least one dataset, or be null for the demo corpus")
    for i, path in enumerate(paths if isinstance(d.path, list) else []):
        if not path:
            out.append(f"data.path[{i}]='' must be a dataset path")
    if d.path == "":
        out.append("data.path='' must be a dataset path, or null for the demo corpus")
    if d.weights is not None:
        if d.path is None:
            out.append(f"data.weights={_fmt(d.weights)} is set but data.path is null")
        elif len(d.weights) != len(paths):
            out.append(f"data.weights has {len(d.weights)} entries, expected one per data.path entry ({len(paths)})")
        for i, weight in enumerate(d.weights):
            if not weight > 0:
                out.append(f"data.weights[{i}]={_fmt(weight)} must be > 0")
    if not d.tokenizer:
        out.append("data.tokenizer='' must be byte or a path to a tokenizer.json")
    if d.eod_id is not None and not 0 <= d.eod_id < config.model.vocab_size:
        out.append(f"data.eod_id={d.eod_id} must be in [0, model.vocab_size={config.model.vocab_size})")
    if not d.text_key:
        out.append("data.text_key='' must name the text column or JSONL field")
