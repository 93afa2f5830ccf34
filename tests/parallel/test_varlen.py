"""Packed sequences (issue 12): attention never crosses a document boundary, rotary
positions restart per document, and padding counts in no loss or router statistic.

References are independent: attention of each document alone (a softmax loop written
here, or the single-process model run on one document at a time), and the same packed
micro-batch with different padding.
"""

import math

import numpy as np
import pytest
import torch

from moe_fold.config import Config, ModelConfig
from moe_fold.parallel.context_parallel import context_parallel_attention, zigzag_gather, zigzag_split
from moe_fold.data.loader import Batch, GPTDataset, collate
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.model import build_model
from moe_fold.models.moe_layer import MoELayer
from moe_fold.training.step import forward_backward
from moe_fold.parallel.varlen import (Documents, doc_ids_from_cu_seqlens, segment_bounds, sequence_starts,
                                      starts_from_resets, varlen_attention)

from moe_fold.data.indexed_dataset import write_indexed_dataset
from tests.helpers.router_outputs import router_outputs
from tests.models.test_mla import MLA_MODEL

S, B = 16, 2
# Documents of each row (lengths), then padding up to S: row 0 has 3 documents and
# 2 padding tokens, row 1 two documents filling it.
ROW_DOCS = [[6, 3, 5], [9, 7]]
VOCAB, HIDDEN = 64, 32


def _cu_seqlens(row_docs=ROW_DOCS, seq=S):
    """Segment starts over the flattened rows; a row's padding is a segment of its own."""
    starts = []
    for b, docs in enumerate(row_docs):
        edges = np.cumsum([0] + docs)
        starts += [b * seq + int(e) for e in edges[:-1]]
        if edges[-1] < seq:
            starts.append(b * seq + int(edges[-1]))
    return torch.tensor(starts + [len(row_docs) * seq], dtype=torch.int32)


def _reference_attention(q, k, v, cu):
    """Per-document causal attention by an explicit softmax: q/k [B,Hq|Hkv,S,D], v [B,Hkv,S,Dv]."""
    Bq, Hq, Sq, D = q.shape
    g = Hq // k.shape[1]
    flat = [t.transpose(0, 1).reshape(t.shape[1], -1, t.shape[-1]) for t in (q, k, v)]  # [H, B*S, D|Dv]
    out = flat[0].new_zeros(Hq, Bq * Sq, v.shape[-1])
    c = cu.tolist()
    for a, b in zip(c[:-1], c[1:]):
        qs, ks, vs = (t[:, a:b] for t in flat)
        ks, vs = ks.repeat_interleave(g, 0), vs.repeat_interleave(g, 0)
        s = qs @ ks.transpose(1, 2) / math.sqrt(D)
        s = s.masked_fill(~torch.ones(b - a, b - a, dtype=torch.bool).tril(), -math.inf)
        out[:, a:b] = s.softmax(-1) @ vs
    return out.view(Hq, Bq, Sq, v.shape[-1]).transpose(0, 1)


def _qkv(seed=0, hq=4, hkv=2, d=8, dtype=torch.float64, dv=None):
    """q, k, v; v ``dv`` wide (default ``d``; MLA's differs)."""
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(B, h, S, w, generator=gen, dtype=dtype) for h, w in ((hq, d), (hkv, d), (hkv, dv or d))]


def test_doc_ids_and_segments():
    cu = _cu_seqlens()
    ids = doc_ids_from_cu_seqlens(cu, B, S)
    assert ids[0].tolist() == [0] * 6 + [1] * 3 + [2] * 5 + [3] * 2
    assert ids[1].tolist() == [4] * 9 + [5] * 7
    assert segment_bounds(ids) == cu.tolist()
    assert doc_ids_from_cu_seqlens(torch.tensor([0, S, 2 * S]), B, S) is None
    with pytest.raises(ValueError, match="row start"):
        doc_ids_from_cu_seqlens(torch.tensor([0, 10, 2 * S]), B, S)
    with pytest.raises(ValueError, match="strictly increasing"):
        doc_ids_from_cu_seqlens(torch.tensor([0, 5, 5, 2 * S]), B, S)


def test_dense_varlen_equals_per_document():
    q, k, v = (t.requires_grad_() for t in _qkv())
    cu = _cu_seqlens()
    out = varlen_attention(q, k, v, doc_ids_from_cu_seqlens(cu, B, S))
    dout = torch.randn_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = _reference_attention(q, k, v, cu)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    torch.testing.assert_close(out, ref)
    for g, r in zip(grads, ref_grads):
        torch.testing.assert_close(g, r)


