"""Where each of our parameters lives in a Hugging Face checkpoint, both ways.

Each global parameter of ours is described as a :class:`Source` tree over Hugging Face
tensors: :class:`Take` (one tensor, its dims possibly permuted), :class:`Cat` (parts
concatenated along a dim: q|k|v, gate|up) and :class:`Stack` (one tensor per expert).
Import reads any box of our global tensor from that tree, so a rank reads only the
slices of the safetensors files its shard needs (``get_slice``); export splits a
gathered global tensor back into the Hugging Face tensors with the same tree.

Hugging Face names (what ``save_pretrained`` writes and the Hub holds), per layer
``model.layers.{i}.``: ``self_attn.{q,k,v,o}_proj.weight`` (``.bias`` on q, k, v for
Qwen2-MoE), ``self_attn.{q,k}_norm.weight`` (Qwen3-MoE), ``input_layernorm`` and
``post_attention_layernorm``; the MoE block ``block_sparse_moe.`` (Mixtral) or ``mlp.``
(Qwen) with ``gate.weight`` (router ``[E, H]``) and per-expert ``experts.{e}.`` weights
``w1``/``w3``/``w2`` (Mixtral) or ``gate_proj``/``up_proj``/``down_proj`` (Qwen), each
``[out, in]``; Qwen's ``mlp.shared_expert.*`` and ``mlp.shared_expert_gate.weight``;
dense layers' ``mlp.{gate,up,down}_proj.weight``. DeepSeek-V3's attention is
``self_attn.q_proj`` (no q_lora_rank) or ``q_a_proj``, ``q_a_layernorm``, ``q_b_proj``;
``kv_a_proj_with_mqa``, ``kv_a_layernorm``, ``kv_b_proj``, ``o_proj``; its MoE block
``mlp.`` with the router's ``gate.weight`` and ``gate.e_score_correction_bias`` (our
expert bias, a buffer), per-expert ``gate_proj``/``up_proj``/``down_proj`` and the
ungated ``mlp.shared_experts.*``. DeepSeek-V2's are DeepSeek-V3's names without the
score correction bias; ERNIE-4.5's MoE layers DeepSeek-V3's names, with the bias
``mlp.moe_statics.e_score_correction_bias`` ``[1, E]``. MiniMax-M2's MoE block is
Mixtral's, with ``block_sparse_moe.e_score_correction_bias``. gpt-oss:
``self_attn.{q,k,v,o}_proj.bias``, ``self_attn.sinks``, ``mlp.router.{weight,bias}`` and its
experts fused as ``[in, out]`` (``mlp.experts.gate_up_proj [E, H, 2F]`` with gate and up
interleaved, de-interleaved by :class:`Halves`, ``gate_up_proj_bias``, ``down_proj [E, F, H]``,
``down_proj_bias``), read and written in that form. Transformers 5 holds experts fused in
memory (``mlp.experts.gate_up_proj [E, 2F, H]``, ``mlp.experts.down_proj [E, H, F]``);
checkpoints in that form are read too. Export writes the per-expert form.
"""

from __future__ import annotations

import contextlib
import json
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Optional, Union

import torch
from safetensors import SafetensorError, safe_open

from moe_fold.config import Config, head_dim, moe_layer_flags

__all__ = ["HFWeightError", "SafetensorsFolder", "Source", "Take", "Cat", "Stack", "Copies", "FirstRow", "weight_sources",
           "ignorable_hf_names"]


class HFWeightError(ValueError):
    """A Hugging Face checkpoint whose tensors do not fit the model; names the tensor."""


