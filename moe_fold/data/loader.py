"""Training samples from indexed datasets: fixed-length or packed samples, a seeded
shuffle, blending by weight, sharding over dp, a resumable position, cp zigzag slices.

A sample is ``seq_length + 1`` tokens: inputs ``tokens[:-1]``, labels ``tokens[1:]``.
Its ``cu_seqlens`` are the starts of the segments attention is confined to (then
``seq_length``), and ``positions`` restart at 0 at each segment:

- fixed-length (``packing=False``): samples tile the concatenated token stream (every
  document ends with eod); a sample is one segment, attention runs across documents,
  every label counts (GPT-2/Megatron default). With ``reset_at_documents`` each
  document (part) inside the sample is its own segment instead, and the label that is
  the next document's first token has loss_mask 0 (Megatron's reset_attention_mask,
  reset_position_ids).
- packed (``packing=True``): whole documents are packed in order into samples, a
  document longer than a sample is cut into sample-sized pieces, the tail is padded.
  Each piece is a segment; the label after a piece's last token (the next document's
  first token, or padding) has loss_mask 0. The padding is a segment of its own and
  ``token_mask`` marks it (False), so MoE routers leave it out of their losses and counts.

Under cp each rank takes its zigzag slice of every per-token field; ``cu_seqlens`` keeps
describing the whole sequence (the model derives every rank's document ids from it).

Samples are indexed by a global sample number ``i >= 0``: epoch ``i // len(ds)`` uses
its own permutation of the epoch's samples, drawn from ``(seed, epoch)``, by one of two
shuffles (:data:`SHUFFLES`). ``feistel``, what a run starts with, finds the sample at a
place from the place alone: a keyed bijection of ``[0, len(ds))`` (a Feistel network on
the bits of the place, walked until it falls inside), so no rank holds an array the size
of an epoch (8 bytes a sample: 29 GB for 15 trillion tokens of 4096). ``permutation``
is numpy's permutation of the whole epoch, the order of runs whose checkpoints predate
``feistel``: the loader's position records its shuffle, and a checkpoint without one
resumes in that order.

Validation: ``data.valid_fraction`` holds out the last documents of each dataset
(:func:`split_documents`; a :class:`GPTDataset` can take a range of documents), or
``data.valid_path`` names another dataset (:func:`validation_dataset_from_config`).
"""

from __future__ import annotations

import math
import os
from dataclasses import dataclass, fields
from typing import Iterator, Optional, Sequence

import numpy as np
import torch

from moe_fold.config import Config, batch_over_dp, require
from moe_fold.parallel.context_parallel import zigzag_positions, zigzag_split
from moe_fold.data.indexed_dataset import IndexedDataset
from moe_fold.data.sources import check_block, open_tokens

SHUFFLES = ("permutation", "feistel")
SHUFFLE = "feistel"  # what a new run uses
_ROUNDS = 4


def _mix(x: np.ndarray, key: int) -> np.ndarray:
    """A keyed 64-bit mix of ``x`` (uint64; splitmix64's finaliser on ``x + key``)."""
    with np.errstate(over="ignore"):
        z = x + np.uint64(key)
        z = (z ^ (z >> np.uint64(30))) * np.uint64(0xBF58476D1CE4E5B9)
        z = (z ^ (z >> np.uint64(27))) * np.uint64(0x94D049BB133111EB)
        return z ^ (z >> np.uint64(31))


