"""Attention sinks, sliding window and chunked local attention (docs/attention.md) against
a plain masked softmax, on one process and on cp ranks (ring and a2a), with and without
packed documents, on both kernels of the device rule (``cpu``: what CPU runs;
``flex_math``: the flex path every other device runs, with flex replaced by
:func:`~moe_fold.parallel.document_attention.math_block_attention`, its contract on CPU,
since flex has no backward on CPU; the real flex forward is checked against it here).

The reference builds its mask with Python loops over (query, key) from each token's
document and its position in it, and puts the sink in as one more softmax column:
nothing is shared with the code under test. Tolerance: float64 (rtol 1e-7, atol 1e-7).
"""

import math

import pytest
import torch

from moe_fold.launch import run_ranks
from moe_fold.parallel import document_attention
from moe_fold.parallel.context_parallel import context_parallel_attention, zigzag_gather, zigzag_split
from moe_fold.parallel.document_attention import flex_block_attention, math_block_attention
from moe_fold.parallel.varlen import chunk_doc_ids
from tests.parallel.test_document_attention import doc_ids_of, use_flex_path

S, B = 16, 2
ROW_DOCS = [[5, 11], [3, 6, 7]]


def reference(q, k, v, doc_ids, window, chunk, sinks, scale=None):
    """Masked softmax: query i sees key j iff same document, j <= i, and (window) i - j <
    window, (chunk) the same chunk of in-document positions; ``sinks [Hq]`` one more column."""
    Bq, Hq, Sq, D = q.shape
    scale = D ** -0.5 if scale is None else scale
    g = Hq // k.shape[1]
    k, v = k.repeat_interleave(g, 1), v.repeat_interleave(g, 1)
    allowed = torch.zeros(Bq, 1, Sq, Sq, dtype=torch.bool)
    for b in range(Bq):
        doc = doc_ids[b].tolist() if doc_ids is not None else [0] * Sq
        pos = [i - doc.index(doc[i]) for i in range(Sq)]
        for i in range(Sq):
            for j in range(i + 1):
                ok = doc[i] == doc[j]
                ok &= not window or i - j < window
                ok &= not chunk or pos[i] // chunk == pos[j] // chunk
                allowed[b, 0, i, j] = ok
    s = (q @ k.transpose(-1, -2) * scale).masked_fill(~allowed, -math.inf)
    if sinks is not None:
        s = torch.cat([s, sinks.view(1, Hq, 1, 1).expand(Bq, Hq, Sq, 1)], dim=-1)
    p = s.softmax(-1)[..., :Sq]
    return p @ v


def _qkv(hq=4, hkv=2, d=8, seed=0):
    gen = torch.Generator().manual_seed(seed)
    q, k, v = (torch.randn(B, h, S, d, generator=gen, dtype=torch.float64) for h in (hq, hkv, hkv))
    sinks = torch.randn(hq, generator=gen, dtype=torch.float64)
    return q, k, v, sinks


def _use(kernel, monkeypatch=None):
    if kernel != "cpu":
        use_flex_path(math_block_attention, monkeypatch)


# name -> (documents?, window, chunk, sinks?)
CASES = {
    "window": (False, 5, 0, False),
    "window-docs-sinks": (True, 4, 0, True),
    "chunk": (False, 0, 6, False),
    "chunk-docs-sinks": (True, 0, 4, True),
    "sinks": (False, 0, 0, True),
    "sinks-docs": (True, 0, 0, True),
}


def _attend(q, k, v, sinks, case, group, kind):
    docs, window, chunk, with_sinks = CASES[case]
    ids = doc_ids_of(ROW_DOCS, S) if docs else None
    if chunk:  # what models/attention.py does
        ids = chunk_doc_ids(ids, B, S, chunk, q.device)
    return context_parallel_attention(q, k, v, group, kind=kind, doc_ids=ids, window=window,
                                      sinks=sinks if with_sinks else None)