class SafetensorsFolder:
    """The tensors of a Hugging Face folder: ``model.safetensors``, or the files listed by
    ``model.safetensors.index.json``. Files open on first use and are read lazily."""

    def __init__(self, path: Union[str, os.PathLike]):
        self.path = Path(path)
        index = self.path / "model.safetensors.index.json"
        single = self.path / "model.safetensors"
        self._stack = contextlib.ExitStack()
        self._handles: dict[str, object] = {}
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as err:
                raise HFWeightError(f"{index}: not a safetensors index (JSON with a weight_map): {err!r}") from err
            self.files = {name: self.path / file for name, file in weight_map.items()}
            missing = sorted({f.name for f in self.files.values() if not f.is_file()})
            if missing:
                raise FileNotFoundError(f"{index} lists {', '.join(missing)}, missing from {self.path}")
        elif single.is_file():
            with _open_safetensors(single) as f:
                self.files = {name: single for name in f.keys()}
        else:
            raise FileNotFoundError(f"{self.path} holds neither model.safetensors nor model.safetensors.index.json")
        self.names = frozenset(self.files)

    def __enter__(self) -> "SafetensorsFolder":
        return self

    def __exit__(self, *exc) -> None:
        self._stack.close()

    def _slice(self, name: str):
        if name not in self.files:
            raise HFWeightError(f"{self.path}: the checkpoint has no tensor {name!r}")
        file = str(self.files[name])
        if file not in self._handles:
            self._handles[file] = self._stack.enter_context(_open_safetensors(Path(file)))
        return self._handles[file].get_slice(name)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._slice(name).get_shape())

    def read(self, name: str, offsets: tuple[int, ...], sizes: tuple[int, ...]) -> torch.Tensor:
        """The box ``offsets``/``sizes`` of tensor ``name``; only that box is read."""
        return self._slice(name)[tuple(slice(o, o + n) for o, n in zip(offsets, sizes))]


def _open_safetensors(path: Path):
    try:
        return safe_open(str(path), framework="pt")
    except SafetensorError as err:
        raise HFWeightError(f"{path}: not a readable safetensors file (truncated or damaged?): {err}") from err


@dataclass(frozen=True)
class Take:
    """Our tensor is the Hugging Face tensor ``name`` with dims ``perm``
    (``ours = theirs.permute(perm)``; None: as stored)."""

    name: str
    perm: Optional[tuple[int, ...]] = None

    def names(self) -> list[str]:
        return [self.name]

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shape = hf.shape(self.name)
        return shape if self.perm is None else tuple(shape[p] for p in self.perm)

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        if self.perm is None:
            return hf.read(self.name, offsets, sizes)
        theirs_off, theirs_size = [0] * len(offsets), [0] * len(sizes)
        for ours, theirs in enumerate(self.perm):
            theirs_off[theirs], theirs_size[theirs] = offsets[ours], sizes[ours]
        return hf.read(self.name, tuple(theirs_off), tuple(theirs_size)).permute(self.perm)

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        if self.perm is not None:
            inverse = sorted(range(len(self.perm)), key=self.perm.__getitem__)
            value = value.permute(inverse)
        return [(self.name, value)]


@dataclass(frozen=True)
class Cat:
    """Our tensor is ``parts`` concatenated along ``dim``, of sizes ``sizes`` there."""

    dim: int
    parts: tuple
    sizes: tuple[int, ...]

    def names(self) -> list[str]:
        return [n for p in self.parts for n in p.names()]

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shapes = [p.shape(hf) for p in self.parts]
        for part, shape, size in zip(self.parts, shapes, self.sizes):
            rest = [s for d, s in enumerate(shapes[0]) if d != self.dim]
            if shape[self.dim] != size or [s for d, s in enumerate(shape) if d != self.dim] != rest:
                raise HFWeightError(f"{', '.join(part.names())} has shape {list(shape)}; expected {size} along "
                                    f"dim {self.dim} and the other dims of {', '.join(self.parts[0].names())} "
                                    f"{list(shapes[0])}")
        out = list(shapes[0])
        out[self.dim] = sum(self.sizes)
        return tuple(out)

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        lo, hi = offsets[self.dim], offsets[self.dim] + sizes[self.dim]
        pieces, start = [], 0
        for part, size in zip(self.parts, self.sizes):
            a, b = max(lo, start), min(hi, start + size)
            if a < b:
                off, n = list(offsets), list(sizes)
                off[self.dim], n[self.dim] = a - start, b - a
                pieces.append(part.read(hf, tuple(off), tuple(n)))
            start += size
        return torch.cat(pieces, self.dim)

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [item for part, piece in zip(self.parts, value.split(list(self.sizes), self.dim))
                for item in part.split(piece)]


