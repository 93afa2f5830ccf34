"""Gradient sync and the global grad norm.

The multi-rank test runs a toy MoE-shaped model on 4 ranks (tp2 with sequence parallel,
dp2; experts over ep with an all-gather dispatcher written here) through two
micro-batches of gradient accumulation, and checks every synced grad and the norm
against one process holding the same global weights and data."""

import contextlib

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_fold.comm import all_gather, reduce_from_tp_region, reduce_scatter
from moe_fold.training.buckets import GradSync, make_buckets
from moe_fold.training.grads import clip_grad_norm_, grad_norm, sharded_grad_norm, sync_grads
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.mlp import MLP
from moe_fold.models.norm import RMSNorm
from moe_fold.parallel.tensor_parallel import global_normal, mark, unshard_tp

from tests.helpers.float64_reference import assert_close_to_float64

H, FFN, E, T, DP, MICRO = 8, 16, 4, 8, 2, 2


def _marked(shape, kind, value, **split):
    return mark(torch.nn.Parameter(torch.full(shape, value)), kind, **split)


def test_clip_grad_norm_matches_torch_one_process():
    for max_norm in (0.1, 100.0):  # clipping and not
        gen = torch.Generator().manual_seed(0)
        params = [_marked((3, 4), "tp", 0.0, tp_dim=0, tp_parts=[3])]
        params += [_marked((5,), kind, 0.0) for kind in ("replicated", "tp_sum", "expert")]
        ref = [torch.nn.Parameter(torch.zeros_like(p)) for p in params]
        for p, r in zip(params, ref):
            p.grad = torch.randn(p.shape, generator=gen)
            r.grad = p.grad.clone()
        expected = torch.nn.utils.clip_grad_norm_(ref, max_norm)
        got = clip_grad_norm_(params, max_norm, ProcessGroups.single_process())
        torch.testing.assert_close(got, expected)
        for p, r in zip(params, ref):
            torch.testing.assert_close(p.grad, r.grad)


def test_sync_is_identity_on_one_process():
    p = _marked((4,), "tp_sum", 1.0)
    p.grad = torch.arange(4.0)
    sync_grads([p], ProcessGroups.single_process())
    torch.testing.assert_close(p.grad, torch.arange(4.0))


def test_unmarked_parameter_is_rejected():
    p = torch.nn.Parameter(torch.zeros(2, 3))
    p.grad = torch.ones(2, 3)
    with pytest.raises(ValueError, match=r"shape \(2, 3\) has parallel=None"):
        sync_grads([p], ProcessGroups.single_process())
    with pytest.raises(ValueError, match=r"shape \(2, 3\) has parallel=None"):
        grad_norm([p], ProcessGroups.single_process())


def _data():
    """Global tokens of MICRO micro-batches x DP slots: x, targets, mask [MICRO, DP, T, ...]
    and each token's expert (never expert E-1: its owner gets no grad at all)."""
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(MICRO, DP, T, H, generator=gen)
    target = torch.randn(MICRO, DP, T, H, generator=gen)
    mask = (torch.rand(MICRO, DP, T, generator=gen) > 0.3).float()
    expert = torch.randint(0, E - 1, (MICRO, DP, T), generator=gen)
    return x, target, mask, expert


class Toy(torch.nn.Module):
    """norm -> dense TP MLP (residual) -> routed experts (residual); ``ep_rank`` owns the
    experts ``[ep_rank*E/ep, (ep_rank+1)*E/ep)``."""

    def __init__(self, groups, sp):
        super().__init__()
        ep, ep_rank = groups.size("ep"), groups.rank_in("ep")
        self.groups = groups
        self.norm = RMSNorm(H, 1e-6, "tp_sum" if sp else "replicated")
        self.mlp = MLP(H, FFN, groups.tp, sp, std=0.3, seed=21, name="mlp")
        local = E // ep
        self.first_expert = ep_rank * local
        self.experts = mark(torch.nn.Parameter(global_normal((E, H, H), 0.3, 22)[self.first_expert:][:local]),
                            "expert")
        # Scales the loss after the tp reduction: every tp rank computes the same grad.
        self.gain = mark(torch.nn.Parameter(torch.tensor(1.5)), "replicated")

    def forward(self, x, target, mask, expert, num_tokens):
        """This rank's tokens ``[T_local, H]``; the loss scaled as Transformer.forward does."""
        h = x + self.mlp(self.norm(x))  # [T_local, H]
        # An all-gather dispatcher: every ep rank sees the ep group's tokens, applies its
        # experts, and the reduce-scatter returns each token's output to its owner.
        tokens = all_gather(h, self.groups.ep)  # [T_local*ep, H]
        owner = all_gather(expert, self.groups.ep)
        # Not zeros_like: the graph must reach the dispatcher on every rank, or a rank
        # without routed tokens would skip the collectives of its backward.
        out = tokens * 0
        for i, w in enumerate(self.experts):
            routed = owner == self.first_expert + i
            if routed.any():  # an expert without tokens is never used (its grad stays None)
                out = out + (tokens @ w.T) * routed.unsqueeze(-1)
        y = h + reduce_scatter(out, self.groups.ep)  # [T_local, H]
        local = (((y - target) ** 2).sum(-1) * mask).sum()
        dp_cp = self.groups.size("dp_cp")
        return self.gain * reduce_from_tp_region(local, self.groups.tp) * (dp_cp / num_tokens)


