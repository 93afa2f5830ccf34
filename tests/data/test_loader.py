"""The loader: fixed-length and packed samples against loops over the token stream, the
seeded shuffle, dp sharding, exact resume, blending proportions, cp zigzag slices."""

from __future__ import annotations

import re

import numpy as np
import pytest
import torch

from moe_fold.data.indexed_dataset import write_indexed_dataset
from moe_fold.parallel.context_parallel import zigzag_positions
from moe_fold.data.loader import (BlendedDataset, DataLoader, GPTDataset, Sample, batches, cp_zigzag_slice,
                                  dataset_from_config, feistel_order, open_training_dataset)

EOD = 256


def _docs(lengths, seed=0):
    rng = np.random.default_rng(seed)
    return [rng.integers(0, 256, size=n - 1).tolist() + [EOD] for n in lengths]


@pytest.fixture
def stream_dataset(tmp_path):
    docs = _docs([7, 30, 12, 3, 50, 9, 21, 1, 40, 15] * 3)
    prefix = write_indexed_dataset(tmp_path / "ds", docs, 258, EOD)
    return prefix, docs


def test_fixed_samples_tile_the_stream(stream_dataset):
    prefix, docs = stream_dataset
    stream = [t for d in docs for t in d]
    S = 16
    ds = GPTDataset(prefix, S, seed=3)
    assert len(ds) == (len(stream) - 1) // S
    for j in range(len(ds)):
        s = ds.raw_sample(j)
        assert s.tokens.tolist() == stream[j * S:j * S + S + 1]
        assert s.loss_mask.tolist() == [1.0] * S
        assert s.positions.tolist() == list(range(S))
        assert s.cu_seqlens.tolist() == [0, S]
    order = ds.sample_order(0)
    assert sorted(order.tolist()) == list(range(len(ds)))
    for i in range(2 * len(ds)):  # two epochs
        expected = ds.raw_sample(int(ds.sample_order(i // len(ds))[i % len(ds)]))
        assert ds[i].tokens.tolist() == expected.tokens.tolist()


def test_shuffle_depends_only_on_seed(stream_dataset):
    prefix, _ = stream_dataset
    a, b, c = (GPTDataset(prefix, 8, seed=s) for s in (11, 11, 12))
    assert np.array_equal(a.sample_order(0), b.sample_order(0))
    assert not np.array_equal(a.sample_order(0), c.sample_order(0))
    assert not np.array_equal(a.sample_order(0), a.sample_order(1))  # each epoch reshuffles
    assert sorted(a.sample_order(1).tolist()) == list(range(len(a)))
    assert [a[i].tokens.tolist() for i in range(40)] == [b[i].tokens.tolist() for i in range(40)]


def test_feistel_shuffle_is_a_permutation_found_place_by_place():
    """The ``feistel`` shuffle is a bijection of [0, n) for every n (cycle walking), keyed
    by seed and epoch, and finds a place's sample without the epoch's array: at 2^32
    samples (an epoch of 17 trillion tokens of 4096) three places are three numbers."""
    import tracemalloc

    for n in (1, 2, 3, 5, 64, 1000, 4097):
        order = feistel_order(np.arange(n), n, seed=7, epoch=0)
        assert sorted(order.tolist()) == list(range(n))
    assert not np.array_equal(feistel_order(np.arange(1000), 1000, 7, 0), feistel_order(np.arange(1000), 1000, 8, 0))
    assert not np.array_equal(feistel_order(np.arange(1000), 1000, 7, 0), feistel_order(np.arange(1000), 1000, 7, 1))
    n = 1 << 32
    places = np.asarray([0, 12345, n - 1])
    tracemalloc.start()
    try:
        got = feistel_order(places, n, seed=7, epoch=3)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ((0 <= got) & (got < n)).all() and len(set(got.tolist())) == 3 and peak < 1 << 20


def test_a_dataset_reads_a_sample_without_an_array_the_size_of_its_epoch(stream_dataset):
    """Every rank used to build its epoch's permutation to read one sample: 8 bytes a
    sample (29 GB at full scale). A new dataset's read holds a few numbers."""
    import tracemalloc

    prefix, _ = stream_dataset
    ds = GPTDataset(prefix, 8, seed=5)
    assert ds.shuffle == "feistel"
    ds.num_samples = 1 << 24  # an epoch of 16M samples: its permutation is 128 MB
    tracemalloc.start()
    try:
        places = ds._order(2, np.asarray([3, (1 << 24) - 1]))
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    assert ((0 <= places) & (places < 1 << 24)).all() and peak < 1 << 20, peak


def test_a_checkpoint_without_a_shuffle_resumes_in_the_order_it_was_saved_in(stream_dataset):
    """A loader position saved before the ``feistel`` shuffle (``{"consumed_samples": n}``)
    resumes in numpy's permutation of each epoch, the order that run read; the position
    then records ``permutation``, so it keeps it at every later resume."""
    prefix, _ = stream_dataset
    gbs, mbs = 8, 2
    old = GPTDataset(prefix, 8, seed=5, shuffle="permutation")
    for epoch in (0, 1):  # the order of the loader before the feistel shuffle, as it built it
        assert np.array_equal(old.sample_order(epoch), np.random.default_rng([5, epoch]).permutation(len(old)))
    it = iter(DataLoader(old, gbs, mbs))
    straight = [next(it) for _ in range(30)]
    resumed = DataLoader(GPTDataset(prefix, 8, seed=5), gbs, mbs)
    resumed.load_state_dict({"consumed_samples": 12 * mbs})
    assert resumed.state_dict() == {"consumed_samples": 12 * mbs, "shuffle": "permutation"}
    rest = iter(resumed)
    for k in range(12, 30):
        assert torch.equal(next(rest).tokens, straight[k].tokens)
    new = DataLoader(GPTDataset(prefix, 8, seed=5), gbs, mbs)
    assert not all(torch.equal(next(iter(new)).tokens, b.tokens) for b in straight[:1])
    with pytest.raises(ValueError, match="shuffle='random' must be one of permutation, feistel"):
        new.load_state_dict({"consumed_samples": 0, "shuffle": "random"})


def _packed_reference(docs, S, pad):
    """Next-fit packing written as a plain loop over documents and their pieces."""
    pieces = []
    for d in docs:
        for k in range(0, len(d), S + 1):
            pieces.append(d[k:k + S + 1])
    samples, current = [], []
    for p in pieces:
        if sum(len(q) for q in current) + len(p) > S + 1:
            samples.append(current)
            current = []
        current.append(p)
    samples.append(current)
    out = []
    for group in samples:
        tokens = [t for p in group for t in p]
        used = len(tokens)
        tokens += [pad] * (S + 1 - used)
        mask, positions, cu = [], [], []
        start = 0
        for p in group:
            if start < S:
                cu.append(start)
            for k in range(len(p)):
                if start + k < S:
                    positions.append(k)
                    # the label of the last token of a piece belongs to something else
                    mask.append(1.0 if k < len(p) - 1 else 0.0)
            start += len(p)
        if used < S:
            cu.append(used)
            positions += list(range(S - used))
            mask += [0.0] * (S - used)
        out.append((tokens, mask, positions, cu + [S]))
    return out


def test_packing_matches_reference_loop(stream_dataset):
    prefix, docs = stream_dataset
    S = 24  # docs of 40 and 50 tokens are cut into pieces
    ds = GPTDataset(prefix, S, seed=0, packing=True, pad_id=257)
    ref = _packed_reference(docs, S, 257)
    assert len(ds) == len(ref)
    for j, (tokens, mask, positions, cu) in enumerate(ref):
        s = ds.raw_sample(j)
        assert s.tokens.tolist() == tokens
        assert s.loss_mask.tolist() == mask
        assert s.positions.tolist() == positions
        assert s.cu_seqlens.tolist() == cu
    # Every short document sits whole inside one sample.
    packed = [ds.raw_sample(j).tokens.tolist() for j in range(len(ds))]
    for d in docs:
        if len(d) <= S + 1:
            assert any(d == p[i:i + len(d)] for p in packed for i in range(S + 2 - len(d)))


class _Numbered:
    """Sample i is the token i: which samples a rank got is read off the batch."""

    seq_length = 1
    shuffle = "feistel"

    def __getitem__(self, i):
        return Sample(np.asarray([i, i], np.int64), np.ones(1, np.float32), np.zeros(1, np.int64),
                      np.asarray([0, 1], np.int32))


@pytest.mark.parametrize("dp,mbs,gbs", [(1, 2, 6), (2, 2, 8), (4, 1, 8), (3, 2, 12)])
def test_dp_shards_cover_each_global_batch_once(dp, mbs, gbs):
    steps = 3
    per_rank = []
    for rank in range(dp):
        loader = DataLoader(_Numbered(), gbs, mbs, dp_rank=rank, dp_size=dp)
        got = [[b.tokens[:, 0].tolist() for b in loader.global_batch()] for _ in range(steps)]
        per_rank.append(got)
        assert loader.state_dict() == {"consumed_samples": steps * gbs, "shuffle": "feistel"}
    for step in range(steps):
        seen = sorted(i for rank in range(dp) for mb in per_rank[rank][step] for i in mb)
        assert seen == list(range(step * gbs, (step + 1) * gbs))  # no overlap, no gap


def test_resume_equals_straight_iteration(stream_dataset):
    prefix, _ = stream_dataset
    ds = GPTDataset(prefix, 8, seed=5)
    gbs, mbs, dp = 8, 2, 2
    for rank in range(dp):
        straight = DataLoader(ds, gbs, mbs, rank, dp)
        it = iter(straight)
        full = [next(it) for _ in range(40)]  # past one epoch
        first = DataLoader(ds, gbs, mbs, rank, dp)
        it = iter(first)
        for _ in range(13):
            next(it)
        state = first.state_dict()
        assert state == {"consumed_samples": 13 * mbs * dp, "shuffle": "feistel"}
        resumed = DataLoader(GPTDataset(prefix, 8, seed=5), gbs, mbs, rank, dp)
        resumed.load_state_dict(state)
        rest = iter(resumed)
        for k in range(13, 40):
            b = next(rest)
            for field in ("tokens", "labels", "loss_mask", "positions", "cu_seqlens"):
                assert torch.equal(getattr(b, field), getattr(full[k], field))
    with pytest.raises(ValueError, match=r"start_sample=3 must be a multiple of micro_batch_size\*dp=4"):
        next(batches(ds, gbs, mbs, 0, dp, start_sample=3))
    with pytest.raises(ValueError, match=re.escape("train.global_batch_size=6 is not divisible by "
                                                   "train.micro_batch_size*dp=4 (micro_batch_size=2, "
                                                   "dp=world_size/(tp*cp*pp)=2)")):
        DataLoader(ds, 6, mbs, 0, dp)


def test_batch_fields_and_cu_seqlens(stream_dataset):
    prefix, _ = stream_dataset
    ds = GPTDataset(prefix, 12, seed=1, packing=True)
    # A batch of 3 samples with padding in one (its token_mask is not all true).
    first = next(i for i in range(0, len(ds), 3) if not all(ds[j].token_mask.all() for j in range(i, i + 3)))
    batch = next(batches(ds, 3, 3, 0, 1, start_sample=first))
    samples = [ds[i] for i in range(first, first + 3)]
    full = torch.tensor(np.stack([s.tokens for s in samples]))
    assert torch.equal(batch.tokens, full[:, :-1]) and torch.equal(batch.labels, full[:, 1:])
    expected_cu = [int(c) + b * 12 for b, s in enumerate(samples) for c in s.cu_seqlens[:-1]] + [36]
    assert batch.cu_seqlens.tolist() == expected_cu
    assert batch.cu_seqlens.dtype == torch.int32 and batch.loss_mask.dtype == torch.float32
    moved = batch.to("cpu")
    assert torch.equal(moved.tokens, batch.tokens) and torch.equal(moved.cu_seqlens, batch.cu_seqlens)
    # Packed samples split over cp: every per-token field zigzag-sliced, cu_seqlens whole.
    shard = batch.cp_slice(1, 2)
    for name in ("tokens", "labels", "loss_mask", "positions", "token_mask"):
        whole = getattr(batch, name)
        assert torch.equal(getattr(shard, name), torch.cat([whole[:, 3:6], whole[:, 6:9]], dim=1)), name
    assert torch.equal(shard.cu_seqlens, batch.cu_seqlens)


def test_blend_proportions_exact(tmp_path):
    weights = [5.0, 3.0, 2.0]
    datasets = [GPTDataset(write_indexed_dataset(tmp_path / f"d{k}", _docs([60] * 4, seed=k), 258, EOD),
                           4, seed=k) for k in range(3)]
    blend = BlendedDataset(datasets, weights, size=1000)
    counts = np.zeros(3)
    w = np.asarray(weights) / sum(weights)
    for n, d in enumerate(blend.dataset_index, 1):
        counts[d] += 1
        assert np.all(np.abs(counts - n * w) <= 1.0 + 1e-9), (n, counts)
    assert counts.tolist() == [500, 300, 200]
    for d in range(3):  # each dataset's samples are taken in order, none skipped
        assert blend.sample_index[blend.dataset_index == d].tolist() == list(range(int(counts[d])))
    # Sample i of the blend is the matching sample of its dataset, in the next period too.
    for i in (0, 1, 2, 7, 999, 1000, 1003, 2500):
        period, k = divmod(i, 1000)
        d = blend.dataset_index[k]
        j = period * int(counts[d]) + int(blend.sample_index[k])
        assert blend[i].tokens.tolist() == datasets[d][j].tokens.tolist()
    again = open_training_dataset([tmp_path / f"d{k}" for k in range(3)], weights, 4, seed=0, blend_size=1000)
    assert np.array_equal(again.dataset_index, blend.dataset_index)
    with pytest.raises(ValueError, match=r"vocab_size=258, larger than model.vocab_size=200"):
        open_training_dataset([tmp_path / "d0"], None, 4, seed=0, max_vocab_size=200)


@pytest.mark.parametrize("cp", [1, 2, 3, 4])
def test_zigzag_slices_reassemble(cp):
    B, S = 2, 24
    tokens = torch.arange(B * S).reshape(B, S) * 10
    out = torch.full_like(tokens, -1)
    c = S // (2 * cp)
    for r in range(cp):
        local, pos = cp_zigzag_slice(tokens, r, cp)
        assert local.shape == (B, S // cp)
        expected = list(range(r * c, (r + 1) * c)) + list(range((2 * cp - 1 - r) * c, (2 * cp - r) * c))
        assert pos.tolist() == expected
        assert torch.equal(local, tokens[:, pos])
        assert (out[:, pos] == -1).all()  # no position is given to two ranks
        out[:, pos] = local
    assert torch.equal(out, tokens)
    if cp > 1:
        with pytest.raises(ValueError, match=re.escape(f"model.seq_length=25 is not divisible by 2*parallel.cp={2 * cp} "
                                                       f"(context parallel splits the sequence into 2*cp chunks)")):
            cp_zigzag_slice(torch.zeros(1, 25), 0, cp)
    else:
        assert cp_zigzag_slice(torch.zeros(1, 25), 0, 1)[1].tolist() == list(range(25))


def test_batch_cp_slice_matches_function(stream_dataset):
    prefix, _ = stream_dataset
    batch = next(batches(GPTDataset(prefix, 16, seed=2), 2, 2, 0, 1))
    local = batch.cp_slice(1, 2)
    tokens, pos = cp_zigzag_slice(batch.tokens, 1, 2)
    assert torch.equal(local.tokens, tokens)
    assert torch.equal(local.labels, batch.labels[:, pos])
    assert torch.equal(local.positions, pos.expand(2, -1))


def test_dataset_from_config(tmp_path):
    from moe_fold.config import load_config

    for k in range(2):
        (tmp_path / f"src{k}").mkdir()
        (tmp_path / f"src{k}" / "a.txt").write_text(f"corpus {k} " * 200)
    config = load_config(None, [f"data.path=['{tmp_path / 'src0'}', '{tmp_path / 'src1'}']",
                                "data.weights=[3, 1]", f"data.cache_dir={tmp_path / 'cache'}",
                                "model.seq_length=16", "data.packing=true"])
    ds = dataset_from_config(config)
    assert isinstance(ds, BlendedDataset) and ds.seq_length == 16
    assert np.bincount(ds.dataset_index).tolist() == [7500, 2500]
    assert all(d.packing and d.indexed.prefix.parent == tmp_path / "cache" for d in ds.datasets)
    text = bytes(t for t in ds.datasets[1].raw_sample(0).tokens.tolist() if t < 256).decode()
    assert text == ("corpus 1 " * 200)[:17]


def test_loader_cp_ranks_share_each_batch(stream_dataset):
    prefix, _ = stream_dataset
    ds = GPTDataset(prefix, 16, seed=4)
    full = DataLoader(ds, 4, 2, dp_rank=1, dp_size=2).global_batch()
    parts = [DataLoader(ds, 4, 2, dp_rank=1, dp_size=2, cp_rank=r, cp_size=2).global_batch() for r in range(2)]
    for k, batch in enumerate(full):
        for field in ("tokens", "labels", "loss_mask", "positions"):
            whole = torch.full_like(getattr(batch, field), -1)
            for r in range(2):
                whole[:, zigzag_positions(16, r, 2)] = getattr(parts[r][k], field)
            assert torch.equal(whole, getattr(batch, field))
    with pytest.raises(ValueError, match=re.escape("model.seq_length=16 is not divisible by 2*parallel.cp=6")):
        DataLoader(ds, 4, 2, cp_rank=0, cp_size=3)


def test_fixed_samples_reset_at_documents(stream_dataset):
    prefix, docs = stream_dataset
    S = 16
    starts = set(np.cumsum([0] + [len(d) for d in docs]).tolist())
    ds = GPTDataset(prefix, S, seed=0, reset_at_documents=True)
    plain = GPTDataset(prefix, S, seed=0)
    for j in range(len(ds)):
        s = ds.raw_sample(j)
        assert s.tokens.tolist() == plain.raw_sample(j).tokens.tolist()
        cu, positions, mask, pos = [0], [], [], 0
        for t in range(S):
            g = j * S + t  # position in the token stream
            if t > 0 and g in starts:
                cu.append(t)
                pos = 0
            positions.append(pos)
            pos += 1
            mask.append(0.0 if g + 1 in starts else 1.0)  # label opens the next document
        assert s.cu_seqlens.tolist() == cu + [S]
        assert s.positions.tolist() == positions
        assert s.loss_mask.tolist() == mask


def _dp_rank_batches(rank, world_size, config_overrides, steps):
    import torch.distributed as dist

    from moe_fold.config import load_config

    config = load_config(None, config_overrides)
    # Rank 0 tokenizes into the cache first; the others then find it built.
    if rank == 0:
        dataset_from_config(config)
    dist.barrier()
    ds = dataset_from_config(config)
    loader = DataLoader(ds, config.train.global_batch_size, config.train.micro_batch_size, rank, world_size)
    out = [b.tokens.tolist() for _ in range(steps) for b in loader.global_batch()]
    return out, loader.state_dict()


@pytest.mark.slow
def test_dp_ranks_match_single_process(tmp_path):
    from moe_fold.config import load_config
    from moe_fold.launch import run_ranks

    src = tmp_path / "src"
    src.mkdir()
    for k in range(6):
        (src / f"{k}.txt").write_text(f"document number {k} " * (10 + 7 * k))
    overrides = [f"data.path={src}", f"data.cache_dir={tmp_path / 'cache'}", "model.seq_length=12",
                 "train.micro_batch_size=2", "train.global_batch_size=8", "train.seed=9"]
    results = run_ranks(_dp_rank_batches, 2, overrides, 2, timeout=120)
    # One process with dp=1 and micro-batches of micro_batch_size*dp samples.
    single = DataLoader(dataset_from_config(load_config(None, overrides)), 8, 4)
    for k in range(4):
        whole = next(iter(single)).tokens
        assert results[0][0][k] + results[1][0][k] == whole.tolist()
    assert results[0][1] == results[1][1] == {"consumed_samples": 16, "shuffle": "feistel"}
