"""Host synchronisations, counted on the CPU by what is called (tests/helpers/host_syncs.py):
the counter itself (each kind of blocking call counted once, harmless calls not, forward
and backward), the MoE layer's budget (at most one per forward, none in backward, for
every dispatcher, mode and ep 1 / ep 2), and the training step's (one packed read of its
scalars, at one and two ranks, with fixed rows and packed documents)."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch
import torch.distributed as dist

from moe_fold.data.loader import Sample, collate
from moe_fold.kernels import backends
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.moe_layer import MoELayer
from moe_fold.parallel.varlen import doc_ids_from_cu_seqlens
from moe_fold.training.run_setup import set_up_run
from moe_fold.training.stop import ExitSignals, StopRule
from moe_fold.training.train import _prepare_process, run_step, train

from tests.helpers.host_syncs import count_host_syncs
from tests.models.test_moe_layer import SHARED, _config, _inputs
from tests.training.test_train import small_config

HERE = os.path.basename(__file__)


# --------------------------------------------------------------------------- the counter

x = torch.arange(6.0).reshape(2, 3)
mask = x > 2
BLOCKING = {
    "item": lambda: x.sum().item(),
    "tolist": lambda: x.tolist(),
    "numpy": lambda: x.numpy(),
    "cpu": lambda: x.cpu(),
    "to('cpu')": lambda: x.to("cpu"),
    "bool": lambda: bool(x.sum() > 0),
    "if tensor": lambda: 1 if x.sum() else 0,
    "int": lambda: int(x[0, 0]),
    "float": lambda: float(x[0, 0]),
    "index": lambda: [0, 1, 2][x.long()[0, 1]],
    "format": lambda: f"{x.sum():.2f}",
    "equal": lambda: torch.equal(x, x),
    "allclose": lambda: torch.allclose(x, x),
    "nonzero": lambda: mask.nonzero(),
    "torch.nonzero": lambda: torch.nonzero(mask),
    "argwhere": lambda: torch.argwhere(mask),
    "where(cond)": lambda: torch.where(mask),
    "unique": lambda: torch.unique(x),
    "masked_select": lambda: x.masked_select(mask),
    "bincount": lambda: torch.bincount(x.long().flatten()),
    "bool-mask index": lambda: x[mask],
    "bool-mask assign": lambda: x.clone().__setitem__(mask, 0.0),
    "repeat_interleave": lambda: torch.repeat_interleave(x.long()[0, :2], torch.full((2,), 2, device=x.device)),
    "tensor(data, device)": lambda: torch.tensor([1, 2], device=x.device),
    "as_tensor(data, device)": lambda: torch.as_tensor([1, 2], device=x.device),
    "new_tensor": lambda: x.new_tensor([1.0]),
    "host tensor to device": lambda: torch.tensor([1, 2]).to(x.device),
    "barrier": lambda: dist.barrier(),
}
HARMLESS = {
    "arithmetic": lambda: (x * 2 + 1).sum(dim=0).cumsum(0),
    "factories with a device": lambda: (torch.full((3,), 7, device=x.device), torch.zeros(2, device=x.device),
                                        torch.arange(4, device=x.device)),
    "host data": lambda: torch.tensor([1, 2]).tolist(),
    "host tensor reads": lambda: [int(v) for v in torch.tensor([3, 4]).cumsum(0)],
    "host tensor, new dtype": lambda: torch.tensor([3, 4]).to(torch.float64).split(1)[0].item(),
    "explicit host tensor": lambda: torch.tensor([3, 4], device="cpu").tolist(),
    "repeat_interleave with output_size": lambda: torch.repeat_interleave(
        torch.arange(2), torch.full((2,), 2), output_size=4),
    "nonzero_static": lambda: mask.nonzero_static(size=3),
    "index by int tensor": lambda: x[torch.arange(2, device=x.device).flip(0)],
    "shape": lambda: (x.shape[0], x.numel(), len(x), x.dim()),
    "where(cond, a, b)": lambda: torch.where(mask, x, 0.0),
    "to a dtype": lambda: x.to(torch.float64).to(x.device),
    "non-blocking copy to the device": lambda: torch.tensor([1, 2]).to(x.device, non_blocking=True),
    "data-sized ops on host data": lambda: (torch.tensor([0, 1, 2]).nonzero(), torch.tensor([1.0, 2.0])[
        torch.tensor([True, False])], torch.repeat_interleave(torch.arange(2), torch.tensor([2, 1]))),
}


@pytest.mark.parametrize("name", BLOCKING)
def test_each_blocking_call_counts_once(name, monkeypatch):
    monkeypatch.setattr(dist, "barrier", lambda *a, **k: None)  # no process group here
    fn = BLOCKING[name]
    with count_host_syncs() as syncs:
        fn()
    assert syncs.count == 1, syncs.calls
    op, site = syncs.calls[0]
    assert site.startswith(os.path.join("tests", HERE)) or HERE in site, site


@pytest.mark.parametrize("name", HARMLESS)
def test_harmless_calls_count_nothing(name):
    with count_host_syncs() as syncs:
        HARMLESS[name]()
    assert syncs.count == 0, syncs.calls


class _ReadsInBackward(torch.autograd.Function):
    @staticmethod
    def forward(ctx, a):
        return a * 2

    @staticmethod
    def backward(ctx, grad):
        grad.sum().item()
        return grad * 2


def test_backward_calls_are_counted_and_nesting_adds_up():
    a = torch.ones(3, requires_grad=True)
    with count_host_syncs() as outer:
        y = _ReadsInBackward.apply(a).sum()
        with count_host_syncs() as inner:
            y.backward()
        torch.autograd.backward(_ReadsInBackward.apply(a).sum())
        torch.autograd.grad(_ReadsInBackward.apply(a).sum(), a)
    assert inner.count == 1 and [op for op, _ in inner.calls] == ["TensorBase.item"], inner.calls
    assert outer.count == 3, outer.calls
    with count_host_syncs() as after:  # the patches are gone once the block ends
        pass
    torch.ones(1).item()
    assert after.count == 0


def _packed_samples(S=8):
    """Two samples of packed documents as the loader makes them (numpy arrays)."""
    def sample(cuts):
        return Sample(np.arange(S + 1, dtype=np.int64), np.ones(S, np.float32), np.arange(S, dtype=np.int64),
                      np.array(cuts, np.int32))
    return [sample([0, 3, S]), sample([0, 5, 6, S])]


def test_host_built_cu_seqlens_are_host_data_and_a_computed_read_counts():
    """The loader builds cu_seqlens on the host (torch.from_numpy) and Batch.to leaves them
    there: turning them into document ids reads host memory only, and the ids go to the
    device without waiting (non_blocking). A read of a tensor the device computed from
    the batch is a sync, and so is a read of a tensor made before the block (which the
    counter cannot trace, so it assumes the device made it)."""
    before = torch.ones(2)
    with count_host_syncs() as syncs:
        batch = collate(_packed_samples()).to(x.device)
        ids = doc_ids_from_cu_seqlens(batch.cu_seqlens, 2, 8)
        ids = ids.to(x.device, non_blocking=True)
        assert syncs.calls == [], syncs.calls
        assert (batch.loss_mask.sum() * 2).item() == 32.0
        assert bool(before.sum() > 0)
    assert [op for op, _ in syncs.calls] == ["TensorBase.item", "TensorBase.__bool__"], syncs.calls
    assert ids.tolist()[1] == [2, 2, 2, 2, 2, 3, 4, 4]


def test_a_device_taken_from_a_host_tensor_is_the_host():
    """A factory given a host tensor's device makes a host tensor (``arange(..., device=cu.device)``
    beside host cu_seqlens); a copy of a computed tensor to that device is a read."""
    with count_host_syncs() as syncs:
        cu = torch.from_numpy(np.array([0, 3, 8], np.int32))
        rows = torch.arange(0, 9, 8, device=cu.device)
        assert bool(torch.isin(rows, cu).all())  # host work: free
        (x * 2).to(cu.device)
    assert [op for op, _ in syncs.calls] == ["Tensor.to(host)"], syncs.calls


# --------------------------------------------------------------------------- the MoE layer

LOSSES = dict(aux_loss_coeff=0.01, z_loss_coeff=0.001, seq_aux_loss_coeff=0.01, global_aux_loss_coeff=0.01,
              shared_expert_ffn_hidden_size=SHARED, shared_expert_gate=True)
LAYER_CASES = {
    "alltoall-dropless": dict(dispatcher="alltoall"),
    "alltoall-capacity": dict(dispatcher="alltoall", capacity_factor=1.0),
    "alltoall-pad": dict(dispatcher="alltoall", capacity_factor=1.0, pad_to_capacity=True),
    "alltoall-dedup": dict(dispatcher="alltoall", dedup=True),
    "alltoall-replicas": dict(dispatcher="alltoall", replicas=1),
    "allgather-dropless": dict(dispatcher="allgather"),
    "allgather-capacity": dict(dispatcher="allgather", capacity_factor=1.0),
}
# The padded mode knows every size from the config: no count exchange, no sync at all.
FORWARD_SYNCS = {case: 0 if case.endswith("pad") else 1 for case in LAYER_CASES}
GEMMS = ("torch", "loop", "triton")


def _layer_counts(groups, rank):
    counts = {}
    for case, moe in LAYER_CASES.items():
        if moe.get("replicas") and groups.size("ep") == 1:
            continue  # copies live on other ep ranks
        for gemm in GEMMS:
            layer = MoELayer(_config(**moe, **LOSSES, gemm_backend=gemm), groups, 0)
            x = _inputs(rank).requires_grad_()
            seq_ids = torch.arange(x.shape[0]) % 2
            layer(x, seq_ids=seq_ids, num_seqs=2).sum().backward()  # warm: chunk orders copied to the device once
            with count_host_syncs() as forward:
                y = layer(x, seq_ids=seq_ids, num_seqs=2)
            with count_host_syncs() as backward:
                y.sum().backward()
            counts[case, gemm] = (forward.calls, backward.calls)
    return counts


# The dispatcher's one host read: the all-gathered counts, read by its count reader
# (planned_routing.read_gathered unless a dry run plans the routing).
COUNT_READ = os.path.join("dispatch", "planned_routing.py")


def _check_budget(counts, where):
    assert counts
    for (case, gemm), (forward, backward) in counts.items():
        assert len(forward) == FORWARD_SYNCS[case], (where, case, gemm, forward)
        assert all(site.startswith(COUNT_READ) for _, site in forward), forward
        assert backward == [], (where, case, gemm, backward)


def test_moe_layer_syncs_once_per_forward_and_never_in_backward():
    """One process (ep 1): the count exchange is the forward's one host sync; the padded
    mode has none; the backward none; with each GEMM backend (the loop backend takes the
    host counts from that same exchange) and every router loss and the shared expert on."""
    _check_budget(_layer_counts(ProcessGroups.single_process(), 0), "ep1")


def _layer_rank(rank, world_size):
    return _layer_counts(create_process_groups(ParallelLayout(world_size, ep=2)), rank)


def test_moe_layer_syncs_once_per_forward_on_two_ep_ranks():
    """ep 2 on two gloo ranks (split sizes, chunk sorts and expert copies in play): the same budget."""
    for rank, counts in enumerate(run_ranks(_layer_rank, 2, timeout=180)):
        _check_budget(counts, f"ep2 rank {rank}")


# --------------------------------------------------------------------------- the training step

# The step's one host read: its scalars (LM loss, gradient norm, router and MTP losses,
# routing statistics) packed on the device and copied once; the finite check reads them.
STEP_READ = ("TensorBase.cpu", "moe_fold/training/train.py")
# Static shapes: every size of the MoE layers comes from the config (no count exchange).
PADDED = ["moe.capacity_factor=1.0", "moe.pad_to_capacity=true"]
PACKED = ["data.packing=true"]


def _by_file(calls) -> collections.Counter:
    return collections.Counter((op, site.split(":")[0].replace(os.sep, "/")) for op, site in calls)


def _step_syncs(config, metrics: bool = True) -> tuple[list, list]:
    """The host syncs of one real ``run_step`` (the second: the first copies what is copied
    once) and of the loop's stop check after it, on this rank."""
    config, device, groups = _prepare_process(config)
    run = set_up_run(config, device, groups, metrics=metrics)
    run.model.train()
    stops = StopRule(config, ExitSignals([]), device, groups.layout.world_size, began=0.0)
    run_step(run, 1)
    stops.check(1)
    with count_host_syncs() as step:
        run_step(run, 2)
    with count_host_syncs() as stop:
        stops.check(2)
    run.losses.close()
    if run.collector is not None:
        run.collector.close()
    return step.calls, stop.calls


