"""Host synchronisations, counted on the CPU by what is called (tests/helpers/host_syncs.py):
the counter itself (each kind of blocking call counted once, harmless calls not, forward
and backward), the MoE layer's budget (at most one per forward, none in backward, for
every dispatcher, mode and ep 1 / ep 2), and the training loop's per-step count."""

from __future__ import annotations

import collections
import os

import pytest
import torch
import torch.distributed as dist

from moe_fold.kernels import backends
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.moe_layer import MoELayer
from moe_fold.training.train import train

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
    "repeat_interleave": lambda: torch.repeat_interleave(torch.arange(2), torch.full((2,), 2)),
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


# --------------------------------------------------------------------------- the training loop

# Outside the MoE layers and the packed-document check (models/model.py, parallel/varlen.py),
# a step of the single-process loop blocks the host this many times, each for a reason
# (a multi-rank run adds the stop check's read of the all-reduced flags, stop.py):
LOOP_SYNCS = [
    # the step's LM loss: a non-finite loss skips the step, and metrics.jsonl records it
    ("TensorBase.item", "moe_fold/training/train.py"),
    # apply_gradients: a non-finite gradient norm skips the optimizer step
    ("TensorBase.__bool__", "moe_fold/training/optim.py"),
    # the gradient norm for metrics.jsonl and the skip rule (read once)
    ("TensorBase.item", "moe_fold/training/train.py"),
    # the step's routing statistics, packed in one tensor, for metrics.jsonl
    ("TensorBase.cpu", "moe_fold/training/metrics.py"),
    # the step's router losses, packed in one tensor: the step computes the loss it reports
    # (lm loss + weighted router losses) itself, so that no metric takes part in it
    ("TensorBase.cpu", "moe_fold/training/step_losses.py"),
]


def _per_step(tmp_path, cache_dir, steps):
    # The kernel backends' availability probe runs once per process (its tiny call reads a
    # result back); run it first, so it falls in neither run whatever ran before this test.
    backends.problem("cpu", torch.device("cpu"))
    with count_host_syncs() as syncs:
        train(small_config(tmp_path / f"run{steps}", cache_dir, f"train.steps={steps}"), progress=False)
    return collections.Counter(syncs.calls)


def test_training_loop_syncs_per_step(tmp_path, cache_dir):
    """A step of train() (4 micro-batches, 2 MoE layers, every router loss on): the MoE
    layers' one sync each per micro-batch, and the loop's own five reads (LOOP_SYNCS), no
    more. Measured as the difference between a 3-step and a 2-step run, so set-up and the
    final checkpoint cancel out."""
    step = _per_step(tmp_path, cache_dir, 3) - _per_step(tmp_path, cache_dir, 2)
    moe = {k: n for k, n in step.items() if k[1].startswith("dispatch" + os.sep)}
    documents = {k: n for k, n in step.items()
                 if k[1].startswith((os.path.join("models", "model.py"), os.path.join("moe_fold", "parallel")))}
    loop = {k: n for k, n in step.items() if k not in moe and k not in documents}
    assert sum(moe.values()) == 2 * 4 and all(k[1].startswith(COUNT_READ)
                                              for k in moe), moe
    # Per micro-batch: doc_ids_from_cu_seqlens checks cu_seqlens four times. Those are host
    # reads on a GPU too (Batch.to keeps cu_seqlens on the host: test_document_attention), but
    # the counter cannot know, the loader having made the tensor with torch.from_numpy before.
    # Nothing reads the token mask (the loader says None when no token is padding).
    assert sum(documents.values()) <= 4 * 4, documents
    by_file = collections.Counter()
    for (op, site), n in loop.items():
        by_file[op, site.split(":")[0].replace(os.sep, "/")] += n
    assert by_file == collections.Counter(LOOP_SYNCS), loop