def feistel_order(places: np.ndarray, n: int, seed: int, epoch: int) -> np.ndarray:
    """The samples at ``places`` (ints in ``[0, n)``) of epoch ``epoch``'s ``feistel``
    shuffle: a bijection of ``[0, n)`` keyed by ``(seed, epoch)``. A balanced Feistel
    network permutes the ``2h``-bit numbers (``4^h >= n``, so fewer than 4n); a place
    whose image falls at or past ``n`` is mapped again until it lands inside (cycle
    walking keeps it a bijection of ``[0, n)``)."""
    half = max(1, (max(n - 1, 1).bit_length() + 1) // 2)
    low = np.uint64((1 << half) - 1)
    keys = [int(k) for k in np.random.SeedSequence([seed, epoch]).generate_state(_ROUNDS, np.uint64)]
    x = np.asarray(places, dtype=np.uint64).copy()
    todo = np.ones(x.shape, dtype=bool)
    while todo.any():
        left, right = x[todo] >> np.uint64(half), x[todo] & low
        for key in keys:
            left, right = right, left ^ (_mix(right, key) & low)
        x[todo] = (left << np.uint64(half)) | right
        todo &= x >= np.uint64(n)
    return x.astype(np.int64)


@dataclass
class Sample:
    tokens: np.ndarray  # int64 [S+1]
    loss_mask: np.ndarray  # float32 [S], weight of the label tokens[t+1]
    positions: np.ndarray  # int64 [S]
    cu_seqlens: np.ndarray  # int32 [segments+1], 0 ... S
    token_mask: Optional[np.ndarray] = None  # bool [S], True for real input tokens (False: padding); None: all


class GPTDataset:
    """Shuffled fixed-length or packed samples of one indexed dataset; see the module docstring."""

    def __init__(self, source, seq_length: int, seed: int,
                 packing: bool = False, pad_id: int | None = None, reset_at_documents: bool = False,
                 documents: Optional[tuple[int, int]] = None, vocab_limit: Optional[int] = None,
                 shuffle: str = SHUFFLE):
        """``source``: a moe-fold dataset prefix, or any reader of :mod:`moe_fold.data.sources`.
        ``documents=(first, stop)``: only those documents (a train/validation split,
        :func:`split_documents`); None: all. ``vocab_limit``: every sample read is checked
        to hold ids in ``[0, vocab_limit)`` (the model's vocabulary). ``shuffle``: one of
        :data:`SHUFFLES` (the module docstring)."""
        if seq_length < 1:
            raise ValueError(f"seq_length={seq_length} must be >= 1")
        self.set_shuffle(shuffle)
        self.indexed = IndexedDataset(source) if isinstance(source, (str, os.PathLike)) else source
        self.seq_length, self.seed, self.packing = seq_length, seed, packing
        self.reset_at_documents = reset_at_documents
        self.vocab_size = self.indexed.vocab_size if self.indexed.vocab_size is not None else vocab_limit
        self.vocab_limit = vocab_limit
        # Padding is always loss-masked, so eod is a safe default filler.
        self.pad_id = self.indexed.eod_id if pad_id is None else pad_id
        if documents is None and not packing:
            # The whole token stream: no need for the document offsets (a flat token file
            # finds them with a pass over every token).
            self._documents, self._base, n_tokens = None, 0, self.indexed.num_tokens
        else:
            num_docs = self.indexed.num_docs
            self._documents = (0, num_docs) if documents is None else tuple(documents)
            if not 0 <= self._documents[0] < self._documents[1] <= num_docs:
                raise ValueError(f"documents={list(self._documents)} must be a non-empty range of the "
                                 f"{num_docs} documents of {self.indexed.prefix}")
            # Token offsets in the .bin of the first document and past the last one.
            self._base = int(self.indexed.offsets[self._documents[0]])
            n_tokens = int(self.indexed.offsets[self._documents[1]]) - self._base
        if packing:
            self._pack()
            self.num_samples = len(self._bin_piece) - 1
        else:
            self.num_samples = (n_tokens - 1) // seq_length
        if self.num_samples < 1:
            raise ValueError(f"dataset {self.indexed.prefix} has {n_tokens} tokens"
                             f"{'' if documents is None else f' in documents {list(self.documents)}'}, too few "
                             f"for one sample of seq_length+1={seq_length + 1} tokens")

    @property
    def documents(self) -> tuple[int, int]:
        """The documents ``[first, stop)`` this dataset samples from."""
        return self._documents if self._documents is not None else (0, self.indexed.num_docs)

    def _pack(self) -> None:
        """Cut documents into pieces of at most S+1 tokens and fill samples next-fit, in
        order: a sample is then one contiguous slice of the token stream."""
        cap = self.seq_length + 1
        lengths = self.indexed.lengths[self.documents[0]:self.documents[1]]  # [docs]
        pieces_per_doc = np.maximum(1, -(-lengths // cap))
        doc_of_piece = np.repeat(np.arange(len(lengths)), pieces_per_doc)
        first_piece = np.cumsum(pieces_per_doc) - pieces_per_doc
        k = np.arange(len(doc_of_piece)) - first_piece[doc_of_piece]  # piece number in its document
        piece_len = np.minimum(cap, lengths[doc_of_piece] - k * cap)
        piece_len = piece_len[piece_len > 0]
        self._piece_start = self._base + np.concatenate([[0], np.cumsum(piece_len)])  # token offsets, [pieces+1]
        bins = [0]
        fill = 0
        for i, n in enumerate(piece_len.tolist()):
            if fill + n > cap:
                bins.append(i)
                fill = 0
            fill += n
        bins.append(len(piece_len))
        self._bin_piece = np.asarray(bins, dtype=np.int64)  # bin b holds pieces [bins[b], bins[b+1])

    def __len__(self) -> int:
        """Samples in one epoch."""
        return self.num_samples

    def set_shuffle(self, shuffle: str) -> None:
        """Order the epochs by ``shuffle``, one of :data:`SHUFFLES`."""
        if shuffle not in SHUFFLES:
            raise ValueError(f"shuffle={shuffle!r} must be one of {', '.join(SHUFFLES)}")
        self.shuffle = shuffle
        self._perms: dict[int, np.ndarray] = {}

    def _perm(self, epoch: int) -> np.ndarray:
        if epoch not in self._perms:
            if len(self._perms) >= 2:
                self._perms.pop(next(iter(self._perms)))
            self._perms[epoch] = np.random.default_rng([self.seed, epoch]).permutation(self.num_samples)
        return self._perms[epoch]

    def _order(self, epoch: int, places: np.ndarray) -> np.ndarray:
        """The unshuffled samples at ``places`` of ``epoch``."""
        if self.shuffle == "permutation":
            return self._perm(epoch)[places]
        return feistel_order(places, self.num_samples, self.seed, epoch)

    def sample_order(self, epoch: int) -> np.ndarray:
        """Which unshuffled sample comes at each place of ``epoch``."""
        return self._order(epoch, np.arange(self.num_samples)).copy()

    def __getitem__(self, i: int) -> Sample:
        if i < 0:
            raise IndexError(f"sample index {i} must be >= 0")
        j = int(self._order(i // self.num_samples, np.asarray([i % self.num_samples]))[0])
        return self.raw_sample(j)

    def _read(self, first: int, stop: int) -> np.ndarray:
        """Tokens ``[first, stop)`` of the stream as int64, checked against the vocabulary
        (a cheap max over a sample; a bad id would index outside the embedding)."""
        raw = np.asarray(self.indexed.tokens[first:stop])
        if self.vocab_limit is not None and raw.size:
            lo, hi = raw.min(), raw.max()
            if lo < 0 or hi >= self.vocab_limit or raw.dtype.kind == "f":
                check_block(self.indexed, raw, first, self.vocab_limit)
        return raw.astype(np.int64)

    def raw_sample(self, j: int) -> Sample:
        """Sample ``j`` before shuffling."""
        S = self.seq_length
        if not self.packing:
            first = self._base + j * S
            tokens = self._read(first, first + S + 1)
            if not self.reset_at_documents:
                return Sample(tokens, np.ones(S, np.float32), np.arange(S, dtype=np.int64),
                              np.asarray([0, S], np.int32), np.ones(S, bool))
            offsets = self.indexed.offsets
            inside = offsets[np.searchsorted(offsets, first, side="right"):
                             np.searchsorted(offsets, first + S + 1, side="left")]
            # Bounds of the document parts in the sample: 0, each document start, S+1.
            starts = np.concatenate([[0], inside - first, [S + 1]])
            used = S + 1
        else:
            p0, p1 = self._bin_piece[j], self._bin_piece[j + 1]
            starts = self._piece_start[p0:p1 + 1] - self._piece_start[p0]  # piece bounds in the sample
            used = int(starts[-1])
            tokens = np.full(S + 1, self.pad_id, dtype=np.int64)
            tokens[:used] = self._read(self._piece_start[p0], self._piece_start[p1])
        loss_mask = np.ones(S, np.float32)
        ends = starts[1:]
        loss_mask[ends[ends <= S] - 1] = 0  # the label after a part's last token is another part
        loss_mask[used:] = 0  # labels that are padding
        cu = np.concatenate([starts[starts < S], [S]]).astype(np.int32)
        seg = np.repeat(np.arange(len(cu) - 1), np.diff(cu))
        positions = np.arange(S, dtype=np.int64) - cu[seg]
        return Sample(tokens, loss_mask, positions, cu, np.arange(S) < used)


class BlendedDataset:
    """Samples drawn from several datasets in proportion to ``weights``, with
    Megatron-LM's greedy rule: sample n comes from the dataset furthest behind its share,
    the one with the largest ``w_d * max(n, 1) - taken_d`` (the first such on a tie). So
    the datasets' counts track ``n * w_d`` at every n, not only on average. The order
    is fixed by the weights; the seeds of the datasets shuffle what each contributes.

    ``size`` samples make a period; later periods repeat the pattern with the datasets'
    following samples, so the blend never ends."""

    def __init__(self, datasets: Sequence[GPTDataset], weights: Sequence[float], size: int):
        if len(datasets) != len(weights) or not datasets:
            raise ValueError(f"blending needs one weight per dataset, got {len(datasets)} datasets "
                             f"and {len(weights)} weights")
        if any(not w > 0 for w in weights):
            raise ValueError(f"blend weights {list(weights)} must all be > 0")
        if size < 1:
            raise ValueError(f"blend size={size} must be >= 1")
        self.datasets, self.size = list(datasets), size
        w = [float(x) / sum(weights) for x in weights]
        self.weights = np.asarray(w)
        taken = [0] * len(w)
        dataset_index = np.empty(size, dtype=np.int64)
        sample_index = np.empty(size, dtype=np.int64)
        for n in range(size):
            behind = [wd * max(n, 1) - t for wd, t in zip(w, taken)]
            d = behind.index(max(behind))
            dataset_index[n], sample_index[n] = d, taken[d]
            taken[d] += 1
        self.dataset_index, self.sample_index = dataset_index, sample_index
        self.per_period = np.bincount(self.dataset_index, minlength=len(datasets))
        self.seq_length = datasets[0].seq_length
        self.vocab_size = max((ds.vocab_size for ds in datasets if ds.vocab_size is not None), default=None)
        if any(ds.seq_length != self.seq_length for ds in datasets):
            raise ValueError(f"blended datasets must share seq_length, got {[ds.seq_length for ds in datasets]}")

    def __len__(self) -> int:
        return self.size

    @property
    def shuffle(self) -> str:
        return self.datasets[0].shuffle

    def set_shuffle(self, shuffle: str) -> None:
        """Order every dataset's epochs by ``shuffle`` (:meth:`GPTDataset.set_shuffle`)."""
        for ds in self.datasets:
            ds.set_shuffle(shuffle)

    def __getitem__(self, i: int) -> Sample:
        if i < 0:
            raise IndexError(f"sample index {i} must be >= 0")
        period, k = divmod(i, self.size)
        d = int(self.dataset_index[k])
        return self.datasets[d][period * int(self.per_period[d]) + int(self.sample_index[k])]


@dataclass
class Batch:
    tokens: torch.Tensor  # int64 [B, S] inputs
    labels: torch.Tensor  # int64 [B, S]
    loss_mask: torch.Tensor  # float32 [B, S]
    positions: torch.Tensor  # int64 [B, S]
    # int32 [segments+1]: segment starts over the B*S flattened positions (varlen attention).
    cu_seqlens: torch.Tensor
    # bool [B, S]: real input tokens (False: padding); None: every token is real.
    token_mask: Optional[torch.Tensor] = None
    # int64 [B]: each row's global sample number, its place in the run's data stream (the
    # same under any layout); None for batches not made by the loader.
    sample_ids: Optional[torch.Tensor] = None

    def to(self, device: torch.device | str) -> "Batch":
        """Every tensor on ``device`` but ``cu_seqlens`` and ``sample_ids``, which stay on the
        host: ``cu_seqlens`` is read there (validated and turned into document ids,
        :meth:`Transformer.documents <moe_fold.models.model.Transformer.documents>`; dynamic
        cp's plan), and reading it on a GPU would block the host every micro-batch;
        ``sample_ids`` only key route traces, which are written from the host."""
        def move(name: str, x: Optional[torch.Tensor]) -> Optional[torch.Tensor]:
            return x if x is None or name in ("cu_seqlens", "sample_ids") else x.to(device, non_blocking=True)

        return Batch(*(move(f.name, getattr(self, f.name)) for f in fields(self)))

    def cp_slice(self, cp_rank: int, cp_size: int) -> "Batch":
        """This cp rank's zigzag share of every [B, S] field: [B, S] -> [B, S/cp].
        ``cu_seqlens`` and ``sample_ids`` keep describing the whole sequences."""
        mask = None if self.token_mask is None else zigzag_split(self.token_mask, cp_rank, cp_size, dim=1)
        return Batch(*(zigzag_split(x, cp_rank, cp_size, dim=1)
                       for x in (self.tokens, self.labels, self.loss_mask, self.positions)), self.cu_seqlens, mask,
                     self.sample_ids)


def collate(samples: Sequence[Sample], sample_ids: Optional[Sequence[int]] = None) -> Batch:
    """``samples`` as one micro-batch; ``sample_ids``: their global sample numbers."""
    tokens = torch.from_numpy(np.stack([s.tokens for s in samples]))  # [B, S+1]
    S = tokens.shape[1] - 1
    cu = np.concatenate([s.cu_seqlens[:-1] + b * S for b, s in enumerate(samples)] + [[len(samples) * S]])
    ids = None if sample_ids is None else torch.tensor(list(sample_ids), dtype=torch.int64)
    return Batch(tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous(),
                 torch.from_numpy(np.stack([s.loss_mask for s in samples])),
                 torch.from_numpy(np.stack([s.positions for s in samples])),
                 torch.from_numpy(cu.astype(np.int32)),
                 _token_mask(samples, S), ids)


def _token_mask(samples: Sequence[Sample], S: int) -> Optional[torch.Tensor]:
    """bool ``[B, S]``, or None when no sample has padding: decided here, on the host, so
    the model never reads the mask back from a GPU to learn that it is all true."""
    if all(s.token_mask is None or s.token_mask.all() for s in samples):
        return None
    return torch.from_numpy(np.stack([np.ones(S, bool) if s.token_mask is None else s.token_mask for s in samples]))


def _check_sharding(global_batch_size: int, micro_batch_size: int, dp_rank: int, dp_size: int,
                    start_sample: int) -> None:
    if micro_batch_size < 1 or dp_size < 1:
        raise ValueError(f"micro_batch_size={micro_batch_size} and dp_size={dp_size} must be >= 1")
    if not 0 <= dp_rank < dp_size:
        raise ValueError(f"dp_rank={dp_rank} must be in [0, dp_size={dp_size})")
    step = micro_batch_size * dp_size
    if global_batch_size < 1:
        raise ValueError(f"global_batch_size={global_batch_size} must be >= 1")
    require(batch_over_dp, global_batch_size, micro_batch_size, dp_size)
    if start_sample < 0 or start_sample % step:
        raise ValueError(f"start_sample={start_sample} must be a multiple of micro_batch_size*dp={step} "
                         f"(a resume point between micro-batch steps)")


def batches(dataset: GPTDataset | BlendedDataset, global_batch_size: int, micro_batch_size: int,
            dp_rank: int, dp_size: int, start_sample: int = 0) -> Iterator[Batch]:
    """This dp rank's micro-batches, without end. Micro-step k takes the
    ``micro_batch_size * dp`` samples after ``start_sample + k * micro_batch_size * dp``
    and rank r the r-th block of ``micro_batch_size`` of them (Megatron's order), so the dp
    ranks together cover every global batch exactly once."""
    _check_sharding(global_batch_size, micro_batch_size, dp_rank, dp_size, start_sample)
    step = micro_batch_size * dp_size
    first = start_sample + dp_rank * micro_batch_size
    while True:
        ids = range(first, first + micro_batch_size)
        yield collate([dataset[i] for i in ids], ids)
        first += step


class DataLoader:
    """``batches`` with a position that checkpoints: ``state_dict()`` is
    ``{"consumed_samples": n, "shuffle": name}``, the samples all dp ranks have taken so
    far (the same number on every rank) and the dataset's shuffle; ``load_state_dict``
    resumes at exactly that sample, in that shuffle's order (``permutation`` for a state
    without one: it was saved before ``feistel`` existed). With
    ``cp_size > 1`` each batch is this cp rank's zigzag share (``Batch.cp_slice``).

    Global batch ``g`` (0-based) is samples ``[g * global_batch_size, (g + 1) *
    global_batch_size)``; :meth:`global_batch` passes over those in ``skip`` (their samples
    count as consumed: the position stays a sample count), and :attr:`last_batch` is the
    index of the one it returned last (-1 before any)."""

    def __init__(self, dataset: GPTDataset | BlendedDataset, global_batch_size: int, micro_batch_size: int,
                 dp_rank: int = 0, dp_size: int = 1, consumed_samples: int = 0, cp_rank: int = 0,
                 cp_size: int = 1):
        _check_sharding(global_batch_size, micro_batch_size, dp_rank, dp_size, consumed_samples)
        zigzag_positions(dataset.seq_length, cp_rank, cp_size)  # rejects a bad cp split before any batch
        self.dataset = dataset
        self.global_batch_size, self.micro_batch_size = global_batch_size, micro_batch_size
        self.dp_rank, self.dp_size = dp_rank, dp_size
        self.cp_rank, self.cp_size = cp_rank, cp_size
        self.consumed_samples = consumed_samples
        self.num_micro_batches = global_batch_size // (micro_batch_size * dp_size)
        self.skip: set[int] = set()  # global batches never returned (train.skip_batches, rollbacks)
        self.last_batch = -1

    def __iter__(self) -> Iterator[Batch]:
        it = batches(self.dataset, self.global_batch_size, self.micro_batch_size, self.dp_rank, self.dp_size,
                     self.consumed_samples)
        for batch in it:
            self.consumed_samples += self.micro_batch_size * self.dp_size
            yield batch.cp_slice(self.cp_rank, self.cp_size) if self.cp_size > 1 else batch

    def global_batch(self) -> list[Batch]:
        """The next ``num_micro_batches`` micro-batches: this rank's share of one step
        (of the next global batch not in ``skip``)."""
        if self.skip and self.consumed_samples % self.global_batch_size:
            raise ValueError(f"consumed_samples={self.consumed_samples} is not at a global batch boundary "
                             f"(a multiple of global_batch_size={self.global_batch_size})")
        while self.consumed_samples // self.global_batch_size in self.skip:
            self.consumed_samples += self.global_batch_size
        self.last_batch = self.consumed_samples // self.global_batch_size
        it = iter(self)
        return [next(it) for _ in range(self.num_micro_batches)]

    def state_dict(self) -> dict:
        return {"consumed_samples": self.consumed_samples, "shuffle": self.dataset.shuffle}

    def load_state_dict(self, state: dict) -> None:
        n = int(state["consumed_samples"])
        _check_sharding(self.global_batch_size, self.micro_batch_size, self.dp_rank, self.dp_size, n)
        self.dataset.set_shuffle(state.get("shuffle", "permutation"))
        self.consumed_samples = n


def cp_zigzag_slice(tokens: torch.Tensor, cp_rank: int, cp_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``tokens[B, S]`` -> (``tokens_local[B, S/cp]``, ``positions_local[S/cp]``): this cp
    rank's two zigzag chunks (``moe_fold.parallel.context_parallel``'s layout) and their positions
    in the full sequence."""
    return zigzag_split(tokens, cp_rank, cp_size, dim=1), zigzag_positions(tokens.shape[1], cp_rank, cp_size)


def split_documents(num_docs: int, valid_fraction: float, part: str) -> Optional[tuple[int, int]]:
    """The documents ``[first, stop)`` of ``part`` (``train`` or ``valid``) when the last
    ``ceil(valid_fraction * num_docs)`` documents are held out for validation; None (all
    documents) for ``train`` without a split. The split is by whole documents, so no
    document has tokens on both sides; the last ones, so adding documents at the end
    of a corpus never moves a training document into validation or back."""
    if part not in ("train", "valid"):
        raise ValueError(f"part={part!r} must be train or valid")
    if not 0 <= valid_fraction < 1:
        raise ValueError(f"valid_fraction={valid_fraction} must be in [0, 1)")
    if valid_fraction == 0:
        if part == "valid":
            raise ValueError("valid_fraction=0 holds out no validation documents")
        return None
    held = math.ceil(valid_fraction * num_docs)
    if held >= num_docs:
        raise ValueError(f"data.valid_fraction={valid_fraction} of {num_docs} documents leaves no training "
                         f"document (it holds out {held})")
    return (0, num_docs - held) if part == "train" else (num_docs - held, num_docs)


def open_training_dataset(prefixes: Sequence[str | os.PathLike], weights: Sequence[float] | None,
                          seq_length: int, seed: int, packing: bool = False, blend_size: int = 10_000,
                          max_vocab_size: int | None = None, valid_fraction: float = 0.0,
                          part: str = "train", eod_id: int | None = None, dtype: str | None = None,
                          verify: str = "sampled") -> GPTDataset | BlendedDataset:
    """One dataset, or a blend of several (equal weights when ``weights`` is None), each
    shuffled with its own seed. A prefix may be of any format :mod:`moe_fold.data.sources`
    reads (``eod_id``: end-of-document id of the formats that store none; ``dtype``: of a
    raw ``.bin``). ``max_vocab_size`` (the model's) rejects a dataset whose token ids could
    fall outside the embedding. ``valid_fraction > 0`` splits each dataset by
    :func:`split_documents` and takes its ``part``."""
    if not prefixes:
        raise ValueError("no dataset prefixes given")
    datasets = []
    for i, prefix in enumerate(prefixes):
        source = open_tokens(prefix, eod_id, dtype, verify)
        if source.vocab_size is not None and max_vocab_size is not None and source.vocab_size > max_vocab_size:
            raise ValueError(f"dataset {source.prefix} was tokenized with vocab_size={source.vocab_size}, "
                             f"larger than model.vocab_size={max_vocab_size}")
        # Without a split the document count is not needed (a flat token file would scan for it).
        documents = split_documents(source.num_docs if valid_fraction > 0 else 0, valid_fraction, part)
        datasets.append(GPTDataset(source, seq_length, seed + i, packing, documents=documents,
                                   vocab_limit=max_vocab_size))
    if len(datasets) == 1 and weights is None:
        return datasets[0]
    return BlendedDataset(datasets, weights if weights is not None else [1.0] * len(datasets), blend_size)


def _open(config: Config, paths, weights, valid_fraction: float, part: str) -> GPTDataset | BlendedDataset:
    from moe_fold.data.corpus import prepare_data_paths
    from moe_fold.data.sources import resolved_eod_id

    d = config.data
    prefixes = prepare_data_paths(paths, d.tokenizer, d.cache_dir, text_key=d.text_key)
    return open_training_dataset(prefixes, weights, config.model.seq_length, config.train.seed,
                                 packing=d.packing, max_vocab_size=config.model.vocab_size,
                                 valid_fraction=valid_fraction, part=part, eod_id=resolved_eod_id(d),
                                 dtype=d.dtype, verify=d.verify)


def dataset_from_config(config: Config) -> GPTDataset | BlendedDataset:
    """The training dataset a ``Config`` asks for: ``data.path`` (None: the demo corpus)
    tokenized into ``data.cache_dir`` when it is text, read in place when it is tokenized
    (moe-fold, Megatron, token files, Hugging Face datasets), blended by ``data.weights``,
    samples of ``model.seq_length`` shuffled by ``train.seed``, packed when ``data.packing``.
    In a multi-rank run call it on one rank, barrier, then on the others (they find the cache)."""
    d = config.data
    return _open(config, d.path, d.weights, d.valid_fraction, "train")


def validation_dataset_from_config(config: Config) -> GPTDataset | BlendedDataset | None:
    """The validation dataset: ``data.valid_path`` (read like ``data.path``), or the
    documents ``data.valid_fraction`` holds out of each training dataset (blended by
    ``data.weights``); None when neither is set. Call it like :func:`dataset_from_config`."""
    d = config.data
    if d.valid_path is not None:
        return _open(config, d.valid_path, None, 0.0, "train")  # the whole of another dataset
    if d.valid_fraction > 0:
        return _open(config, d.path, d.weights, d.valid_fraction, "valid")
    return None