def _step_rank(rank, world_size, config):
    return _step_syncs(config)


@pytest.mark.parametrize("data, metrics", [([], True), (PACKED, True), ([], False)],
                         ids=["rows", "packed", "rows-no-metrics"])
def test_a_static_shape_step_reads_the_host_once(tmp_path, cache_dir, data, metrics):
    """A real run_step of mixtral-tiny (4 micro-batches, 2 padded MoE layers), one process,
    fixed rows and packed documents (whose host-built cu_seqlens are host data, not
    syncs), with the routing metrics and without: one host read, the step's packed scalars
    (the metrics ride in it); one process has no stop check to agree."""
    step, stop = _step_syncs(small_config(tmp_path, cache_dir, *PADDED, *data), metrics=metrics)
    assert _by_file(step) == collections.Counter([STEP_READ]), step
    assert stop == [], stop


@pytest.mark.parametrize("data", [[], PACKED], ids=["rows", "packed"])
def test_a_static_shape_step_on_two_ranks_reads_the_host_twice(tmp_path, cache_dir, data):
    """The same on two gloo ranks (ep 2 over dp 2): the step's one read, and the loop's
    stop check (signals, budgets, the checkpoint clock's vote), all-reduced and read once."""
    config = small_config(tmp_path, cache_dir, *PADDED, *data, "parallel.ep=2")
    for rank, (step, stop) in enumerate(run_ranks(_step_rank, 2, config, timeout=300)):
        assert _by_file(step) == collections.Counter([STEP_READ]), (rank, step)
        assert _by_file(stop) == collections.Counter([("TensorBase.tolist", "moe_fold/training/stop.py")]), (rank, stop)