def _toy_run(toy, groups, shard, sync=None):
    """Backward of MICRO micro-batches, grads accumulating; ``shard`` picks this rank's
    tokens; each backward under ``sync``'s hook point (a GradSync)."""
    x, target, mask, expert = _data()
    num_tokens = mask.sum()
    for m in range(MICRO):
        loss = toy(*(shard(a[m]) for a in (x, target, mask, expert)), num_tokens)
        with sync.backward_of(m, 0, MICRO) if sync is not None else contextlib.nullcontext():
            loss.backward()


def _gather_owned(buckets, groups):
    """Whole local grads from the owned ranges of reduce-scattered buckets."""
    for b in buckets:
        mine = torch.cat([s.param.grad.view(-1)[s.start:s.stop] for s in b.slices])  # [sizes[me]]
        full = all_gather(mine, groups.group(b.group_name), b.sizes)  # [bucket numel]
        for p, offset in zip(b.params, b.offsets):
            p.grad.view(-1).copy_(full[offset:offset + p.numel()])


def _toy_rank(rank, world_size, runs):
    """Each (ep, bucket_numel, mode) of ``runs`` in turn (one process start for all). Modes:
    ``sync`` (sync_grads), ``overlap`` (all-reduce posted during the last backward),
    ``zero_overlap`` (reduce-scatter posted during it; the sharded norm)."""
    results = []
    for ep, bucket_numel, mode in runs:
        groups = create_process_groups(ParallelLayout(world_size, tp=2, ep=ep, etp=1))
        toy = Toy(groups, sp=True)
        tp, me_tp, me_dp = groups.size("tp"), groups.rank_in("tp"), groups.rank_in("dp_cp")
        sync, inside = None, []
        if mode != "sync":
            buckets = make_buckets([list(toy.parameters())], groups, bucket_numel, shard=mode == "zero_overlap")
            sync = GradSync(buckets, groups, overlap=True)
            post = sync._post
            sync._post = lambda i: (inside.append(torch._C._current_graph_task_id() != -1), post(i))
        # Slot me_dp, sequence shard me_tp of it.
        _toy_run(toy, groups, lambda a: a[me_dp].chunk(tp, 0)[me_tp], sync)
        if ep == E and groups.rank_in("ep") == E - 1:
            assert toy.experts.grad is None  # the expert no token chose: sync must still take part
        out = {}
        if mode == "sync":
            sync_grads(toy.parameters(), groups, bucket_numel=bucket_numel)
            out["norm"] = grad_norm(toy.parameters(), groups).item()
        else:
            sync.finish()
            # every bucket posted, some while the backward still ran
            out["posted"], out["inside"] = len(inside), sum(inside)
            if mode == "zero_overlap":
                out["norm"] = sharded_grad_norm(buckets, groups).item()
                _gather_owned(buckets, groups)
            else:
                out["norm"] = grad_norm(toy.parameters(), groups).item()
        for name, p in toy.named_parameters():
            g = p.grad.contiguous()
            if p.parallel == "tp":
                shards = [torch.empty_like(g) for _ in range(tp)]
                dist.all_gather(shards, g, group=groups.tp)
                g = unshard_tp(shards, p.tp_dim, p.tp_parts)
            elif p.parallel == "expert":
                g = all_gather(g, groups.ep)  # [E, H, H]
            out[name] = g.numpy()
        results.append(out)
    return results


# ep=2: edp=2 equals dp_cp, and the ep group is the tp group; ep=4: edp=1, so the expert
# grads must be divided by dp_cp, not averaged over edp. Small buckets split the grads.
RUNS = [(2, 50, "sync"), (4, 1 << 20, "sync"), (2, 50, "overlap"), (4, 50, "overlap"), (2, 50, "zero_overlap"),
        (4, 50, "zero_overlap")]


def test_sync_and_norm_match_one_process():
    groups = ProcessGroups.single_process()
    # One process, in float64: all DP slots' tokens together.
    ref = Toy(groups, sp=False).double()
    _toy_run(ref, groups, lambda a: (a.double() if a.is_floating_point() else a).flatten(0, 1))
    ref_grads = {name: p.grad for name, p in ref.named_parameters()}
    ref_norm = torch.sqrt(sum((g * g).sum() for g in ref_grads.values()))
    assert ref_grads["experts"][E - 1].abs().max() == 0 and ref_grads["experts"][0].abs().max() > 0

    results = run_ranks(_toy_rank, 4, RUNS, timeout=150)
    for rank, per_rank in enumerate(results):
        for (ep, bucket_numel, mode), got in zip(RUNS, per_rank):
            where = f"ep={ep} bucket_numel={bucket_numel} {mode} rank {rank}"
            if mode != "sync":
                assert got["posted"] > 2 and got["inside"] > 0, (where, got["posted"], got["inside"])
            for name, g in ref_grads.items():
                assert_close_to_float64(torch.from_numpy(got[name]), g, msg=f"{where} grad {name}")
            assert got["norm"] == pytest.approx(ref_norm.item(), rel=1e-5), where