# Layouts of the cp attention test: (row documents, kind). The first packs documents that
# leave whole ring blocks without a visible pair and rows with no key in a block; the
# second has documents crossing every chunk boundary.
CP_DOCS = {"short": [[2, 2, 1, 3, 4, 4], [1, 15]], "long": [[11, 5], [3, 13]]}


def _cp_attention_rank(rank, world, kind, row_docs, dv=None):
    q, k, v = _qkv(seed=3, dv=dv)
    cu = _cu_seqlens(row_docs)
    ids = doc_ids_from_cu_seqlens(cu, B, S)
    group = torch.distributed.group.WORLD
    local = [zigzag_split(t, rank, world, dim=2).clone().requires_grad_() for t in (q, k, v)]
    out = context_parallel_attention(*local, group, kind=kind, doc_ids=ids)
    dout = zigzag_split(torch.randn(q.shape[:3] + v.shape[3:], generator=torch.Generator().manual_seed(9),
                                    dtype=q.dtype), rank, world, dim=2)
    out.backward(dout)
    return [out.detach()] + [t.grad for t in local]


# dv: a value head width other than q/k's 8 (MLA), narrower and wider.
@pytest.mark.parametrize("kind,docs,cp,dv", [("ring", "short", 2, None), ("ring", "long", 2, None),
                                             ("a2a", "short", 2, None), ("a2a", "long", 2, None),
                                             ("ring", "short", 4, None), ("ring", "long", 2, 5),
                                             ("ring", "short", 2, 11), ("a2a", "long", 2, 5)])
def test_cp_packed_attention_equals_per_document(kind, docs, cp, dv):
    row_docs = CP_DOCS[docs]
    results = run_ranks(_cp_attention_rank, cp, kind, row_docs, dv, timeout=120)
    q, k, v = (t.requires_grad_() for t in _qkv(seed=3, dv=dv))
    ref = _reference_attention(q, k, v, _cu_seqlens(row_docs))
    dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(9), dtype=q.dtype)
    ref_grads = torch.autograd.grad(ref, (q, k, v), dout)
    for i, expected in enumerate([ref.detach(), *ref_grads]):
        got = zigzag_gather([r[i] for r in results], dim=2)
        torch.testing.assert_close(got, expected, msg=f"{kind} {docs}: output/grad {i}")


def test_ring_block_with_an_empty_row_merges_without_nan():
    """A document wholly in the second chunk of rank 0 sees nothing of rank 1's first chunk:
    those rows have lse -inf in that block; the single-rank path must agree."""
    from moe_fold.parallel.ring_attention import _merge_
    out = torch.zeros(1, 1, 2, 3)
    lse = torch.full((1, 1, 2), -math.inf)
    _merge_(out, lse, torch.ones(1, 1, 2, 3), torch.tensor([[[-math.inf, 0.5]]]))
    assert torch.isfinite(out).all()
    assert out[0, 0, 0].abs().sum() == 0 and torch.allclose(out[0, 0, 1], torch.ones(3))
    assert lse[0, 0, 0] == -math.inf and lse[0, 0, 1] == 0.5


# --------------------------------------------------------------------------- the model

def _config(model=None, **parallel):
    """The packed tests' model (``model``: ModelConfig overrides, e.g. MLA) in ``parallel``."""
    config = Config()
    config.model = ModelConfig(**{**dict(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_heads=4,
                                         num_kv_heads=2, ffn_hidden_size=48, seq_length=S, init_std=0.1),
                                  **(model or {})})
    c = config.moe
    c.num_experts, c.topk, c.ffn_hidden_size = 4, 2, 32
    c.aux_loss_coeff, c.z_loss_coeff = 0.1, 0.01
    c.dispatcher, c.capacity_factor = "alltoall", None
    c.expert_bias, c.score_function = True, "sigmoid"
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    config.train.seed = 5
    return config


def _packed_batch(pad_id=0, row_docs=ROW_DOCS):
    """A packed micro-batch of random documents: positions restart per document, the label
    after each document's last token and every padding label are masked."""
    gen = torch.Generator().manual_seed(1)
    tokens = torch.full((B, S + 1), pad_id, dtype=torch.int64)
    loss_mask = torch.zeros(B, S)
    positions = torch.zeros(B, S, dtype=torch.int64)
    token_mask = torch.zeros(B, S, dtype=torch.bool)
    for b, docs in enumerate(row_docs):
        at = 0
        for n in docs:
            tokens[b, at:at + n] = torch.randint(1, VOCAB, (n,), generator=gen)
            loss_mask[b, at:at + n - 1] = 1
            positions[b, at:at + n] = torch.arange(n)
            token_mask[b, at:at + n] = True
            at += n
        positions[b, at:] = torch.arange(S - at)
    return Batch(tokens[:, :-1], tokens[:, 1:], loss_mask, positions, _cu_seqlens(row_docs), token_mask)


