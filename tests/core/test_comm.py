"""Collectives against single-process references on the same global data.

Every rank builds all ranks' tensors from one seed, runs the collective on its own
part, and checks the forward and the grads against plain torch on the global data:
the loss is the sum of every rank's loss, so grads must equal the single-process ones.
Byte counts are checked against the formulas in ``moe_fold.comm``'s docstring.
"""

import pytest
import torch
import torch.distributed as dist

from moe_fold import comm
from moe_fold.launch import run_ranks


def _rand(gen, shape, dtype=torch.float32):
    if dtype == torch.int64:
        return torch.randint(-1000, 1000, shape, generator=gen)
    return torch.randn(shape, generator=gen).to(dtype)


def _counted(fn):
    """Run ``fn`` and return (its result, the bytes it sent per kind)."""
    with comm.count_bytes() as sent:
        out = fn()
    return out, sent


def _kinds(nbytes, kind):
    return {kind: nbytes} if nbytes else {}


def _call(op, asynchronous, *args, **kwargs):
    """``comm.<op>``, or its asynchronous variant ``<op>_start`` started and waited on."""
    if asynchronous:
        assert kwargs.pop("dim", 0) == 0  # they work along dim 0
        return getattr(comm, f"{op}_start")(*args, **kwargs).wait()
    return getattr(comm, op)(*args, **kwargs)


# ----------------------------------------------------------------- all_to_all

def _check_all_to_all(n, group, kind, splits, dtype, trailing, seed, asynchronous=False):
    """``splits[s][d]`` rows go from group rank s to group rank d (None: 2 rows each, even)."""
    me = dist.get_rank(group)
    even = splits is None
    if even:
        splits = [[2] * n for _ in range(n)]
    gen = torch.Generator().manual_seed(seed)
    xs = [_rand(gen, (sum(splits[s]),) + trailing, dtype) for s in range(n)]
    ws = [_rand(gen, (sum(splits[s][d] for s in range(n)),) + trailing, dtype) for d in range(n)]
    grads = dtype != torch.int64
    # Single-process reference: destination d receives chunk d of every source, in order.
    ref_x = [x.clone().requires_grad_(grads) for x in xs]
    ref_out = [torch.cat([ref_x[s].split(splits[s])[d] for s in range(n)]) for d in range(n)]
    if grads:
        sum((o * w).sum() for o, w in zip(ref_out, ws)).backward()

    x = xs[me].clone().requires_grad_(grads)
    in_splits = None if even else splits[me]
    out_splits = None if even else [splits[s][me] for s in range(n)]
    out, fwd = _counted(lambda: _call("all_to_all", asynchronous, x, output_split_sizes=out_splits,
                                      input_split_sizes=in_splits, group=group))
    assert out.dtype == dtype and torch.equal(out, ref_out[me].detach())
    row = torch.empty((1,) + trailing, dtype=dtype).nbytes
    assert fwd == _kinds(sum(splits[me][d] for d in range(n) if d != me) * row, kind)
    if grads:
        _, bwd = _counted(lambda: (out * ws[me]).sum().backward())
        assert torch.equal(x.grad, ref_x[me].grad)
        assert bwd == _kinds(sum(splits[s][me] for s in range(n) if s != me) * row, kind)
    else:
        assert not out.requires_grad


# ----------------------------------------------------------------- all_gather / reduce_scatter

def _check_all_gather(n, group, kind, sizes, dim, seed, asynchronous=False):
    me = dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    own = sizes or [3] * n
    shape = lambda s: (s, 4) if dim == 0 else (2, s, 3)  # noqa: E731
    xs = [_rand(gen, shape(s)) for s in own]
    ws = [_rand(gen, shape(sum(own))) for _ in range(n)]
    ref_x = [x.clone().requires_grad_() for x in xs]
    ref_out = torch.cat(ref_x, dim=dim)
    sum((ref_out * w).sum() for w in ws).backward()

    x = xs[me].clone().requires_grad_()
    out, fwd = _counted(lambda: _call("all_gather", asynchronous, x, group, sizes=sizes, dim=dim))
    assert torch.equal(out, ref_out.detach())
    assert fwd == _kinds(x.nbytes * (n - 1), kind)
    _, bwd = _counted(lambda: (out * ws[me]).sum().backward())
    torch.testing.assert_close(x.grad, ref_x[me].grad)
    assert bwd == _kinds(out.nbytes - x.nbytes, kind)