def _expected(case, q, k, v, sinks, dout):
    docs, window, chunk, with_sinks = CASES[case]
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    ref = reference(*leaves[:3], doc_ids_of(ROW_DOCS, S) if docs else None, window, chunk,
                    leaves[3] if with_sinks else None)
    grads = torch.autograd.grad(ref, leaves if with_sinks else leaves[:3], dout)
    return [ref.detach(), *grads]


@pytest.mark.parametrize("kernel", ["cpu", "flex_math"])
@pytest.mark.parametrize("case", list(CASES))
def test_one_process_equals_masked_softmax(case, kernel, monkeypatch):
    _use(kernel, monkeypatch)
    q, k, v, sinks = _qkv(seed=1)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(2), dtype=q.dtype)
    leaves = [t.clone().requires_grad_() for t in (q, k, v, sinks)]
    out = _attend(*leaves, case, None, "ring")
    with_sinks = CASES[case][3]
    got = [out.detach(), *torch.autograd.grad(out, leaves if with_sinks else leaves[:3], dout)]
    for j, (g, e) in enumerate(zip(got, _expected(case, q, k, v, sinks, dout))):
        torch.testing.assert_close(g, e, msg=lambda m: f"{case} {kernel} output/grad {j}: {m}")


def _cp_rank(rank, world, kernel, kinds):
    _use(kernel)
    results = {}
    for kind in kinds:
        for i, case in enumerate(CASES):
            q, k, v, sinks = _qkv(seed=10 + i)
            local = [zigzag_split(t, rank, world, dim=2).clone().requires_grad_() for t in (q, k, v)]
            sink = sinks.clone().requires_grad_()
            out = _attend(*local, sink, case, torch.distributed.group.WORLD, kind)
            dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(20 + i), dtype=q.dtype)
            out.backward(zigzag_split(dout, rank, world, dim=2))
            results[kind, case] = [out.detach()] + [t.grad for t in local] + [sink.grad]
    return results


@pytest.mark.parametrize("kernel", ["cpu", "flex_math"])
@pytest.mark.parametrize("cp", [2, 4])
def test_cp_equals_masked_softmax(cp, kernel):
    """Ring (cp 2 and 4) and a2a (cp 2): every rank's output and q/k/v grads are its
    shard of the reference's; the sink grads summed over the cp ranks (what the grad
    sync does) are the reference's."""
    kinds = ["ring", "a2a"] if cp == 2 else ["ring"]
    results = run_ranks(_cp_rank, cp, kernel, kinds, timeout=240)
    for kind in kinds:
        for i, case in enumerate(CASES):
            q, k, v, sinks = _qkv(seed=10 + i)
            dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(20 + i), dtype=q.dtype)
            expected = _expected(case, q, k, v, sinks, dout)
            where = f"{kind} cp{cp} {kernel} {case}"
            for j in range(4):
                got = zigzag_gather([r[kind, case][j] for r in results], dim=2)
                torch.testing.assert_close(got, expected[j], msg=lambda m: f"{where} output/grad {j}: {m}")
            if CASES[case][3]:
                got = sum(r[kind, case][4] for r in results)
                torch.testing.assert_close(got, expected[4], msg=lambda m: f"{where} sink grad: {m}")


@pytest.mark.filterwarnings("ignore:flex_attention called without torch.compile")
def test_flex_forward_with_window_equals_math_kernel():
    """The real flex_attention (eager forward on CPU) under the window and document
    mask_mod gives math_block_attention's out and lse, rows without keys included."""
    q, k, v, _ = _qkv(hq=6, hkv=2, seed=3)
    doc = doc_ids_of(ROW_DOCS, S)
    pos_q, pos_k = torch.arange(S) + 3, torch.arange(S)  # an off-diagonal block: queries later
    for window in (1, 4):
        args = (q, k, v, doc, doc, True, 0.3)
        got = flex_block_attention(*args, pos_q=pos_q, pos_k=pos_k, window=window)
        expected = math_block_attention(*args, pos_q=pos_q, pos_k=pos_k, window=window)
        if window == 1:
            assert torch.isinf(expected[1]).any(), "no row without keys: the case is too easy"
        for g, e in zip(got, expected):
            torch.testing.assert_close(g, e)


