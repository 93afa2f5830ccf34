"""The cache of sampling: each attention layer keeps the keys and values of the tokens
seen so far, so a decode step projects and attends only the new tokens; each Gated
DeltaNet layer keeps, instead, its conv window (the last ``linear_conv_kernel - 1`` conv
inputs) and its recurrent state after them.

A rank caches the kv heads it owns (``num_kv_heads/tp`` under tp) for the layers of its
pipeline stages. Keys are stored after rotary, so a cached key never changes. A block
with two attention sublayers (``model.block: shortcut_moe``) keeps the second one's in
:meth:`LayerCache.sublayer`.
"""

from __future__ import annotations

from typing import Optional

import torch
import torch.nn.functional as F

__all__ = ["LayerCache", "KVCache", "cached_attention"]


class LayerCache:
    """One layer's keys and values ``[B, kv_heads, length, head_dim]`` (attention), or conv
    window ``[K-1, B, C]`` and recurrent state ``[B, heads, dk, dv]`` (Gated DeltaNet); None
    before the first step. ``new_tokens``: how many of a step's tokens are real (the rest
    are its padding, which a recurrent state must not take in)."""

    def __init__(self):
        self.keys: Optional[torch.Tensor] = None
        self.values: Optional[torch.Tensor] = None
        self.conv: Optional[torch.Tensor] = None
        self.state: Optional[torch.Tensor] = None
        self.index_keys: Optional[torch.Tensor] = None  # DSA's indexer keys [B, length, d]
        self.new_tokens = 0
        self._sublayers: dict[int, LayerCache] = {}

    def sublayer(self, index: int) -> "LayerCache":
        """The cache of attention sublayer ``index >= 1`` of this layer's block (LongCat-Flash's
        blocks hold two; this cache is sublayer 0's), made on first use."""
        if index not in self._sublayers:
            self._sublayers[index] = LayerCache()
            self._sublayers[index].new_tokens = self.new_tokens
        return self._sublayers[index]

    def begin(self, new_tokens: int) -> None:
        """A step of ``new_tokens`` real tokens starts (see :meth:`KVCache.begin`)."""
        self.new_tokens = new_tokens
        for cache in self._sublayers.values():
            cache.begin(new_tokens)

    @property
    def length(self) -> int:
        return 0 if self.keys is None else self.keys.shape[2]

    def append(self, k: torch.Tensor, v: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Add the new tokens' ``k``, ``v`` ``[B, kv_heads, n, head_dim]``; returns every
        cached token's ``[B, kv_heads, length + n, head_dim]``."""
        if self.keys is None:
            self.keys, self.values = k, v
        else:
            self.keys = torch.cat([self.keys, k], dim=2)
            self.values = torch.cat([self.values, v], dim=2)
        return self.keys, self.values

    def append_index_keys(self, k: torch.Tensor) -> torch.Tensor:
        """Add the new tokens' DSA indexer keys ``[B, n, d]``; returns every cached token's."""
        self.index_keys = k if self.index_keys is None else torch.cat([self.index_keys, k], dim=1)
        return self.index_keys

    def truncate(self, length: int) -> None:
        """Keep the first ``length`` tokens (drops the padding a decode step added)."""
        if self.keys is not None:
            self.keys, self.values = self.keys[:, :, :length], self.values[:, :, :length]
        for cache in self._sublayers.values():
            cache.truncate(length)
        if self.index_keys is not None:
            self.index_keys = self.index_keys[:, :length]


class KVCache:
    """This rank's :class:`LayerCache` of each of its layers, by global layer index."""

    def __init__(self, layer_ids: list[int]):
        self.layers = {i: LayerCache() for i in layer_ids}
        self.length = 0  # tokens every layer holds

    def __getitem__(self, layer: int) -> LayerCache:
        return self.layers[layer]

    def begin(self, new_tokens: int) -> None:
        """A step of ``new_tokens`` real tokens starts (padding may follow them)."""
        for cache in self.layers.values():
            cache.begin(new_tokens)

    def truncate(self, length: int) -> None:
        for cache in self.layers.values():
            cache.truncate(length)
        self.length = length


def cached_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, scale: Optional[float] = None) -> torch.Tensor:
    """Causal attention of the newest ``n`` tokens over all ``L`` cached ones:
    ``q [B, heads, n, hd]``, ``k``/``v`` ``[B, kv_heads, L, hd]`` (the last ``n`` of them are
    the queries' own; v's head width may differ, MLA) -> ``[B, heads, n, hd_v]``. Query
    ``i`` sits at position ``L - n + i`` and sees keys ``0 .. L - n + i``. ``scale``
    defaults to ``1/sqrt(hd)``."""
    n, length = q.shape[2], k.shape[2]
    # Query head h reads kv head h // (heads / kv_heads), as in training and Hugging Face.
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)  # [B, heads, L, hd]
    positions = torch.arange(length - n, length, device=q.device)
    mask = torch.arange(length, device=q.device)[None, :] <= positions[:, None]  # [n, L]
    return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale)