def _check_reduce_scatter(n, group, kind, sizes, dim, seed, asynchronous=False):
    me = dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    own = sizes or [2] * n
    shape = lambda s: (s, 4) if dim == 0 else (3, s)  # noqa: E731
    xs = [_rand(gen, shape(sum(own))) for _ in range(n)]
    ws = [_rand(gen, shape(own[r])) for r in range(n)]
    ref_x = [x.clone().requires_grad_() for x in xs]
    ref_outs = sum(ref_x).split(own, dim=dim)
    sum((o * w).sum() for o, w in zip(ref_outs, ws)).backward()

    x = xs[me].clone().requires_grad_()
    out, fwd = _counted(lambda: _call("reduce_scatter", asynchronous, x, group, sizes=sizes, dim=dim))
    torch.testing.assert_close(out, ref_outs[me].detach())
    assert fwd == _kinds(x.nbytes - out.nbytes, kind)
    _, bwd = _counted(lambda: (out * ws[me]).sum().backward())
    torch.testing.assert_close(x.grad, ref_x[me].grad)
    assert bwd == _kinds(out.nbytes * (n - 1), kind)


def _check_all_reduce(n, group, kind, seed):
    me = dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    xs = [_rand(gen, (3, 5)) for _ in range(n)]
    ws = [_rand(gen, (3, 5)) for _ in range(n)]
    ring = 2 * (n - 1) * xs[0].nbytes // n

    x = xs[me].clone().requires_grad_()
    out, fwd = _counted(lambda: comm.all_reduce(x, group))
    torch.testing.assert_close(out, sum(xs))
    assert torch.equal(x.detach(), xs[me]), "all_reduce must not modify its input"
    _, bwd = _counted(lambda: (out * ws[me]).sum().backward())
    torch.testing.assert_close(x.grad, sum(ws))
    assert fwd == bwd == _kinds(ring, kind)

    t = xs[me].clone()
    same, sent = _counted(lambda: comm.all_reduce_(t, group, op="max"))
    assert same is t and torch.equal(t, torch.stack(xs).amax(0))
    assert sent == _kinds(ring, kind)
    mx = comm.all_reduce(xs[me], group, op="min")
    assert torch.equal(mx, torch.stack(xs).amin(0))
    with pytest.raises(ValueError, match="op="):
        comm.all_reduce(x, group, op="max")


# ----------------------------------------------------------------- TP / SP mappings

