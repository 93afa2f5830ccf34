"""The per-sequence load-balancing loss (``moe.seq_aux_loss_coeff``, Megatron's
seq_aux_loss) through the whole model.

A "sequence" is a sample: one row of the micro-batch, even when it packs several
documents (as Megatron counts it); padding (the real-token mask) is left out. The model
flattens activations sequence-first, ``[S_local, B]``, so token ``t`` of a rank is sample
``t % B``; SP and cp shards hold slices of the same samples and the router sums each
sample's counts over tp x cp.

- one process: the value each MoE layer reports equals a per-sample formula written
  here from the router's inputs, and the router gradient it adds is that formula's;
- dp2, tp2 (SP), cp2 and tp2 x ep2 give one process's loss, per-layer seq_aux values and
  gathered gradients (reference: the same global batch as the layout's dp micro-batches,
  tests/parallel/test_layout_invariance.py);
- a short ``moe_fold.training.train`` run with seq_aux on (packed samples) trains and reports it.
"""

import pytest
import torch

from moe_fold.config import Config, ConfigError, ModelConfig, ParallelConfig, load_config
from moe_fold.data.loader import Batch
from moe_fold.training.grads import sync_grads
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.model import build_model
from moe_fold.models.moe_layer import MoELayer
from moe_fold.training.step import forward_backward
from moe_fold.training.train import check_trainable, read_metrics, train
from tests.helpers.compare import assert_grads_match
from tests.parallel.test_layout_invariance import _global_grads

VOCAB, HIDDEN, SEQ, E, K, COEFF = 64, 32, 16, 8, 2, 0.5
# Per row: segment lengths (documents, then padding); True marks a padding segment.
ROWS = [
    [(5, False), (11, False)],
    [(7, False), (5, False), (4, True)],
    [(16, False)],
    [(3, False), (9, False), (4, True)],
]


def _config(seq_aux=COEFF, **parallel):
    config = Config()
    config.model = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_heads=4, num_kv_heads=2,
                               ffn_hidden_size=48, seq_length=SEQ, init_std=0.1)
    c = config.moe
    c.num_experts, c.topk, c.ffn_hidden_size = E, K, 32
    c.aux_loss_coeff, c.z_loss_coeff, c.seq_aux_loss_coeff = 0.0, 0.0, seq_aux
    c.dispatcher, c.capacity_factor = "alltoall", None
    for key, value in parallel.items():
        setattr(config.parallel, key, value)
    config.train.seed = 3
    return config


def _rows(first, count):
    """Rows ``[first, first+count)`` of the packed global batch as a :class:`Batch`:
    documents restart positions; padding is not real and has no loss; a document's last
    label (the next document's first token) has no loss either."""
    gen = torch.Generator().manual_seed(8)
    tokens = torch.randint(0, VOCAB, (len(ROWS), SEQ), generator=gen)[first:first + count]
    labels = tokens.roll(-1, dims=1)
    loss_mask, positions = torch.ones(count, SEQ), torch.zeros(count, SEQ, dtype=torch.int64)
    token_mask = torch.ones(count, SEQ, dtype=torch.bool)
    cu = [0]
    for r, row in enumerate(ROWS[first:first + count]):
        start = 0
        for length, pad in row:
            positions[r, start:start + length] = torch.arange(length)
            loss_mask[r, start + length - 1] = 0
            if pad:
                loss_mask[r, start:start + length] = 0
                token_mask[r, start:start + length] = False
            start += length
            cu.append(r * SEQ + start)
    return Batch(tokens, labels, loss_mask, positions, torch.tensor(cu, dtype=torch.int32), token_mask)


def _record_seq_aux(model):
    """Per MoE layer, the list of seq_aux values of its forwards."""
    values = []
    for block in model.layers:
        if isinstance(block.mlp, MoELayer):
            seen = []
            block.mlp.router.register_forward_hook(lambda m, args, out, seen=seen: seen.append(out.losses["seq_aux"].item()))
            values.append(seen)
    return values


# --------------------------------------------------------------------------- one process

