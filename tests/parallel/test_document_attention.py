"""Document-masked attention as one fused call (:mod:`moe_fold.parallel.document_attention`)
against an independent per-document reference, on both kernels of the device rule.

- ``cpu_flash``: what CPU runs (aten's CPU flash kernel once per document).
- ``flex_math``: the code path every other device runs (one ``flex_block_attention`` call per
  micro-batch or ring block, the backward of ring blocks by recompute through the
  log-sum-exp), forced on CPU with flex replaced by :func:`dense_block_attention` below: the
  same contract (out, lse, masks, a row without keys gets out 0 and lse -inf,
  differentiable in both), written as an explicit masked softmax. flex itself cannot run a
  backward on CPU (torch refuses); its forward is checked against the same function here,
  and its compiled CUDA kernel forward and backward in the ``gpu`` tests at the end.

The reference is attention of each document alone: a plain causal SDPA call per document
(float64), with GQA by repeating kv heads. Tolerance: torch.testing's float64 default
(rtol 1e-7, atol 1e-7) unless a test names another.
"""

import math

import pytest
import torch
import torch.nn.functional as F

from moe_fold.launch import run_ranks
from moe_fold.parallel import document_attention
from moe_fold.parallel.context_parallel import context_parallel_attention, zigzag_gather, zigzag_split
from moe_fold.parallel.document_attention import document_kernel, flex_block_attention, flex_block_backward
from moe_fold.parallel.varlen import varlen_attention

KERNELS = ["cpu_flash", "flex_math"]


