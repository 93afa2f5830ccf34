"""Our tokenizers as Hugging Face tokenizer files, for an exported model folder.

:func:`write_hf_tokenizer` writes ``tokenizer.json`` (the ``tokenizers`` library's
format) and ``tokenizer_config.json`` (special tokens, for transformers' ``AutoTokenizer``):

- the byte tokenizer becomes a byte-level BPE with no merges: id ``b`` is byte ``b``,
  written as the printable character GPT-2's byte-level scheme assigns it, so any text
  encodes to its UTF-8 bytes and any ids decode like :meth:`ByteTokenizer.decode` (special
  ids dropped, a cut multi-byte character as U+FFFD); ``<|endoftext|>`` is 256,
  ``<|pad|>`` 257;
- a ``tokenizer.json`` (trained by ``moe-fold data --train-bpe`` or given) is copied.

Both get a post-processor that starts every text with the end-of-document token, the
token that precedes a document in training: ``AutoTokenizer(text)`` gives the ids that
``moe-fold sample`` feeds the model (:func:`prompt_ids`).
"""

from __future__ import annotations

import json
import os
from pathlib import Path

from moe_fold.data.tokenizer import ByteTokenizer, Tokenizer, load_tokenizer

__all__ = ["byte_level_chars", "hf_byte_tokenizer", "prompt_ids", "write_hf_tokenizer"]

EOD_TOKEN, PAD_TOKEN = "<|endoftext|>", "<|pad|>"


def prompt_ids(tokenizer: Tokenizer, text: str) -> list[int]:
    """The ids a prompt starts a generation with: end-of-document, then the text."""
    return [tokenizer.eod_id] + tokenizer.encode(text)


def byte_level_chars() -> list[str]:
    """The printable character of each byte 0..255 in the byte-level scheme of GPT-2 and
    the ``tokenizers`` library: printable Latin-1 bytes stand for themselves, the others
    (controls, space, soft hyphen...) take code points from 256 on, in byte order."""
    printable = set(range(ord("!"), ord("~") + 1)) | set(range(0xA1, 0xAC + 1)) | set(range(0xAE, 0xFF + 1))
    chars, extra = [], 0
    for b in range(256):
        if b in printable:
            chars.append(chr(b))
        else:
            chars.append(chr(256 + extra))
            extra += 1
    return chars


def _starts_with_eod(tok, eod: str, eod_id: int) -> None:
    from tokenizers import processors

    template = processors.TemplateProcessing(single=f"{eod} $A", pair=f"{eod} $A {eod} $B",
                                             special_tokens=[(eod, eod_id)])
    tok.post_processor = template if tok.post_processor is None else processors.Sequence([tok.post_processor,
                                                                                          template])


def hf_byte_tokenizer():
    """The byte tokenizer as a ``tokenizers.Tokenizer`` (see the module docstring)."""
    from tokenizers import Tokenizer as HF
    from tokenizers import decoders, models, pre_tokenizers

    byte = ByteTokenizer()
    vocab = {c: b for b, c in enumerate(byte_level_chars())}
    tok = HF(models.BPE(vocab=vocab, merges=[]))
    # No regex split: words do not matter when every byte is its own token.
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tok.decoder = decoders.ByteLevel()
    tok.add_special_tokens([EOD_TOKEN, PAD_TOKEN])
    if (tok.token_to_id(EOD_TOKEN), tok.token_to_id(PAD_TOKEN)) != (byte.eod_id, byte.pad_id):
        raise AssertionError("byte tokenizer special ids moved")
    _starts_with_eod(tok, EOD_TOKEN, byte.eod_id)
    return tok


def write_hf_tokenizer(spec: str, folder: str | os.PathLike, model_max_length: int) -> dict[str, int]:
    """Write the tokenizer ``spec`` (``byte`` or a tokenizer.json, as ``data.tokenizer``)
    into ``folder`` as ``tokenizer.json`` + ``tokenizer_config.json``; returns the special
    ids for ``generation_config.json`` (``bos_token_id``, ``eos_token_id``, ``pad_token_id``)."""
    from tokenizers import Tokenizer as HF

    ours = load_tokenizer(spec)
    if spec == "byte":
        tok = hf_byte_tokenizer()
    else:
        tok = HF.from_file(str(ours.path))
        _starts_with_eod(tok, tok.id_to_token(ours.eod_id), ours.eod_id)
    eod, pad = tok.id_to_token(ours.eod_id), tok.id_to_token(ours.pad_id)
    folder = Path(folder)
    folder.mkdir(parents=True, exist_ok=True)
    _replace(folder / "tokenizer.json", tok.to_str(pretty=True))
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": eod, "eos_token": eod, "pad_token": pad,
        "model_max_length": model_max_length,
        # Decoding must give back the exact text: no space clean-up.
        "clean_up_tokenization_spaces": False,
    }
    _replace(folder / "tokenizer_config.json", json.dumps(config, indent=2) + "\n")
    return {"bos_token_id": ours.eod_id, "eos_token_id": ours.eod_id, "pad_token_id": ours.pad_id}


def _replace(path: Path, text: str) -> None:
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.write_text(text)
    os.replace(tmp, path)
