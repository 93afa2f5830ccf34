"""``moe-fold data inspect PATH``: what a dataset holds, checked the way training checks
it, as plain text: format, documents, tokens, document-length histogram, vocabulary
coverage and the first documents decoded."""

from __future__ import annotations

import os

import numpy as np

from moe_fold.data.sources import CHECK_BLOCK, check_block, checked_blocks, data_file, detect_format, open_tokens
from moe_fold.data.tokenizer import load_tokenizer


def inspect_dataset(path: str | os.PathLike, tokenizer: str = "byte", vocab_size: int | None = None,
                    eod_id: int | None = None, dtype: str | None = None, docs: int = 3,
                    full: bool = False) -> str:
    """The report as text; raises ``DatasetFormatError`` on the first broken rule."""
    fmt, _ = detect_format(path)
    if fmt in ("text", "hf-text"):
        raise ValueError(f"{path} is text ({fmt}): tokenize it with `moe-fold data {path} --output PREFIX`, "
                         f"then inspect PREFIX")
    tok = load_tokenizer(tokenizer)
    source = open_tokens(path, tok.eod_id if eod_id is None else eod_id, dtype, "full" if full else "sampled")
    vocab = vocab_size or source.vocab_size or tok.vocab_size
    lines = [f"{path}", f"  format      {source.format} ({data_file(source)})",
             f"  tokens      {source.num_tokens:,} ({np.dtype(source.dtype).name})",
             f"  eod id      {source.eod_id}",
             f"  vocabulary  {vocab:,}" + ("" if source.vocab_size else " (not stored: --vocab-size or the tokenizer's)")]
    if source.num_tokens == 0:
        lines.append("  EMPTY: no tokens; training rejects it")
        return "\n".join(lines)
    lengths = source.lengths
    lines.append(f"  documents   {len(lengths):,}: length min {lengths.min():,}, median {int(np.median(lengths)):,}, "
                 f"mean {lengths.mean():,.1f}, max {lengths.max():,}")
    lines.append("  document lengths (tokens):")
    edges = 2 ** np.arange(0, max(1, int(np.ceil(np.log2(lengths.max() + 1)))) + 1)
    counts = np.histogram(lengths, bins=np.concatenate([[0], edges]))[0]
    top = max(counts.max(), 1)
    lo = 0
    for hi, c in zip(edges.tolist(), counts.tolist()):
        if c:
            lines.append(f"    [{lo:>9,}, {hi:>9,})  {c:>10,}  {'#' * max(1, round(40 * c / top))}")
        lo = hi
    seen = np.zeros(vocab, bool)
    read = 0
    for b in checked_blocks(source.num_tokens, full):
        block = np.asarray(source.tokens[b * CHECK_BLOCK:(b + 1) * CHECK_BLOCK])
        check_block(source, block, b * CHECK_BLOCK, vocab)
        seen[block.astype(np.int64)] = True
        read += len(block)
    lines.append(f"  token ids   all in [0, {vocab:,}) over the {read:,} tokens read"
                 f"{'' if read == source.num_tokens else ' (a sample: --full reads all)'}; "
                 f"{int(seen.sum()):,} distinct ids, {seen.mean():.1%} of the vocabulary")
    for i in range(min(docs, len(lengths))):
        ids = np.asarray(source[i]).astype(np.int64)
        text = tok.decode(ids[:400].tolist())
        more = f" ... (+{len(ids) - 400} tokens)" if len(ids) > 400 else ""
        lines.append(f"  document {i} ({len(ids)} tokens): {text!r}{more}")
    return "\n".join(lines)