def _check_tp_mlp(tp, group, seed):
    """Column- then row-parallel MLP, with and without SP, against the full MLP."""
    me = dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    seq, hidden, ffn = 4 * tp, 6, 4 * tp
    X, A, B, W = (_rand(gen, s) for s in [(seq, hidden), (hidden, ffn), (ffn, hidden), (seq, hidden)])
    G = _rand(gen, (seq, ffn))
    ref = [t.clone().requires_grad_() for t in (X, A, B)]
    loss = (torch.relu(ref[0] @ ref[1]) @ ref[2] * W).sum() + ((ref[0] @ ref[1]) * G).sum()
    loss.backward()
    rX, rA, rB = (t.grad for t in ref)
    cols = slice(me * ffn // tp, (me + 1) * ffn // tp)
    rows = slice(me * seq // tp, (me + 1) * seq // tp)

    # Plain TP: replicated input and output; every rank's loss is the full loss, so a
    # rank's copy of the loss is what the reference computed.
    x, a, b = X.clone().requires_grad_(), A[:, cols].clone().requires_grad_(), B[cols].clone().requires_grad_()
    xin = comm.copy_to_tp_region(x, group)
    pre = xin @ a
    y = comm.reduce_from_tp_region(torch.relu(pre) @ b, group)
    full_pre = comm.gather_from_tp_region(pre, group)
    torch.testing.assert_close(y, torch.relu(X @ A) @ B)
    torch.testing.assert_close(full_pre, X @ A)
    ((y * W).sum() + (full_pre * G).sum()).backward()
    torch.testing.assert_close(x.grad, rX)
    torch.testing.assert_close(a.grad, rA[:, cols])
    torch.testing.assert_close(b.grad, rB[cols])

    # SP: each rank owns a sequence shard; the full loss is the sum of the shards'.
    x, a, b = X.clone().requires_grad_(), A[:, cols].clone().requires_grad_(), B[cols].clone().requires_grad_()
    xs = comm.scatter_to_sequence_region(x, group)  # [seq/tp, hidden]
    assert torch.equal(xs, X[rows])
    full = comm.gather_from_sequence_region(xs, group)  # [seq, hidden]
    pre = full @ a
    ys = comm.reduce_scatter_to_sequence_region(torch.relu(pre) @ b, group)  # [seq/tp, hidden]
    torch.testing.assert_close(ys, (torch.relu(X @ A) @ B)[rows])
    # The G term sees a TP-replicated tensor, so (Megatron's convention) every rank adds
    # the same term and its backward keeps only this rank's slice of the grad.
    extra = (comm.gather_from_tp_region(pre, group) * G).sum()
    ((ys * W[rows]).sum() + extra).backward()
    # x is replicated over TP, so its grad is the full grad on every rank.
    torch.testing.assert_close(x.grad, rX)
    torch.testing.assert_close(a.grad, rA[:, cols])
    torch.testing.assert_close(b.grad, rB[cols])


def _tp_mappings(x, a, b, w, g, group):
    """Every TP/SP mapping once, around a column- and row-parallel product; a scalar loss."""
    pre = comm.copy_to_tp_region(x, group) @ a
    y = comm.reduce_from_tp_region(torch.relu(pre) @ b, group)
    xs = comm.scatter_to_sequence_region(x * y, group)
    pre_sp = comm.gather_from_sequence_region(xs, group) @ a
    ys = comm.reduce_scatter_to_sequence_region(torch.relu(pre_sp) @ b, group)
    return (ys * w).sum() + (comm.gather_from_tp_region(pre_sp, group) * g).sum()


def _check_compiled_tp_mappings(tp, group, seed):
    """Under torch.compile (fullgraph, ``aot_eager``) the mappings run as functional
    collectives: the loss and every grad equal eager's."""
    import torch._dynamo as dynamo

    me = dist.get_rank(group)
    gen = torch.Generator().manual_seed(seed)
    seq, hidden, ffn = 4 * tp, 6, 4 * tp
    X, A, B = _rand(gen, (seq, hidden)), _rand(gen, (hidden, ffn)), _rand(gen, (ffn, hidden))
    W, G = _rand(gen, (seq // tp, hidden)), _rand(gen, (seq, ffn))
    cols = slice(me * ffn // tp, (me + 1) * ffn // tp)

    def run(fn):
        x, a, b = X.clone().requires_grad_(), A[:, cols].clone().requires_grad_(), B[cols].clone().requires_grad_()
        loss = fn(x, a, b, W, G, group)
        loss.backward()
        return loss.detach(), x.grad, a.grad, b.grad

    want = run(_tp_mappings)
    dynamo.reset()
    got = run(torch.compile(_tp_mappings, fullgraph=True, backend="aot_eager"))
    for name, w, g in zip(("loss", "x.grad", "a.grad", "b.grad"), want, got):
        torch.testing.assert_close(g, w, rtol=1e-6, atol=1e-6, msg=lambda m: f"compiled {name}: {m}")


def _check_tp_bytes(tp, group, kind):
    x = torch.ones(4 * tp, 3, requires_grad=True)
    nb, n = x.nbytes, tp
    ring = 2 * (n - 1) * nb // n
    for fn, fwd_bytes, bwd_bytes in [
        (comm.copy_to_tp_region, 0, ring),
        (comm.reduce_from_tp_region, ring, 0),
        (comm.gather_from_sequence_region, nb * (n - 1), nb * (n - 1)),
        (comm.reduce_scatter_to_sequence_region, nb - nb // n, nb - nb // n),
        (comm.scatter_to_sequence_region, 0, nb // n * (n - 1)),
        (comm.gather_from_tp_region, nb * (n - 1), 0),
    ]:
        out, fwd = _counted(lambda: fn(x, group))
        _, bwd = _counted(lambda: out.sum().backward())
        assert fwd == _kinds(fwd_bytes, kind), fn.__name__
        assert bwd == _kinds(bwd_bytes, kind), fn.__name__


# ----------------------------------------------------------------- point-to-point

def _check_p2p(rank, ring_ranks, group, kind):
    """Ring over ``ring_ranks`` (global ranks); blocking send/recv then batch_send_recv."""
    i = ring_ranks.index(rank)
    nxt, prv = ring_ranks[(i + 1) % len(ring_ranks)], ring_ranks[i - 1]
    mine = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * rank
    expect = torch.arange(6, dtype=torch.float32).reshape(2, 3) + 100 * prv

    def blocking():
        if i % 2 == 0:
            comm.send(mine, nxt, group=group)
            return comm.recv((2, 3), torch.float32, prv, group=group)
        got = comm.recv((2, 3), torch.float32, prv, group=group)
        comm.send(mine, nxt, group=group)
        return got

    got, sent = _counted(blocking)
    assert torch.equal(got, expect) and sent == {kind: mine.nbytes}

    buf = torch.empty(4, dtype=torch.int64)
    ops = [("send", mine, nxt), ("recv", ((2, 3), torch.float32), prv),
           ("send", torch.full((4,), rank), prv), ("recv", buf, nxt)]
    received, sent = _counted(lambda: comm.batch_send_recv(ops, group=group))
    assert torch.equal(received[0], expect)
    assert received[1] is buf and torch.equal(buf, torch.full((4,), nxt))
    assert sent == {kind: mine.nbytes + buf.nbytes}


# ----------------------------------------------------------------- the rank programs

def _check_overlap_order(n, group):
    """The asynchronous all-to-all returns before its transfer is waited on, and autograd
    runs the work recorded between start and wait while the backward transfer is in flight:
    its backward comes after the wait's backward (which posts) and before the start's
    (which waits)."""
    events = []

    def record(name):
        class Mark(torch.autograd.Function):
            @staticmethod
            def forward(ctx, t):
                return t.clone()

            @staticmethod
            def backward(ctx, grad):
                events.append(name)
                return grad
        return Mark.apply

    posted = []
    original = comm.all_to_all_async

    def recording(*args):
        events.append("posted")
        posted.append(original(*args))
        return posted[-1]

    x = torch.randn(2 * n, 3, requires_grad=True)
    x.register_hook(lambda grad: events.append("backward waited"))
    side = torch.randn(4, 3, requires_grad=True)
    comm.all_to_all_async = recording
    try:
        pending = comm.all_to_all_start(x, None, None, group)
        assert events == ["posted"] and posted[0]._result is None  # posted, not waited
        other = record("overlapped work")(side) * 2  # runs while the all-to-all is in flight
        out = pending.wait()
        assert posted[0]._result is not None and pending.wait() is out
        events.clear()
        (out.sum() + other.sum()).backward()
    finally:
        comm.all_to_all_async = original
    assert events == ["posted", "overlapped work", "backward waited"], events
    assert torch.equal(x.grad, torch.ones_like(x)) and posted[1]._result is not None


def _no_comm(rank, x):
    """None and size-1 groups: the input comes back, nothing is counted."""
    single = [dist.new_group([r], group_desc="etp") for r in range(dist.get_world_size())][rank]
    for group in (None, single):
        with comm.count_bytes() as sent:
            for out in (comm.all_to_all(x, [3], [3], group), comm.all_gather(x, group),
                        comm.reduce_scatter(x, group), comm.all_reduce(x, group),
                        comm.copy_to_tp_region(x, group), comm.reduce_from_tp_region(x, group),
                        comm.gather_from_sequence_region(x, group),
                        comm.reduce_scatter_to_sequence_region(x, group),
                        comm.scatter_to_sequence_region(x, group), comm.gather_from_tp_region(x, group)):
                assert out is x
            for pending in (comm.all_to_all_start(x, [3], [3], group), comm.all_gather_start(x, group),
                            comm.reduce_scatter_start(x, group)):
                assert pending.wait() is x
            comm.all_reduce_(x, group)
        assert sent == {}


def _errors(group, n):
    x = torch.zeros(5, 2)
    with pytest.raises(ValueError, match="input_split_sizes"):
        comm.all_to_all(x, [1] * n, [1] * n, group)
    with pytest.raises(ValueError, match="output_split_sizes"):
        comm.all_to_all(x, [1], [5] + [0] * (n - 1), group)
    with pytest.raises(ValueError, match="sizes"):
        comm.reduce_scatter(x, group, sizes=[5] + [1] * (n - 1))
    with pytest.raises(ValueError, match="not divisible"):
        comm.reduce_scatter(x, group)
    with pytest.raises(ValueError, match="kind="):
        comm.batch_send_recv([("put", x, 0)])


def _program(rank, world_size, splits_cases):
    n = world_size
    torch.manual_seed(0)
    ep = dist.new_group(list(range(n)), group_desc="ep")
    assert comm.group_kind(ep) == "ep" and comm.group_kind(dist.group.WORLD) == "world"

    uneven = [3, 0, 1, 2][:n] if n > 2 else [0, 3]
    for asynchronous in (False, True):
        for case, splits in enumerate(splits_cases):
            _check_all_to_all(n, ep, "ep", splits, torch.float32, (3, 2), 10 + case, asynchronous)
            _check_all_to_all(n, ep, "ep", splits, torch.bfloat16, (5,), 20 + case, asynchronous)
            _check_all_to_all(n, dist.group.WORLD, "world", splits, torch.int64, (), 30 + case, asynchronous)
        for sizes in (None, uneven):
            for dim in (0,) if asynchronous else (0, 1):  # the asynchronous ones gather along dim 0
                _check_all_gather(n, ep, "ep", sizes, dim, 40 + dim, asynchronous)
                _check_reduce_scatter(n, ep, "ep", sizes, dim, 50 + dim, asynchronous)
    _check_overlap_order(n, ep)
    _check_all_reduce(n, ep, "ep", seed=60)

    # TP over pairs of neighbours, PP over ranks with the same TP index (4 ranks), or
    # everything in one group (2 ranks): group ranks differ from global ranks.
    tp_size = 2
    tp_groups = [list(range(s, s + tp_size)) for s in range(0, n, tp_size)]
    tp = [dist.new_group(g, group_desc="tp") for g in tp_groups][rank // tp_size]
    _check_tp_mlp(tp_size, tp, seed=70 + rank // tp_size)
    _check_tp_bytes(tp_size, tp, "tp")
    pp_groups = [list(range(i, n, tp_size)) for i in range(tp_size)]
    pp = [dist.new_group(g, group_desc="pp") for g in pp_groups][rank % tp_size]
    _check_p2p(rank, list(range(n)), None, "world")
    if n > tp_size:
        pp_size = len(pp_groups[0])
        _check_p2p(rank, pp_groups[rank % tp_size], pp, "pp")
        _check_all_gather(pp_size, pp, "pp", [1, 2], 0, seed=80)
        _check_all_to_all(pp_size, pp, "pp", [[1, 2], [0, 3]], torch.float32, (2,), seed=81)

    _no_comm(rank, torch.ones(3, 2))
    _errors(ep, n)

    total = comm.bytes_sent()
    assert set(total) >= {"ep", "tp", "world"} and all(v > 0 for v in total.values())
    comm.reset_bytes()
    assert comm.bytes_sent() == {}
    return total


def test_collectives_two_ranks():
    # rank 1 sends nothing; then rank 0 receives nothing; then even splits
    cases = [[[2, 3], [0, 0]], [[0, 3], [0, 1]], None]
    totals = run_ranks(_program, 2, cases, timeout=60)
    assert len(totals) == 2


def test_collectives_four_ranks():
    # rank 2 sends nothing and rank 3 receives nothing; then even splits
    cases = [[[1, 0, 2, 0], [2, 3, 0, 0], [0, 0, 0, 0], [1, 4, 2, 0]], None]
    totals = run_ranks(_program, 4, cases, timeout=90)
    assert len(totals) == 4


def _compiled_tp_program(rank, world_size):
    _check_compiled_tp_mappings(world_size, dist.new_group(list(range(world_size)), group_desc="tp"), seed=90)


def test_compiled_tp_mappings_equal_eager():
    run_ranks(_compiled_tp_program, 2, timeout=300)


def test_no_group_is_identity_without_a_process_group():
    x = torch.randn(4, 3, requires_grad=True)
    comm.reset_bytes()
    assert comm.all_to_all(x, None, None, None) is x
    assert comm.all_to_all(x, [4], [4], None) is x
    with pytest.raises(ValueError, match="input_split_sizes"):
        comm.all_to_all(x, [4], [3], None)
    with pytest.raises(ValueError, match="output_split_sizes"):
        comm.all_to_all(x, [2, 2], [4], None)
    assert comm.all_gather(x, None, sizes=[4]) is x
    assert comm.reduce_scatter(x, None) is x
    assert comm.copy_to_tp_region(x, None) is x
    assert comm.group_size(None) == 1 and comm.group_rank(None) == 0
    assert comm.group_kind(None) == "world"
    assert comm.bytes_sent() == {}