def _per_document_logits(config, batch, row_docs=ROW_DOCS):
    """Logits of every real token, each document run alone through the one-process model."""
    model = build_model(config, ProcessGroups.single_process())
    out = torch.zeros(B, S, VOCAB)
    with torch.no_grad():
        for b, docs in enumerate(row_docs):
            at = 0
            for n in docs:
                out[b, at:at + n] = model.logits(batch.tokens[b:b + 1, at:at + n])[0]
                at += n
    return out


def _packed_logits_rank(rank, world, parallel):
    config = _config(**parallel)
    groups = create_process_groups(ParallelLayout(world, tp=parallel.get("tp", 1), cp=parallel.get("cp", 1),
                                                  ep=parallel.get("ep", 1)))
    model = build_model(config, groups)
    batch = _packed_batch().cp_slice(groups.rank_in("cp"), groups.size("cp"))
    docs = model.documents(batch.cu_seqlens, batch.token_mask, tuple(batch.tokens.shape))
    with torch.no_grad():
        return model.logits(batch.tokens, batch.positions, docs)


LAYOUTS = {
    "dense": (1, {}),
    "tp2": (2, dict(tp=2, sequence_parallel=True)),
    "cp2-ring": (2, dict(cp=2, cp_kind="ring")),
    "cp2-a2a-ep2": (2, dict(cp=2, cp_kind="a2a", ep=2)),
}


@pytest.mark.parametrize("layout", list(LAYOUTS))
def test_packed_model_equals_documents_run_separately(layout):
    world, parallel = LAYOUTS[layout]
    if world == 1:
        results = [_packed_logits_rank_single(parallel)]
    else:
        results = run_ranks(_packed_logits_rank, world, parallel, timeout=180)
    cp = parallel.get("cp", 1)
    if cp > 1:
        got = zigzag_gather(results[:cp], dim=1)
    else:
        got = results[0]
    batch = _packed_batch()
    expected = _per_document_logits(_config(), batch)
    real = batch.token_mask
    torch.testing.assert_close(got[real], expected[real], rtol=1e-4, atol=1e-5)


def _packed_logits_rank_single(parallel):
    config = _config(**parallel)
    model = build_model(config, ProcessGroups.single_process())
    batch = _packed_batch()
    docs = model.documents(batch.cu_seqlens, batch.token_mask, tuple(batch.tokens.shape))
    with torch.no_grad():
        return model.logits(batch.tokens, batch.positions, docs)


# --------------------------------------------------------------------------- padding

def _step_values(batch):
    """Loss, grads, router losses and statistics of one training micro-batch (one process)."""
    torch.manual_seed(0)
    config = _config()
    model = build_model(config, ProcessGroups.single_process())
    with router_outputs(model) as seen:
        losses = forward_backward(model, [batch], ProcessGroups.single_process(), config)
    layers = [m for m in model.modules() if isinstance(m, MoELayer)]
    assert [router for router, _ in seen] == [layer.router for layer in layers]
    return {
        "loss": losses.sum(),
        "grads": {n: p.grad.clone() for n, p in model.named_parameters()},
        "router": [{k: v.clone() for k, v in out.losses.items()} for _, out in seen],
        "stats": [out.stats.tokens_per_expert.clone() for _, out in seen],
        "bias_counts": [layer.router._bias_counts.clone() for layer in layers],
    }


def test_padding_counts_in_no_loss_or_router_statistic():
    """The same documents with the padding filled by other token ids give the same loss,
    grads, aux/z losses, expert counts and expert-bias counts; the counts add up to
    (real tokens) * topk, so no padding token is in them."""
    base = _step_values(_packed_batch(pad_id=0))
    other = _step_values(_packed_batch(pad_id=7))
    torch.testing.assert_close(base["loss"], other["loss"])
    for name in base["grads"]:
        torch.testing.assert_close(base["grads"][name], other["grads"][name], msg=name)
    for a, b in zip(base["router"], other["router"]):
        assert set(a) == {"aux", "z"}
        for k in a:
            torch.testing.assert_close(a[k], b[k])
    real = int(_packed_batch().token_mask.sum())
    for a, b, c in zip(base["stats"], other["stats"], base["bias_counts"]):
        assert torch.equal(a, b)
        assert int(a.sum()) == real * 2 and int(c.sum()) == real * 2
    assert real < B * S  # the batch does hold padding