def _per_step(tmp_path, cache_dir, steps, *extra):
    # The kernel backends' availability probe runs once per process (its tiny call reads a
    # result back); run it first, so it falls in neither run whatever ran before this test.
    backends.problem("cpu", torch.device("cpu"))
    with count_host_syncs() as syncs:
        train(small_config(tmp_path / f"run{steps}", cache_dir, f"train.steps={steps}", *extra), progress=False)
    return collections.Counter(syncs.calls)


def test_training_loop_syncs_per_step(tmp_path, cache_dir):
    """A step of train() with dropless MoE and packed documents (4 micro-batches, 2 MoE
    layers): the MoE layers' one count exchange each per micro-batch,
    and the step's one read, no more (the packed documents' cu_seqlens are host data).
    Measured as the difference between a 3-step and a 2-step run, so set-up and the final
    checkpoint cancel out."""
    step = _per_step(tmp_path, cache_dir, 3, *PACKED) - _per_step(tmp_path, cache_dir, 2, *PACKED)
    moe = {k: n for k, n in step.items() if k[1].startswith("dispatch" + os.sep)}
    loop = {k: n for k, n in step.items() if k not in moe}
    assert sum(moe.values()) == 2 * 4 and all(k[1].startswith(COUNT_READ) for k in moe), moe
    assert _by_file(collections.Counter(loop).elements()) == collections.Counter([STEP_READ]), loop