def _formula(hidden, weight, token_mask, batch):
    """seq_aux of one layer by its definition: for each sample b (token t is sample t % B
    in the sequence-first order), over its real tokens only, ``E * sum_i f_bi P_bi`` with
    ``f_bi`` the share of its k-choices that went to expert i and ``P_bi`` its mean
    softmax score for expert i; then the mean over samples."""
    scores = torch.softmax(hidden @ weight.t(), dim=-1)  # [T, E]
    chosen = torch.zeros_like(scores).scatter_(1, scores.topk(K, dim=-1).indices, 1.0)  # [T, E]
    real = token_mask.t().reshape(-1)  # [B, S] -> [S*B], the model's token order
    per_sample = []
    for b in range(batch):
        rows = [t for t in range(hidden.shape[0]) if t % batch == b and bool(real[t])]
        n = len(rows)
        f = chosen[rows].sum(dim=0) / (K * n)
        p = scores[rows].sum(dim=0) / n
        per_sample.append(E * (f * p).sum())
    return torch.stack(per_sample).mean()


def test_seq_aux_equals_per_sample_formula():
    b = _rows(0, len(ROWS))
    groups = ProcessGroups.single_process()
    models = {coeff: build_model(_config(coeff), groups) for coeff in (COEFF, 0.0)}
    inputs, outputs = [], []
    for block in models[COEFF].layers:
        block.mlp.router.register_forward_pre_hook(lambda m, args: inputs.append(args[0].detach().clone()))
        block.mlp.router.register_forward_hook(lambda m, args, out: outputs.append(out))
    for model in models.values():
        docs = model.documents(b.cu_seqlens, b.token_mask, tuple(b.tokens.shape))
        model(b.tokens, b.labels, loss_mask=b.loss_mask, docs=docs).backward()

    layers = list(models[COEFF].layers)
    assert len(inputs) == len(outputs) == len(layers) == 2
    for block, hidden, routing in zip(layers, inputs, outputs):
        weight = block.mlp.router.weight.detach()
        want = _formula(hidden, weight, b.token_mask, len(ROWS))
        torch.testing.assert_close(routing.losses["seq_aux"], want, rtol=1e-5, atol=0)
        # Not the batch-level loss under another name: samples are balanced one by one.
        whole = _formula(hidden, weight, b.token_mask.t().reshape(1, -1), 1)
        assert abs(whole.item() - want.item()) > 1e-3

    # The last layer's router weight feeds no later loss, so the seq_aux term of its grad
    # is COEFF times the formula's gradient (routing and LM loss are unchanged), up to the
    # rounding of the two ways of summing it.
    last, hidden = layers[-1].mlp.router.weight, inputs[-1]
    w = last.detach().clone().requires_grad_(True)
    (COEFF * _formula(hidden, w, b.token_mask, len(ROWS))).backward()
    added = last.grad - list(models[0.0].layers)[-1].mlp.router.weight.grad
    assert w.grad.abs().max() > 1e-4
    torch.testing.assert_close(added, w.grad, rtol=1e-4, atol=1e-7)


# --------------------------------------------------------------------------- layouts

# name -> (world, layout sizes). tp > 1 implies SP.
CASES = {
    "dp2": (2, dict()),
    "tp2": (2, dict(tp=2)),
    "cp2": (2, dict(cp=2)),
    "tp2-ep2": (4, dict(tp=2, ep=2, etp=1)),
}


def _case_config(name):
    sizes = CASES[name][1]
    return _config(tp=sizes.get("tp", 1), cp=sizes.get("cp", 1), ep=sizes.get("ep", 1), etp=sizes.get("etp"),
                   sequence_parallel=sizes.get("tp", 1) > 1)


def _one_step(model, groups, config, micro_batches):
    """One forward/backward: the global loss, per layer the seq_aux of each micro-batch,
    the synced global grads."""
    seq_aux = _record_seq_aux(model)
    losses = forward_backward(model, micro_batches, groups, config)
    sync_grads(model.parameters(), groups)
    return {"loss": losses.sum().item(), "seq_aux": seq_aux, "grads": _global_grads(model, groups)}