def test_loader_token_mask_marks_padding(tmp_path):
    docs = [np.arange(1, 1 + n) for n in (5, 9, 4, 14, 3)]
    prefix = write_indexed_dataset(tmp_path / "d", docs, 258, 0)
    ds = GPTDataset(prefix, 12, seed=0, packing=True)
    for j in range(len(ds)):
        s = ds.raw_sample(j)
        used = int(s.cu_seqlens[-2]) if not s.token_mask.all() else 12
        assert s.token_mask.tolist() == [t < used for t in range(12)]
        assert (s.loss_mask[~s.token_mask] == 0).all()
    batch = collate([ds.raw_sample(j) for j in range(len(ds))])
    assert batch.token_mask.shape == batch.tokens.shape and batch.token_mask.dtype == torch.bool


# --------------------------------------------------------------------------- training steps

def _packed_steps_rank(rank, world, parallel, model=None):
    from moe_fold.training.grads import sync_grads

    config = _config(model, **parallel)
    groups = create_process_groups(ParallelLayout(world, cp=parallel.get("cp", 1), pp=parallel.get("pp", 1)))
    model = build_model(config, groups)
    cp, cp_rank = groups.size("cp"), groups.rank_in("cp")
    batches = [_packed_batch(row_docs=docs).cp_slice(cp_rank, cp) for docs in (ROW_DOCS, [[3, 13], [16]])]
    losses = forward_backward(model, batches, groups, config)
    sync_grads(model.parameters(), groups)
    loss = losses.sum().clone()
    torch.distributed.all_reduce(loss, group=groups.dp_cp)
    return loss.item() / groups.size("dp_cp"), {n: p.grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("parallel,model", [(dict(cp=2, cp_kind="ring"), None), (dict(pp=2), None),
                                            (dict(cp=2, cp_kind="ring"), MLA_MODEL),
                                            (dict(cp=2, cp_kind="a2a"), MLA_MODEL)],
                         ids=["cp2-ring", "pp2", "mla-cp2-ring", "mla-cp2-a2a"])
def test_packed_training_step_equals_one_process(parallel, model):
    """Two packed micro-batches through forward_backward: ring cp 2 (grads too) and a
    2-stage pipeline, whose middle stage gets the documents as side input, give one
    process's loss; MLA under ring and a2a cp 2 the loss and grads too."""
    config = _config(model)
    reference = build_model(config, ProcessGroups.single_process())
    batches = [_packed_batch(row_docs=docs) for docs in (ROW_DOCS, [[3, 13], [16]])]
    loss = forward_backward(reference, batches, ProcessGroups.single_process(), config).sum().item()
    results = run_ranks(_packed_steps_rank, 2, parallel, model, timeout=180)
    for got, grads in results:
        assert got == pytest.approx(loss, rel=1e-5)
        if "cp" in parallel:
            for name, p in reference.named_parameters():
                torch.testing.assert_close(grads[name], p.grad, rtol=1e-4, atol=1e-6, msg=name)


def test_sequence_starts_cut_each_row_at_its_start_and_its_documents():
    """The recurrent layers' sequences: one at every row start and every document start
    (cu_seqlens over the flattened rows, the same on the host), the resets where a document
    starts; Documents made without them makes them from its ids."""
    doc_ids = torch.tensor([[0, 0, 0, 1, 1, 2, 2, 2], [3, 3, 3, 3, 4, 4, 4, 4]])
    (starts,) = sequence_starts(doc_ids, None, torch.device("cpu"))
    assert starts.cu_seqlens.tolist() == starts.cu_seqlens_cpu.tolist() == [0, 3, 5, 8, 12, 16]
    assert starts.cu_seqlens_cpu.device.type == "cpu" and starts.cu_seqlens.dtype == torch.int64
    assert starts.resets.int().tolist() == [[1, 0, 0, 1, 0, 1, 0, 0], [1, 0, 0, 0, 1, 0, 0, 0]]
    (made,) = Documents(doc_ids, None).starts
    assert torch.equal(made.resets, starts.resets) and torch.equal(made.cu_seqlens, starts.cu_seqlens)
    # A segment that does not begin a row: its row starts carry (no reset) unless a document starts there.
    later = starts_from_resets(torch.tensor([[False, True, False], [False, False, False]]), torch.device("cpu"))
    assert later.cu_seqlens_cpu.tolist() == [0, 1, 3, 6]
