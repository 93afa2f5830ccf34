"""Tokenizers: a byte-level one that needs no file, and Hugging Face ``tokenizers`` files.

Every tokenizer exposes ``encode(text) -> list[int]``, ``encode_batch(texts)`` (int64
arrays: preprocessing writes them without building Python lists),
``decode(ids) -> str``, ``vocab_size``, ``eod_id`` (ends every document), ``pad_id``
(fills the tail of a packed sample) and ``spec`` (the string ``load_tokenizer`` takes).
"""

from __future__ import annotations

import os
from pathlib import Path
from typing import Iterable, Protocol

import numpy as np

from moe_fold.data.documents import DEFAULT_EXTENSIONS, find_input_files, iter_documents

# Names of an end-of-document token in common tokenizer.json files, tried in order.
EOD_NAMES = ("<|endoftext|>", "<|end_of_text|>", "</s>", "<eos>", "<|eod|>", "<|im_end|>")
PAD_NAMES = ("<|pad|>", "<pad>", "[PAD]")


class Tokenizer(Protocol):
    spec: str
    vocab_size: int
    eod_id: int
    pad_id: int

    def encode(self, text: str) -> list[int]: ...

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]: ...

    def decode(self, ids: Iterable[int]) -> str: ...


class ByteTokenizer:
    """Ids 0..255 are the UTF-8 bytes of the text; 256 is end-of-document, 257 padding.

    ``decode`` drops the special ids and decodes the bytes with ``errors="replace"``: a
    whole encoded text comes back exactly, and a slice that cuts a multi-byte character
    (any fixed-length training sample) still decodes, with U+FFFD at the cut."""

    spec = "byte"
    eod_id = 256
    pad_id = 257
    vocab_size = 258

    def encode(self, text: str) -> list[int]:
        return list(text.encode("utf-8"))

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        return [np.frombuffer(t.encode("utf-8"), dtype=np.uint8).astype(np.int64) for t in texts]

    def decode(self, ids: Iterable[int]) -> str:
        return bytes(int(i) for i in ids if int(i) < 256).decode("utf-8", errors="replace")


class HFTokenizer:
    """A Hugging Face ``tokenizer.json`` (or a model folder holding one); the
    end-of-document token is ``eod_token`` or the first of the usual names
    (``<|endoftext|>``, ``</s>``, ...) the file defines."""

    def __init__(self, path: str | os.PathLike, eod_token: str | None = None):
        from tokenizers import Tokenizer as _HF

        # A Hugging Face model folder holds its tokenizer as tokenizer.json.
        self.path = Path(path) / "tokenizer.json" if Path(path).is_dir() else Path(path)
        if not self.path.is_file():
            raise FileNotFoundError(f"tokenizer file {self.path} not found (expected a Hugging Face "
                                    f"tokenizer.json, or 'byte' for the byte tokenizer)")
        try:
            self._tok = _HF.from_file(str(self.path))
        except Exception as e:
            raise ValueError(f"{self.path}: not a Hugging Face tokenizer.json ({e})") from e
        self.spec = str(self.path)
        self.vocab_size = self._tok.get_vocab_size(with_added_tokens=True)
        names = (eod_token,) if eod_token else EOD_NAMES
        self.eod_id = self._first_id(names)
        if self.eod_id is None:
            raise ValueError(f"{self.path}: no end-of-document token; tried {', '.join(names)} "
                             f"(name one with eod_token=...)")
        pad = self._first_id(PAD_NAMES)
        # Padded positions are always loss-masked, so any id will do when none is defined.
        self.pad_id = self.eod_id if pad is None else pad

    def _first_id(self, names: Iterable[str]) -> int | None:
        for name in names:
            i = self._tok.token_to_id(name)
            if i is not None:
                return i
        return None

    def encode(self, text: str) -> list[int]:
        return self._tok.encode(text, add_special_tokens=False).ids

    def encode_batch(self, texts: list[str]) -> list[np.ndarray]:
        # encode_batch_fast: the ids of encode_batch without the character offsets we never use.
        return [np.asarray(e.ids, dtype=np.int64)
                for e in self._tok.encode_batch_fast(texts, add_special_tokens=False)]

    def decode(self, ids: Iterable[int]) -> str:
        return self._tok.decode([int(i) for i in ids], skip_special_tokens=True)


def train_bpe(files: Iterable[str | os.PathLike], vocab_size: int, out_path: str | os.PathLike,
              text_key: str = "text", extensions: Iterable[str] = DEFAULT_EXTENSIONS) -> HFTokenizer:
    """Train a byte-level BPE tokenizer on the documents of ``files`` (text or JSONL, as
    in preprocessing) and write it to ``out_path`` as a tokenizer.json.

    The 256 byte symbols are always in the vocabulary, so any text encodes and decodes
    back exactly; ``<|endoftext|>`` (id 0) and ``<|pad|>`` (id 1) are added."""
    from tokenizers import Tokenizer as _HF
    from tokenizers import decoders, models, pre_tokenizers, trainers

    specials = ["<|endoftext|>", "<|pad|>"]
    smallest = 256 + len(specials)
    if vocab_size < smallest:
        raise ValueError(f"BPE vocab_size={vocab_size} must be >= {smallest} "
                         f"(256 byte symbols + {len(specials)} special tokens)")
    tok = _HF(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=specials, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(iter_documents(find_input_files(files, extensions), text_key), trainer=trainer)
    out = Path(out_path)
    out.parent.mkdir(parents=True, exist_ok=True)
    tmp = out.with_name(f".{out.name}.tmp-{os.getpid()}")
    tok.save(str(tmp))
    os.replace(tmp, out)
    return HFTokenizer(out)


def load_tokenizer(spec: str) -> Tokenizer:
    """``"byte"`` for the byte tokenizer, else the path of a tokenizer.json or of a folder holding one."""
    if spec == "byte":
        return ByteTokenizer()
    return HFTokenizer(spec)