def _rank(rank, world_size, names):
    results = []
    for name in names:
        groups = create_process_groups(ParallelLayout(world_size, **CASES[name][1]))
        config = _case_config(name)
        dp, cp = groups.size("dp"), groups.size("cp")
        rows = len(ROWS) // dp
        batch = _rows(groups.rank_in("dp") * rows, rows).cp_slice(groups.rank_in("cp"), cp)
        out = _one_step(build_model(config, groups), groups, config, [batch])
        loss = torch.tensor(out["loss"], dtype=torch.float64)
        torch.distributed.all_reduce(loss, group=groups.dp_cp)
        out["loss"] = loss.item() / groups.size("dp_cp")
        out["dp_rank"] = groups.rank_in("dp")
        results.append(out)
    return results


def _reference(name):
    """One process, the layout's dp shards as micro-batches."""
    world, sizes = CASES[name]
    d = world // (sizes.get("tp", 1) * sizes.get("cp", 1))
    config = _case_config(name)
    config.parallel = ParallelConfig()
    rows = len(ROWS) // d
    groups = ProcessGroups.single_process()
    return _one_step(build_model(config, groups), groups, config, [_rows(i * rows, rows) for i in range(d)])


def _check(names, results):
    for i, name in enumerate(names):
        ref = _reference(name)
        assert all(len(v) == len(ref["seq_aux"][0]) and min(v) > 0 for v in ref["seq_aux"])
        for rank, per_rank in enumerate(results):
            got, where = per_rank[i], f"{name} rank {rank}"
            assert got["loss"] == pytest.approx(ref["loss"], rel=1e-5), where
            for layer, (g, r) in enumerate(zip(got["seq_aux"], ref["seq_aux"])):
                assert g == pytest.approx([r[got["dp_rank"]]], rel=1e-5), f"{where} layer {layer} seq_aux"
            assert_grads_match(got["grads"], ref["grads"], where)


@pytest.mark.parametrize("world", [2, 4])
def test_layouts_match_single_process(world):
    names = [name for name, case in CASES.items() if case[0] == world]
    _check(names, run_ranks(_rank, world, names, timeout=300))


# --------------------------------------------------------------------------- training

def test_training_runs_with_seq_aux(tmp_path):
    overrides = ["model.hidden_size=32", "model.num_layers=2", "model.num_heads=4", "model.num_kv_heads=2",
                 "model.ffn_hidden_size=64", "model.seq_length=32", "moe.ffn_hidden_size=32",
                 "moe.aux_loss_coeff=0", "moe.seq_aux_loss_coeff=0.01", "data.packing=true",
                 "train.micro_batch_size=2", "train.global_batch_size=4", "train.steps=2", "train.save_every=1000",
                 "optimizer.warmup_steps=1", "wandb.mode=disabled", "parallel.ep=1",
                 f"train.run_dir={tmp_path / 'run'}", f"data.cache_dir={tmp_path / 'cache'}"]
    config = load_config("mixtral-tiny", overrides)
    check_trainable(config, 1)
    result = train(config, progress=False)
    records = read_metrics(tmp_path / "run")
    assert [r["step"] for r in records] == [1, 2]
    assert result.losses == [r["loss"] for r in records]
    moe = config.moe
    for r in records:
        # aux_loss is the seq_aux value (the only balancing loss on): one perfectly balanced
        # sample scores 1, so a mean over samples lies near it.
        assert 0.9 < r["aux_loss"] < 2.0
        expected = r["lm_loss"] + config.model.num_layers * (moe.seq_aux_loss_coeff * r["aux_loss"]
                                                             + moe.z_loss_coeff * r["z_loss"])
        assert r["loss"] == pytest.approx(expected, rel=1e-9)


def test_dynamic_cp_with_seq_aux_is_refused():
    config = load_config("mixtral-tiny", ["moe.seq_aux_loss_coeff=0.01", "parallel.cp=2", "parallel.ep=1",
                                          "parallel.dynamic_cp=true", "data.packing=true"])
    with pytest.raises(ConfigError, match=r"moe.seq_aux_loss_coeff=0.01 .*parallel.dynamic_cp=true"):
        check_trainable(config, 2)
    config.parallel.dynamic_cp = False
    check_trainable(config, 2)