@dataclass(frozen=True)
class Stack:
    """Our tensor is ``parts`` stacked along a new dim 0 (one part per expert)."""

    parts: tuple

    def names(self) -> list[str]:
        return [n for p in self.parts for n in p.names()]

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shapes = {p.shape(hf) for p in self.parts}
        if len(shapes) != 1:
            raise HFWeightError(f"the experts {', '.join(self.names())} have different shapes {sorted(shapes)}")
        return (len(self.parts),) + shapes.pop()

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        return torch.stack([self.parts[e].read(hf, offsets[1:], sizes[1:])
                            for e in range(offsets[0], offsets[0] + sizes[0])])

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [item for part, piece in zip(self.parts, value.unbind(0)) for item in part.split(piece)]


@dataclass(frozen=True)
class Copies:
    """Our tensor is stored several times (DeepSeek-V3's MTP layers repeat the embedding
    and the head): read from the first part, written to every part."""

    parts: tuple

    def names(self) -> list[str]:
        return [n for p in self.parts for n in p.names()]

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        return self.parts[0].shape(hf)

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        return self.parts[0].read(hf, offsets, sizes)

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [item for part in self.parts for item in part.split(value)]


@dataclass(frozen=True)
class FirstRow:
    """Our tensor is the only row of the Hugging Face tensor ``name`` ``[1, ...]`` (ERNIE-4.5
    stores its expert bias as ``[1, E]``)."""

    name: str

    def names(self) -> list[str]:
        return [self.name]

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shape = hf.shape(self.name)
        if not shape or shape[0] != 1:
            raise HFWeightError(f"{self.name} has shape {list(shape)}; expected a leading dim of 1")
        return shape[1:]

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        return hf.read(self.name, (0,) + tuple(offsets), (1,) + tuple(sizes))[0]

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        return [(self.name, value.unsqueeze(0))]


