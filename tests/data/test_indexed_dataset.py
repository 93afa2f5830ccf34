"""Our indexed dataset format (moe_fold/data/indexed_dataset.py): the token dtype chosen from
the vocabulary, round trips and offsets, one clear error for each kind of corrupt file, the
sampled check against the full one, and a writer that replaces a dataset atomically."""

import os
import re
import struct
from pathlib import Path

import numpy as np
import pytest

from moe_fold.data.indexed_dataset import DatasetFormatError, IndexedDataset, IndexedDatasetWriter, write_indexed_dataset



def test_dtype_choice_and_id_range(tmp_path):
    big = write_indexed_dataset(tmp_path / "big", [[0, 69_999, 5]], vocab_size=70_000, eod_id=5)
    ds = IndexedDataset(big)
    assert ds.dtype == np.int32 and ds[0].tolist() == [0, 69_999, 5]
    assert IndexedDataset(write_indexed_dataset(tmp_path / "u16", [[65_535]], 65_536, 0)).dtype == np.uint16
    with pytest.raises(ValueError, match=r"document 1 has token ids in \[3, 300\], outside \[0, vocab_size=258\)"):
        write_indexed_dataset(tmp_path / "bad", [[1], [3, 300]], 258, 256)
    assert not (tmp_path / "bad.bin").exists() and not list(tmp_path.glob("bad*tmp*"))


def _make(tmp_path, name="ds", block_size=16):
    rng = np.random.default_rng(0)
    docs = [rng.integers(0, 256, size=n).tolist() + [256] for n in (5, 40, 17, 90, 3)]
    prefix = write_indexed_dataset(tmp_path / name, docs, 258, 256, block_size=block_size)
    return prefix, docs


def test_index_round_trip_and_offsets(tmp_path):
    prefix, docs = _make(tmp_path)
    ds = IndexedDataset(prefix, verify="full")
    assert [ds[i].tolist() for i in range(len(ds))] == docs
    assert ds.lengths.tolist() == [len(d) for d in docs]
    assert ds.tokens.tolist() == [t for d in docs for t in d]
    assert isinstance(ds.tokens, np.memmap)
    with pytest.raises(IndexError):
        ds[5]


def test_corrupt_files_give_one_clear_error(tmp_path):
    prefix, docs = _make(tmp_path)
    bin_file, idx_file = Path(f"{prefix}.bin"), Path(f"{prefix}.idx")
    good_bin, good_idx = bin_file.read_bytes(), idx_file.read_bytes()
    n_bytes = 2 * sum(len(d) for d in docs)

    def expect(message: str):
        with pytest.raises(DatasetFormatError) as e:
            IndexedDataset(prefix)
        assert str(e.value) == message
        bin_file.write_bytes(good_bin)
        idx_file.write_bytes(good_idx)

    bin_file.write_bytes(good_bin[:-2])
    expect(f"{bin_file}: size mismatch: the file ends at byte offset {n_bytes - 2}, the index ds.idx says "
           f"{n_bytes} bytes ({n_bytes // 2} tokens of uint16): the .bin must be exactly that size")

    altered = bytearray(good_bin)
    altered[-1] ^= 0x01  # the last block is always checked
    bin_file.write_bytes(bytes(altered))
    last = (n_bytes - 1) // 16
    with pytest.raises(DatasetFormatError, match=re.escape(
            f"{bin_file}: checksum mismatch in bytes [{last * 16}, {n_bytes}) (block {last}): crc32 ")):
        IndexedDataset(prefix)
    bin_file.write_bytes(good_bin)

    idx_file.write_bytes(b"GARBAGE!" + good_idx[8:])
    expect(f"{idx_file}: bad magic b'GARBAGE!' at byte offset 0, expected b'MOEFIDX\\x00': not a moe-fold index file")

    idx_file.write_bytes(good_idx[:8] + struct.pack("<I", 2) + good_idx[12:])
    expect(f"{idx_file}: unsupported format version 2 at byte offset 8; this moe-fold reads version 1")

    idx_file.write_bytes(good_idx[:-8])
    expect(f"{idx_file}: size mismatch: {len(good_idx) - 8} bytes, the header implies {len(good_idx)} "
           f"(5 documents, {-(-n_bytes // 16)} blocks)")

    damaged = bytearray(good_idx)
    damaged[70] ^= 0x40  # inside the document offsets
    idx_file.write_bytes(bytes(damaged))
    with pytest.raises(DatasetFormatError, match=re.escape(f"{idx_file}: checksum mismatch: crc32 of the index")):
        IndexedDataset(prefix)
    idx_file.write_bytes(good_idx)

    os.remove(bin_file)
    with pytest.raises(FileNotFoundError, match=re.escape(f"{bin_file}: dataset file not found")):
        IndexedDataset(prefix)


def test_sampled_check_versus_full(tmp_path):
    """Opening checks 8 of the blocks (first, last, evenly spaced); verify='full' checks all."""
    prefix, docs = _make(tmp_path, block_size=4)
    bin_file = Path(f"{prefix}.bin")
    n_blocks = -(-bin_file.stat().st_size // 4)
    checked = set(np.linspace(0, n_blocks - 1, 8).round().astype(int).tolist())
    unchecked = next(b for b in range(n_blocks) if b not in checked)
    data = bytearray(bin_file.read_bytes())
    data[unchecked * 4] ^= 0x01
    bin_file.write_bytes(bytes(data))
    IndexedDataset(prefix)  # the damaged block is not among the sampled ones
    with pytest.raises(DatasetFormatError, match=re.escape(f"(block {unchecked})")):
        IndexedDataset(prefix, verify="full")
    data[unchecked * 4] ^= 0x01
    data[0] ^= 0x01
    bin_file.write_bytes(bytes(data))
    with pytest.raises(DatasetFormatError, match=re.escape("(block 0)")):
        IndexedDataset(prefix)


def test_writer_is_atomic(tmp_path):
    prefix, docs = _make(tmp_path)
    before = Path(f"{prefix}.bin").read_bytes()
    with pytest.raises(RuntimeError, match="crash"):
        with IndexedDatasetWriter(prefix, 258, 256) as w:
            w.add_document([1, 2, 256])
            raise RuntimeError("crash")
    assert Path(f"{prefix}.bin").read_bytes() == before  # the old dataset is untouched
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ds.bin", "ds.idx"]
    assert [d.tolist() for d in (IndexedDataset(prefix)[i] for i in range(5))] == docs