def dense_block_attention(q, k, v, doc_q, doc_k, causal, scale=None):
    """flex_block_attention's contract as an explicit masked softmax (see the module doc)."""
    Sq, Sk = q.shape[2], k.shape[2]
    scale = q.shape[-1] ** -0.5 if scale is None else scale
    g = q.shape[1] // k.shape[1]
    allowed = torch.ones(q.shape[0], 1, Sq, Sk, dtype=torch.bool)
    if doc_q is not None:
        allowed = allowed & (doc_q[:, None, :, None] == doc_k[:, None, None, :])
    if causal:
        allowed = allowed & torch.ones(Sq, Sk, dtype=torch.bool).tril()
    acc = torch.float64 if q.dtype == torch.float64 else torch.float32
    s = (q.to(acc) @ k.to(acc).repeat_interleave(g, 1).transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
    seen = allowed.any(-1).expand(s.shape[:3])  # [B, Hq, Sq]
    top = s.amax(-1).masked_fill(~seen, 0).detach()
    p = (s - top.unsqueeze(-1)).exp()
    total = p.sum(-1)
    # torch.where keeps the grads of rows without keys at 0 (no log(0) in the graph).
    lse = torch.where(seen, top + total.clamp_min(torch.finfo(acc).tiny).log(), -math.inf)
    out = (p / total.clamp_min(torch.finfo(acc).tiny).unsqueeze(-1)) @ v.to(acc).repeat_interleave(g, 1)
    return out.to(q.dtype), lse


def use_flex_path(block, monkeypatch=None):
    """The device rule's flex path on CPU, with ``block`` as the per-block attention
    (through ``monkeypatch``, or for the rest of a rank's process without one)."""
    setter = monkeypatch.setattr if monkeypatch else (lambda obj, name, value: setattr(obj, name, value))
    setter(document_attention, "document_kernel", lambda device: "flex")
    setter(document_attention, "flex_block_attention", block)


def _use(kernel, monkeypatch=None):
    """Run the ``kernel`` path of the device rule on CPU (``flex_math``: see the module doc)."""
    if kernel != "cpu_flash":
        use_flex_path(dense_block_attention, monkeypatch)


def doc_ids_of(row_docs, seq):
    """``[B, seq]`` ids, documents numbered over the batch; a row's tail is a document too."""
    ids, n = [], 0
    for docs in row_docs:
        lengths = list(docs) + ([seq - sum(docs)] if sum(docs) < seq else [])
        row = []
        for length in lengths:
            row += [n] * length
            n += 1
        ids.append(row)
    return torch.tensor(ids)


def per_document_reference(q, k, v, doc_ids, scale=None):
    """Causal SDPA on each document alone (documents are runs of equal ids in a row)."""
    g = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    rows = []
    for b in range(q.shape[0]):
        ids = doc_ids[b].tolist()
        starts = [i for i in range(len(ids)) if i == 0 or ids[i] != ids[i - 1]] + [len(ids)]
        rows.append(torch.cat([F.scaled_dot_product_attention(q[b:b + 1, :, a:e], k[b:b + 1, :, a:e],
                                                              v[b:b + 1, :, a:e], is_causal=True, scale=scale)
                               for a, e in zip(starts[:-1], starts[1:])], dim=2))
    return torch.cat(rows)


def _qkv(b, hq, hkv, s, d, dv, seed, dtype=torch.float64):
    gen = torch.Generator().manual_seed(seed)
    return [torch.randn(b, h, s, w, generator=gen, dtype=dtype) for h, w in ((hq, d), (hkv, d), (hkv, dv))]


# --------------------------------------------------------------------------- the rule and the ids' device

def test_kernel_rule_by_device():
    # meta: the dry run's tensors (flex does not run on them; the CPU kernel's meta functions do)
    table = {"cpu": "cpu_flash", "meta": "cpu_flash", "cuda": "flex", "cuda:1": "flex", "xpu": "flex"}
    assert {name: document_kernel(torch.device(name)) for name in table} == table
    assert set(table.values()) == set(document_attention.DOCUMENT_KERNELS)


def test_batch_to_a_device_keeps_cu_seqlens_on_the_host():
    """cu_seqlens is read on the host every micro-batch (validation, document ids): moving
    a batch leaves it there, every other tensor goes ("meta" stands in for a GPU)."""
    from moe_fold.data.loader import Batch
    ids = torch.zeros(2, 8, dtype=torch.int64)
    batch = Batch(ids, ids, torch.ones(2, 8), ids, torch.tensor([0, 3, 8, 16], dtype=torch.int32),
                  torch.ones(2, 8, dtype=torch.bool))
    moved = batch.to("meta")
    assert moved.cu_seqlens.device.type == "cpu" and torch.equal(moved.cu_seqlens, batch.cu_seqlens)
    for name in ("tokens", "labels", "loss_mask", "positions", "token_mask"):
        assert getattr(moved, name).device.type == "meta", name


# --------------------------------------------------------------------------- flex itself (forward on CPU)

# (doc_q, doc_k, causal, Sq, Sk): a square causal block with documents; an off-diagonal
# block whose first query document has no key (out 0, lse -inf); causal without documents;
# a rectangle with neither.
FLEX_CASES = {
    "docs-causal": ([[0] * 6 + [1] * 3 + [2] * 4, [3] * 9 + [4] * 4], None, True, 13, 13),
    "docs-rows-without-keys": ([[0] * 5 + [1] * 8, [2] * 13], [[1] * 7 + [3] * 3, [2] * 10], False, 13, 10),
    "causal": (None, None, True, 13, 13),
    "full": (None, None, False, 13, 10),
}


# Eager flex on CPU is the unfused reference implementation, which is the point here.
@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
@pytest.mark.parametrize("dtype", [torch.float64, torch.float32])
@pytest.mark.parametrize("case", list(FLEX_CASES))
def test_flex_forward_equals_masked_softmax(case, dtype):
    """The real flex_attention (eager, forward: CPU has no flex backward) gives the
    stand-in's out and natural-log lse, GQA 6 over 2 heads, v narrower than q/k."""
    doc_q, doc_k, causal, sq, sk = FLEX_CASES[case]
    doc_q = None if doc_q is None else torch.tensor(doc_q)
    doc_k = doc_q if doc_k is None and doc_q is not None else (None if doc_k is None else torch.tensor(doc_k))
    q = _qkv(2, 6, 2, sq, 8, 5, seed=1, dtype=dtype)[0]
    k, v = _qkv(2, 6, 2, sk, 8, 5, seed=2, dtype=dtype)[1:]
    out, lse = flex_block_attention(q, k, v, doc_q, doc_k, causal, 0.3)
    ref_out, ref_lse = dense_block_attention(q, k, v, doc_q, doc_k, causal, 0.3)
    tol = {} if dtype == torch.float64 else dict(rtol=1e-5, atol=1e-5)
    assert out.dtype == dtype and lse.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    torch.testing.assert_close(out, ref_out, **tol)
    torch.testing.assert_close(lse, ref_lse, **tol)
    if case == "docs-rows-without-keys":
        assert (lse[0, :, :5] == -math.inf).all() and (out[0, :, :5] == 0).all()


# --------------------------------------------------------------------------- one rank

# (row documents, S, Hq, Hkv, D, Dv): GQA with odd sizes; MLA-like (v narrower than q/k)
# with three query heads per kv head; MHA with one long document per row.
ONE_RANK = {
    "gqa-odd": ([[6, 3, 5], [9, 7, 1]], 17, 6, 2, 8, 8),
    "mla": ([[4, 1, 6], [11]], 11, 3, 1, 10, 6),
    "mha-long": ([[20], [13, 7]], 20, 4, 4, 8, 8),
}


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("case", list(ONE_RANK))
def test_varlen_equals_per_document(kernel, case, monkeypatch):
    row_docs, s, hq, hkv, d, dv = ONE_RANK[case]
    _use(kernel, monkeypatch)
    ids = doc_ids_of(row_docs, s)
    q, k, v = (t.requires_grad_() for t in _qkv(2, hq, hkv, s, d, dv, seed=5))
    out = varlen_attention(q, k, v, ids)
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(6), dtype=out.dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = per_document_reference(q, k, v, ids)
    for got, expected in zip([out, *grads], [ref, *torch.autograd.grad(ref, (q, k, v), dout)]):
        torch.testing.assert_close(got, expected)


def test_flex_block_backward_shares_sum_to_full_grads(monkeypatch):
    """Two key blocks, each backpropagated alone with the FINAL out and lse (the ring's
    backward): dq sums and dk/dv concatenate to the grads of attention over all keys. The
    second document starts after the first block's keys: its query rows see no key there
    (weight 0, no NaN)."""
    monkeypatch.setattr(document_attention, "flex_block_attention", dense_block_attention)
    q, k, v = _qkv(1, 4, 2, 12, 6, 5, seed=7)
    doc = torch.tensor([[0] * 7 + [1] * 5])
    dout = torch.randn(1, 4, 12, 5, generator=torch.Generator().manual_seed(8), dtype=q.dtype)
    qr, kr, vr = (t.clone().requires_grad_() for t in (q, k, v))
    ref = per_document_reference(qr, kr, vr, doc)
    ref_grads = torch.autograd.grad(ref, (qr, kr, vr), dout)
    out, lse = dense_block_attention(q, k, v, doc, doc, True, None)
    scale = 6 ** -0.5
    # Block 1: keys 0..5; block 2: keys 6..11, which only queries 6..11 see (causal).
    first = flex_block_backward(dout, q, k[:, :, :6], v[:, :, :6], out, lse, doc, doc[:, :6], True, scale)
    second = flex_block_backward(dout[:, :, 6:], q[:, :, 6:], k[:, :, 6:], v[:, :, 6:], out[:, :, 6:],
                                 lse[:, :, 6:], doc[:, 6:], doc[:, 6:], True, scale)
    dq = first[0].clone()
    dq[:, :, 6:] += second[0]
    torch.testing.assert_close(dq, ref_grads[0])
    torch.testing.assert_close(torch.cat([first[1], second[1]], 2), ref_grads[1])
    torch.testing.assert_close(torch.cat([first[2], second[2]], 2), ref_grads[2])


# --------------------------------------------------------------------------- cp on gloo ranks

# (kind, row documents, Hq, Hkv, D, Dv); S = 16 on every case, B = 2. "none": no documents
# (plain causal ring: the flex block path without a document mask).
CP_CASES = [("ring", [[2, 2, 1, 3, 4, 4], [1, 15]], 4, 2, 8, 8), ("ring", [[11, 5], [3, 13]], 6, 3, 8, 5),
            ("ring", None, 4, 2, 8, 8), ("a2a", [[2, 2, 1, 3, 4, 4], [1, 15]], 4, 2, 8, 8),
            ("a2a", [[11, 5], [3, 13]], 4, 2, 6, 11)]
CP_S = 16


def _cp_rank(rank, world, kernel, cases):
    _use(kernel)
    results = []
    for i, (kind, row_docs, hq, hkv, d, dv) in enumerate(cases):
        q, k, v = _qkv(2, hq, hkv, CP_S, d, dv, seed=10 + i)
        ids = None if row_docs is None else doc_ids_of(row_docs, CP_S)
        local = [zigzag_split(t, rank, world, dim=2).clone().requires_grad_() for t in (q, k, v)]
        out = context_parallel_attention(*local, torch.distributed.group.WORLD, kind=kind, doc_ids=ids)
        dout = torch.randn(q.shape[:3] + v.shape[3:], generator=torch.Generator().manual_seed(20 + i),
                           dtype=q.dtype)
        out.backward(zigzag_split(dout, rank, world, dim=2))
        results.append([out.detach()] + [t.grad for t in local])
    return results


@pytest.mark.parametrize("kernel", KERNELS)
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_attention_equals_per_document(kernel, cp):
    cases = [c for c in CP_CASES if cp == 2 or c[0] == "ring"]
    results = run_ranks(_cp_rank, cp, kernel, cases, timeout=180)
    for i, (kind, row_docs, hq, hkv, d, dv) in enumerate(cases):
        q, k, v = (t.requires_grad_() for t in _qkv(2, hq, hkv, CP_S, d, dv, seed=10 + i))
        ids = doc_ids_of(row_docs or [[CP_S], [CP_S]], CP_S)
        ref = per_document_reference(q, k, v, ids)
        dout = torch.randn(ref.shape, generator=torch.Generator().manual_seed(20 + i), dtype=q.dtype)
        for j, expected in enumerate([ref.detach(), *torch.autograd.grad(ref, (q, k, v), dout)]):
            got = zigzag_gather([r[i][j] for r in results], dim=2)
            torch.testing.assert_close(got, expected, msg=f"{kernel} cp{cp} case {i} ({kind}): output/grad {j}")


def _dynamic_flex_rank(rank, world, ep, model_overrides):
    from tests.training.test_dynamic_cp import _dynamic_rank
    _use("flex_math")
    return _dynamic_rank(rank, world, ep, model_overrides)


@pytest.mark.parametrize("model_overrides", [None, "mla"], ids=["mha", "mla"])
def test_dynamic_cp_on_the_flex_path_equals_one_process(model_overrides):
    """Dynamic cp (sub-groups of 1 and 2 ranks: local varlen and ring blocks) on the flex
    path against the single-process model on CPU's kernel (test_dynamic_cp's reference)."""
    from tests.training.test_dynamic_cp import _reference
    from tests.models.test_mla import MLA_MODEL
    overrides = MLA_MODEL if model_overrides == "mla" else None
    results = run_ranks(_dynamic_flex_rank, 2, 2, overrides, timeout=240)
    loss, grads = _reference(overrides)
    for r in results:
        assert r["loss"] == pytest.approx(loss, rel=1e-5)
        for name, g in grads.items():
            torch.testing.assert_close(torch.from_numpy(r["grads"][name]), torch.from_numpy(g),
                                       rtol=1e-4, atol=1e-6, msg=name)


# --------------------------------------------------------------------------- the CUDA kernel

# Head widths of the GPU runs (flex's kernels want at least 16): MHA/GQA 64 and 32,
# deepseek-v3-tiny's MLA widths (q/k 48, v 32).
CUDA_WIDTHS = {"gqa-odd": (64, 64), "mla": (48, 32), "mha-long": (32, 32)}


@pytest.mark.gpu
@pytest.mark.parametrize("dtype,tol", [(torch.float32, dict(rtol=2e-3, atol=2e-3)),
                                       (torch.bfloat16, dict(rtol=3e-2, atol=3e-2))])
@pytest.mark.parametrize("case", list(ONE_RANK))
def test_cuda_flex_varlen_equals_per_document(case, dtype, tol):
    """The compiled flex kernel, forward and backward, against the per-document reference
    in float64 on CPU."""
    row_docs, s, hq, hkv = ONE_RANK[case][:4]
    d, dv = CUDA_WIDTHS[case]
    ids = doc_ids_of(row_docs, s)
    q, k, v = _qkv(2, hq, hkv, s, d, dv, seed=5)
    dout = torch.randn(2, hq, s, dv, generator=torch.Generator().manual_seed(6), dtype=torch.float64)
    gpu = [t.to("cuda", dtype).requires_grad_() for t in (q, k, v)]
    assert document_kernel(gpu[0].device) == "flex"
    out = varlen_attention(*gpu, ids.cuda())
    grads = torch.autograd.grad(out, gpu, dout.to("cuda", dtype))
    cpu = [t.clone().requires_grad_() for t in (q, k, v)]
    ref = per_document_reference(*cpu, ids)
    for got, expected in zip([out, *grads], [ref, *torch.autograd.grad(ref, cpu, dout)]):
        torch.testing.assert_close(got.double().cpu(), expected, **tol)


@pytest.mark.gpu
def test_cuda_flex_block_lse_and_backward_with_rows_without_keys(monkeypatch):
    """The compiled kernel's lse, and the ring's recompute backward through it, against the
    stand-in on CPU, on a block where some query rows see no key."""
    doc_q, doc_k, causal, sq, sk = FLEX_CASES["docs-rows-without-keys"]
    doc_q, doc_k = torch.tensor(doc_q), torch.tensor(doc_k)
    q = _qkv(2, 6, 2, sq, 16, 16, seed=1, dtype=torch.float32)[0]
    k, v = _qkv(2, 6, 2, sk, 16, 16, seed=2, dtype=torch.float32)[1:]
    out, lse = dense_block_attention(q, k, v, doc_q, doc_k, causal, 0.3)
    lse_final = lse.clamp_min(0.5)  # as if other blocks gave every row some keys
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(3))
    cuda = [t.cuda() for t in (q, k, v)]
    got_out, got_lse = flex_block_attention(*cuda, doc_q.cuda(), doc_k.cuda(), causal, 0.3)
    torch.testing.assert_close(got_out.cpu(), out, rtol=2e-3, atol=2e-3)
    torch.testing.assert_close(got_lse.cpu(), lse, rtol=2e-3, atol=2e-3)
    got = flex_block_backward(dout.cuda(), *cuda, out.cuda(), lse_final.cuda(), doc_q.cuda(), doc_k.cuda(),
                              causal, 0.3)
    monkeypatch.setattr(document_attention, "flex_block_attention", dense_block_attention)
    expected = flex_block_backward(dout, q, k, v, out, lse_final, doc_q, doc_k, causal, 0.3)
    for g, e in zip(got, expected):
        torch.testing.assert_close(g.cpu(), e, rtol=2e-3, atol=2e-3)
