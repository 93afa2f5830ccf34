"""Write our model as a Hugging Face folder that ``from_pretrained`` loads.

A collective: every rank calls :func:`to_hf`. Parameters are gathered one at a time
(:func:`moe_fold.parallel.sharding.full_tensor`, over the ranks of a pipeline stage),
split into the Hugging Face tensors (:mod:`.weights`) and handed to rank 0 (under pp,
each later stage's first rank sends its global tensors to rank 0 one at a time), which writes them into safetensors shards of at
most ``max_shard_bytes`` as they fill, so no rank holds more than one global parameter
and one shard besides its own model. One shard is ``model.safetensors``; more are
``model-0000k-of-0000n.safetensors`` with ``model.safetensors.index.json``.
"""

from __future__ import annotations

import json
import os
import secrets
from pathlib import Path
from typing import Callable, Optional, Union

import torch
import torch.distributed as dist
from safetensors.torch import save_file
from torch import nn

from moe_fold.layout import ProcessGroups
from moe_fold.parallel.sharding import buffer_info, full_tensor, shard_info

from .config_map import config_to_hf, export_family
from .weights import HFWeightError, weight_sources

__all__ = ["to_hf", "write_generation_config", "DEFAULT_SHARD_BYTES"]

DEFAULT_SHARD_BYTES = 5 * 2**30
_INDEX = "model.safetensors.index.json"


class _ShardWriter:
    """Collects tensors and writes a shard whenever the next tensor would overflow it."""

    def __init__(self, path: Path, max_bytes: int):
        self.path, self.max_bytes = path, max_bytes
        self.nonce = secrets.token_hex(4)
        self.pending: dict[str, torch.Tensor] = {}
        self.pending_bytes = 0
        self.shards: list[tuple[Path, list[str]]] = []
        self.total = 0

    def add(self, name: str, tensor: torch.Tensor) -> None:
        size = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + size > self.max_bytes:
            self._flush()
        # A contiguous copy of its own: safetensors refuses views that share storage.
        self.pending[name] = tensor.clone(memory_format=torch.contiguous_format)
        self.pending_bytes += size
        self.total += size

    def _flush(self) -> None:
        tmp = self.path / f".model-{len(self.shards):05d}.tmp-{self.nonce}.safetensors"
        save_file(self.pending, str(tmp), metadata={"format": "pt"})
        self.shards.append((tmp, list(self.pending)))
        self.pending, self.pending_bytes = {}, 0

    def finish(self) -> None:
        """Rename the shards to their final names (after removing an earlier export's)."""
        if self.pending or not self.shards:
            self._flush()
        for old in list(self.path.glob("model*.safetensors")) + [self.path / _INDEX]:
            if old.exists():
                old.unlink()
        n = len(self.shards)
        if n == 1:
            os.replace(self.shards[0][0], self.path / "model.safetensors")
            return
        weight_map = {}
        for k, (tmp, names) in enumerate(self.shards):
            final = f"model-{k + 1:05d}-of-{n:05d}.safetensors"
            os.replace(tmp, self.path / final)
            weight_map.update((name, final) for name in names)
        index = {"metadata": {"total_size": self.total}, "weight_map": dict(sorted(weight_map.items()))}
        _write_json(self.path / _INDEX, index)


def _add(writer: _ShardWriter, source, full: torch.Tensor) -> None:
    for hf_name, tensor in source.split(full.cpu()):
        writer.add(hf_name, tensor)


def _write_json(path: Path, obj: dict) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{secrets.token_hex(4)}")
    tmp.write_text(json.dumps(obj, indent=2) + "\n")
    os.replace(tmp, path)


def write_generation_config(path: Union[str, os.PathLike], special_ids: dict[str, int]) -> None:
    """``generation_config.json``: the tokenizer's ``bos_token_id``, ``eos_token_id`` and
    ``pad_token_id`` (``generate`` stops at eos), greedy by default like ``moe-fold sample``."""
    _write_json(Path(path) / "generation_config.json", {**special_ids, "do_sample": False})


@torch.no_grad()
def to_hf(model: nn.Module, path: Union[str, os.PathLike], *, family: Optional[str] = None,
          groups: Optional[ProcessGroups] = None, max_shard_bytes: int = DEFAULT_SHARD_BYTES,
          on_tensor: Optional[Callable[[str, int], None]] = None) -> Path:
    """Write ``model`` (this rank's shard of it; every rank calls this) as a Hugging Face
    folder at ``path``: ``config.json`` and safetensors in the per-expert layout of
    ``family`` (default :func:`~moe_fold.models.hf.config_map.export_family`), the
    parameters' dtype. Rank 0 writes; the others return once the folder is complete.
    ``on_tensor(name, numel)`` is called after each parameter. Raises
    :class:`~moe_fold.models.hf.config_map.HFConfigError` on every rank, before any
    communication, when the family cannot hold the model."""
    groups = groups if groups is not None else model.groups
    config = model.config
    family = family or export_family(config)
    params = dict(model.named_parameters())
    dtypes = {p.dtype for p in params.values()}
    if len(dtypes) != 1:
        raise HFWeightError(f"the model's parameters have several dtypes {sorted(map(str, dtypes))}; cast the "
                            f"model to one before export")
    dtype = dtypes.pop()
    hf_config = config_to_hf(config, family, dtype=str(dtype).removeprefix("torch."))
    sources = weight_sources(config, family)
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)}
    state = model.state_dict(keep_vars=True)
    buffers = {n: state[n] for n in state if n not in aliases}  # persistent: the expert bias
    extra = sorted((set(params) | set(buffers)) - set(sources))
    if extra:
        raise HFWeightError(f"the {family} format has no place for the model's {', '.join(extra)}")
    path = Path(path)
    writer = None
    if groups.rank == 0:
        path.mkdir(parents=True, exist_ok=True)
        writer = _ShardWriter(path, max_shard_bytes)
    pp, stage = groups.size("pp"), groups.rank_in("pp")
    # This stage's leader (tp, dp and cp coordinate 0) hands its global tensors to rank 0.
    leader = groups.rank_in("tp_dp_cp") == 0
    # A buffer keeps its own dtype (DeepSeek-V3's score correction bias stays float32).
    # The last stage's copy of a tied embedding is the first stage's: exported once.
    local = [(name, t) for name, t in list(params.items()) + list(buffers.items())
             if not (stage > 0 and getattr(t, "tied_copy", False))]
    if leader and stage > 0:
        dist.send_object_list([len(local)], dst=0)
    for name, param in local:
        info = shard_info(param, groups, name) if name in params else buffer_info(param, groups)
        full = full_tensor(param.detach(), info, groups)
        if writer is not None:
            _add(writer, sources[name], full)
        elif leader and stage > 0:
            dist.send_object_list([name, full.cpu()], dst=0)
        del full
        if on_tensor is not None:
            on_tensor(name, param.numel())
    if writer is not None:
        # Then every later stage's tensors, one at a time, from its leader.
        for later in range(1, pp):
            src = dist.get_global_rank(groups.pp, later)
            count = [None]
            dist.recv_object_list(count, src=src)
            for _ in range(count[0]):
                item = [None, None]
                dist.recv_object_list(item, src=src)
                _add(writer, sources[item[0]], item[1])
    if writer is not None:
        writer.finish()
        _write_json(path / "config.json", hf_config)
    if groups.layout.world_size > 1 and dist.is_available() and dist.is_initialized():
        dist.barrier()
    return path