@dataclass(frozen=True)
class Halves:
    """Our tensor is ``part`` with the pairs along ``dim`` split into two halves: ours =
    ``[part[even] | part[odd]]`` along ``dim`` (gpt-oss interleaves gate and up columns,
    ``g0 u0 g1 u1 ...``; ours are ``[gate | up]``). A read takes the whole of ``dim`` (a
    rank's columns of one half are every other column of theirs) and the box of the rest."""

    part: object
    dim: int

    def names(self) -> list[str]:
        return self.part.names()

    def shape(self, hf: SafetensorsFolder) -> tuple[int, ...]:
        shape = self.part.shape(hf)
        if shape[self.dim] % 2:
            raise HFWeightError(f"{', '.join(self.names())} has {shape[self.dim]} interleaved gate/up entries along "
                                f"dim {self.dim}; an even number is needed")
        return shape

    def _order(self, n: int) -> torch.Tensor:
        return torch.cat([torch.arange(0, n, 2), torch.arange(1, n, 2)])  # ours[i] = theirs[order[i]]

    def read(self, hf: SafetensorsFolder, offsets, sizes) -> torch.Tensor:
        n = self.part.shape(hf)[self.dim]
        off, size = list(offsets), list(sizes)
        off[self.dim], size[self.dim] = 0, n
        whole = self.part.read(hf, tuple(off), tuple(size)).index_select(self.dim, self._order(n))
        return whole.narrow(self.dim, offsets[self.dim], sizes[self.dim])

    def split(self, value: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
        n = value.shape[self.dim]
        return self.part.split(value.index_select(self.dim, torch.argsort(self._order(n))))


Source = Union[Take, Cat, Stack, Copies, FirstRow, Halves]

_T = (1, 0)  # Hugging Face [out, in] <-> our expert layout [in, out]
# Families whose checkpoints name the MoE block block_sparse_moe and the experts w1/w3/w2.
_MIXTRAL_NAMES = ("mixtral", "minimax_m2")


def _swiglu(prefix: str, gate: str, up: str, down: str, ffn: int) -> tuple[Source, Source]:
    """fc1 [gate|up, H] and fc2 of a dense SwiGLU MLP stored as three linears."""
    fc1 = Cat(0, (Take(f"{prefix}{gate}.weight"), Take(f"{prefix}{up}.weight")), (ffn, ffn))
    return fc1, Take(f"{prefix}{down}.weight")


def _experts(prefix: str, family: str, num_experts: int, ffn: int, fused: bool) -> tuple[Source, Source]:
    """fc1 ``[E, H, gate|up]`` and fc2 ``[E, F, H]`` of the routed experts."""
    if fused:
        return Take(f"{prefix}experts.gate_up_proj", (0, 2, 1)), Take(f"{prefix}experts.down_proj", (0, 2, 1))
    gate, up, down = ("w1", "w3", "w2") if family in _MIXTRAL_NAMES else ("gate_proj", "up_proj", "down_proj")
    fc1 = Stack(tuple(Cat(1, (Take(f"{prefix}experts.{e}.{gate}.weight", _T),
                              Take(f"{prefix}experts.{e}.{up}.weight", _T)), (ffn, ffn))
                      for e in range(num_experts)))
    fc2 = Stack(tuple(Take(f"{prefix}experts.{e}.{down}.weight", _T) for e in range(num_experts)))
    return fc1, fc2


# Our MLA parameter (under ``attn.``) -> DeepSeek-V3's tensor (under ``self_attn.``); q.weight
# without q_lora_rank, the three q_* low-rank ones with it.
_MLA = {"q.weight": "q_proj.weight", "q_down.weight": "q_a_proj.weight", "q_norm.weight": "q_a_layernorm.weight",
        "q_up.weight": "q_b_proj.weight", "kv_down.weight": "kv_a_proj_with_mqa.weight",
        "kv_norm.weight": "kv_a_layernorm.weight", "kv_up.weight": "kv_b_proj.weight", "proj.weight": "o_proj.weight"}


def weight_sources(config: Config, family: str, hf_names: frozenset = frozenset()) -> dict[str, Source]:
    """Our parameter (or persistent buffer: the expert bias) name -> its :class:`Source`,
    for a model of ``config`` in the Hugging Face ``family``. ``hf_names`` (the checkpoint's tensor names) tells which
    expert form a checkpoint uses; export passes none and gets the per-expert form.

    MTP depth k (DeepSeek-V3, GLM-4.5) is layer ``num_layers + k`` of the checkpoint: its
    block's tensors as a layer's, ``enorm``, ``hnorm``, ``eh_proj`` and ``shared_head.norm``
    (our ``mtp.{k}.norm``); its ``embed_tokens`` and ``shared_head.head`` are copies of
    the shared embedding and head (:class:`Copies`: read from the model's own, written
    to every copy)."""
    m = config.model
    mtp = range(m.num_layers, m.num_layers + m.mtp_num_layers)

    def copies(name: str) -> tuple:
        # Export writes every copy; import reads the model's own and places the copies it finds.
        names = [f"model.layers.{i}.{name}" for i in mtp]
        return tuple(Take(n) for n in names if not hf_names or n in hf_names)

    embed_copies, head_copies = copies("embed_tokens.weight"), copies("shared_head.head.weight")
    head = Take("model.embed_tokens.weight" if m.tie_embeddings else "lm_head.weight")
    out: dict[str, Source] = {"embed.weight": Copies((Take("model.embed_tokens.weight"),) + embed_copies
                                                     + (head_copies if m.tie_embeddings else ())),
                              "norm.weight": Take("model.norm.weight")}
    if not m.tie_embeddings:
        out["lm_head.weight"] = Copies((head,) + head_copies)
    flags = moe_layer_flags(config)
    for i, is_moe in enumerate(flags):
        out.update(_layer_sources(config, family, f"model.layers.{i}.", f"layers.{i}.", is_moe, hf_names))
    for k, i in enumerate(mtp):
        hf, ours = f"model.layers.{i}.", f"mtp.{k}."
        out[f"{ours}enorm.weight"] = Take(f"{hf}enorm.weight")
        out[f"{ours}hnorm.weight"] = Take(f"{hf}hnorm.weight")
        out[f"{ours}eh_proj.weight"] = Take(f"{hf}eh_proj.weight")
        out[f"{ours}norm.weight"] = Take(f"{hf}shared_head.norm.weight")
        out.update(_layer_sources(config, family, hf, f"{ours}block.", flags[-1], hf_names))
    return out


def _layer_sources(config: Config, family: str, hf: str, ours: str, is_moe: bool,
                   hf_names: frozenset) -> dict[str, Source]:
    """The sources of one block's parameters: ours under ``ours``, theirs under ``hf``."""
    m, moe = config.model, config.moe
    hd = head_dim(config)
    q, kv = m.num_heads * hd, m.num_kv_heads * hd
    out: dict[str, Source] = {}
    attn = f"{hf}self_attn."
    out[f"{ours}attn_norm.weight"] = Take(f"{hf}input_layernorm.weight")
    out[f"{ours}mlp_norm.weight"] = Take(f"{hf}post_attention_layernorm.weight")
    if m.attention == "mla":
        query = ("q.weight",) if m.q_lora_rank is None else ("q_down.weight", "q_norm.weight", "q_up.weight")
        for name in query + ("kv_down.weight", "kv_norm.weight", "kv_up.weight", "proj.weight"):
            out[f"{ours}attn.{name}"] = Take(f"{attn}{_MLA[name]}")
    else:
        out[f"{ours}attn.qkv.weight"] = Cat(0, tuple(Take(f"{attn}{p}_proj.weight") for p in "qkv"), (q, kv, kv))
        out[f"{ours}attn.proj.weight"] = Take(f"{attn}o_proj.weight")
    if m.attention_out_bias:
        out[f"{ours}attn.proj.bias"] = Take(f"{attn}o_proj.bias")
    if m.attention_sinks:
        out[f"{ours}attn.sinks"] = Take(f"{attn}sinks")  # gpt-oss: one logit per query head
    if m.qkv_bias:
        out[f"{ours}attn.qkv.bias"] = Cat(0, tuple(Take(f"{attn}{p}_proj.bias") for p in "qkv"), (q, kv, kv))
    if m.qk_norm and m.qk_norm_scope != "l2":  # Llama-4's L2 norm has no weight
        out[f"{ours}attn.q_norm.weight"] = Take(f"{attn}q_norm.weight")
        out[f"{ours}attn.k_norm.weight"] = Take(f"{attn}k_norm.weight")
    if family == "llama4_text":
        out.update(_llama4_mlp_sources(config, f"{hf}feed_forward.", f"{ours}mlp.", is_moe))
        return out
    if not is_moe:
        fc1, fc2 = _swiglu(f"{hf}mlp.", "gate_proj", "up_proj", "down_proj", m.ffn_hidden_size)
        out[f"{ours}mlp.fc1.weight"], out[f"{ours}mlp.fc2.weight"] = fc1, fc2
        return out
    if family == "gpt_oss":
        out.update(_gpt_oss_moe(f"{hf}mlp.", f"{ours}mlp."))
        return out
    fused = f"{hf}mlp.experts.gate_up_proj" in hf_names
    block = f"{hf}block_sparse_moe." if family in _MIXTRAL_NAMES and not fused else f"{hf}mlp."
    out[f"{ours}mlp.router.weight"] = Take(f"{block}gate.weight")
    out[f"{ours}mlp.experts.fc1"], out[f"{ours}mlp.experts.fc2"] = _experts(
        block, family, moe.num_experts, moe.ffn_hidden_size, fused)
    if family == "minimax_m2":
        out[f"{ours}mlp.router.expert_bias"] = Take(f"{block}e_score_correction_bias")
    if family in ("deepseek_v2", "deepseek_v3", "glm4_moe", "ernie4_5_moe"):
        # DeepSeek-V2's softmax router has no score correction bias; ERNIE-4.5's is [1, E].
        if family in ("deepseek_v3", "glm4_moe"):
            out[f"{ours}mlp.router.expert_bias"] = Take(f"{block}gate.e_score_correction_bias")
        elif family == "ernie4_5_moe":
            out[f"{ours}mlp.router.expert_bias"] = FirstRow(f"{block}moe_statics.e_score_correction_bias")
        fc1, fc2 = _swiglu(f"{hf}mlp.shared_experts.", "gate_proj", "up_proj", "down_proj",
                           moe.shared_expert_ffn_hidden_size)
        out[f"{ours}mlp.shared_expert.fc1.weight"], out[f"{ours}mlp.shared_expert.fc2.weight"] = fc1, fc2
    elif moe.shared_expert_ffn_hidden_size > 0:
        fc1, fc2 = _swiglu(f"{hf}mlp.shared_expert.", "gate_proj", "up_proj", "down_proj",
                           moe.shared_expert_ffn_hidden_size)
        out[f"{ours}mlp.shared_expert.fc1.weight"], out[f"{ours}mlp.shared_expert.fc2.weight"] = fc1, fc2
        out[f"{ours}mlp.shared_expert_gate"] = Take(f"{hf}mlp.shared_expert_gate.weight")
    return out


def _gpt_oss_moe(hf: str, ours: str) -> dict[str, Source]:
    """gpt-oss's MoE block: a router with bias, and experts stored fused as ``[in, out]``
    (our layout) with biases, gate and up interleaved in ``gate_up_proj`` and its bias."""
    return {f"{ours}router.weight": Take(f"{hf}router.weight"), f"{ours}router.bias": Take(f"{hf}router.bias"),
            f"{ours}experts.fc1": Halves(Take(f"{hf}experts.gate_up_proj"), 2),  # [E, H, 2F]
            f"{ours}experts.fc1_bias": Halves(Take(f"{hf}experts.gate_up_proj_bias"), 1),  # [E, 2F]
            f"{ours}experts.fc2": Take(f"{hf}experts.down_proj"),  # [E, F, H]
            f"{ours}experts.fc2_bias": Take(f"{hf}experts.down_proj_bias")}  # [E, H]


def _llama4_mlp_sources(config: Config, hf: str, ours: str, is_moe: bool) -> dict[str, Source]:
    """Llama-4's ``feed_forward.``: a dense SwiGLU, or the router, the experts stored fused
    in our own layout (``experts.gate_up_proj [E, H, gate|up]``, ``experts.down_proj
    [E, F, H]``) and the ungated shared expert."""
    if not is_moe:
        fc1, fc2 = _swiglu(hf, "gate_proj", "up_proj", "down_proj", config.model.ffn_hidden_size)
        return {f"{ours}fc1.weight": fc1, f"{ours}fc2.weight": fc2}
    fc1, fc2 = _swiglu(f"{hf}shared_expert.", "gate_proj", "up_proj", "down_proj",
                       config.moe.shared_expert_ffn_hidden_size)
    return {f"{ours}router.weight": Take(f"{hf}router.weight"),
            f"{ours}experts.fc1": Take(f"{hf}experts.gate_up_proj"),
            f"{ours}experts.fc2": Take(f"{hf}experts.down_proj"),
            f"{ours}shared_expert.fc1.weight": fc1, f"{ours}shared_expert.fc2.weight": fc2}


def ignorable_hf_names(config: Config, hf_names: frozenset) -> set[str]:
    """Checkpoint tensors that hold nothing our model computes with: rotary frequency
    buffers some old checkpoints stored, a tied LM head saved beside the embedding, and
    a Qwen2-MoE shared expert of width 0 (its output is exactly zero)."""
    out = {n for n in hf_names if n.endswith("rotary_emb.inv_freq")}
    if config.model.tie_embeddings and "lm_head.weight" in hf_names:
        out.add("lm_head.weight")
    if config.moe.shared_expert_ffn_hidden_size == 0:
        out |= {n for n in hf_names if ".mlp.shared_expert" in n}
    return out