def test_chunk_doc_ids_cut_documents_at_in_document_chunks():
    ids = chunk_doc_ids(torch.tensor([[0, 0, 0, 0, 0, 1, 1, 1, 1, 1]]), 1, 10, 3, torch.device("cpu"))
    # positions 0..4 and 0..4: chunks {0,1,2}, {3,4} in each document
    runs = [len(list(g)) for _, g in __import__("itertools").groupby(ids[0].tolist())]
    assert runs == [3, 2, 3, 2]
    assert len(set(ids[0].tolist())) == 4
    plain = chunk_doc_ids(None, 2, 7, 3, torch.device("cpu"))
    assert plain[0].tolist() == [0, 0, 0, 1, 1, 1, 2] and len(set(plain.flatten().tolist())) == 6


# --------------------------------------------------------------------------- sampling (KV cache)

@pytest.mark.parametrize("features", [
    dict(attention_sinks=True, sliding_window=3, local_attention_layers=[1, 0]),
    dict(attention_chunk=5, local_attention_layers=[1, 0], rope_layers=[1, 0], qk_norm=True, qk_norm_scope="l2",
         attn_temperature_tuning=True, attn_temperature_floor=3)], ids=["gptoss", "llama4"])
def test_cached_decode_equals_full_forward(features):
    """Prefill 7 tokens, then one at a time: the cached path's window, chunks, sinks and
    temperature give one full forward's logits."""
    from moe_fold.config import load_config
    from moe_fold.layout import ProcessGroups
    from moe_fold.models.kv_cache import KVCache
    from moe_fold.models.model import build_model
    from moe_fold.models.sampling import forward_cached
    overrides = [f"model.{k}={str(v).lower() if isinstance(v, bool) else v}" for k, v in features.items()]
    config = load_config("mixtral-tiny", ["parallel.ep=1", "model.num_layers=2", "moe.router_dtype=float64",
                                          *overrides])
    model = build_model(config, ProcessGroups.single_process()).double().eval()
    ids = torch.randint(0, 256, (2, 16), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        full = model.logits(ids)  # [2, 16, V]
    cache = KVCache([0, 1])
    steps = [forward_cached(model, ids[:, :7], cache)] + [forward_cached(model, ids[:, t:t + 1], cache)
                                                          for t in range(7, 16)]
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-10, atol=1e-10)


# --------------------------------------------------------------------------- the CUDA kernel

@pytest.mark.gpu
@pytest.mark.parametrize("case", ["window-docs-sinks", "window"])
def test_cuda_flex_window_and_sinks_equal_masked_softmax(case):
    """The compiled flex kernel with the window term and sinks, forward and backward (head
    width 32: flex's kernels want at least 16), against the float64 reference on CPU."""
    docs, window, chunk, with_sinks = CASES[case]
    q, k, v, sinks = _qkv(d=32, seed=4)
    dout = torch.randn(q.shape, generator=torch.Generator().manual_seed(5), dtype=q.dtype)
    gpu = [t.to("cuda", torch.float32).requires_grad_() for t in (q, k, v, sinks)]
    ids = doc_ids_of(ROW_DOCS, S).cuda() if docs else None
    out = context_parallel_attention(*gpu[:3], None, doc_ids=ids, window=window,
                                     sinks=gpu[3] if with_sinks else None)
    grads = torch.autograd.grad(out, gpu if with_sinks else gpu[:3], dout.to("cuda", torch.float32))
    for got, expected in zip([out, *grads], _expected(case, q, k, v, sinks, dout)):
        torch.testing.assert_close(got.double().cpu(), expected, rtol=2e-3, atol=2e-3)
