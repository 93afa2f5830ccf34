"""The dense transformer stack: single-process sanity against references written here,
then the layout-invariance matrix (tp with and without SP, dp, tp x dp) against one
process holding the same global weights and batch."""

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from moe_fold.comm import all_reduce
from moe_fold.config import Config, ModelConfig
from moe_fold.training.grads import clip_grad_norm_, sync_grads
from moe_fold.launch import run_ranks
from moe_fold.layout import ParallelLayout, ProcessGroups, create_process_groups
from moe_fold.models.model import build_model
from moe_fold.models.norm import RMSNorm
from moe_fold.parallel.context_parallel import zigzag_split
from moe_fold.parallel.tensor_parallel import unshard_tp

VOCAB, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, SEQ, BATCH = 128, 64, 4, 2, 16, 16, 4


def _config(qk_norm=False, tie=False, sp=False, seed=7, theta=10000.0, eps=1e-6):
    config = Config()
    config.model = ModelConfig(vocab_size=VOCAB, hidden_size=HIDDEN, num_layers=2, num_heads=HEADS,
                               num_kv_heads=KV_HEADS, head_dim=HEAD_DIM, ffn_hidden_size=96,
                               seq_length=SEQ, rope_theta=theta, norm_eps=eps, qk_norm=qk_norm,
                               tie_embeddings=tie, init_std=0.05)
    config.moe.moe_layer_freq = 0
    config.parallel.sequence_parallel = sp
    config.train.seed = seed
    return config


def _batch(seed=3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    labels = torch.randint(0, VOCAB, (BATCH, SEQ), generator=gen)
    # Row r masks its first 3*r tokens: dp ranks hold different numbers of loss tokens.
    mask = (torch.arange(SEQ)[None, :] >= 3 * torch.arange(BATCH)[:, None]).float()
    return ids, labels, mask


# --------------------------------------------------------------------------- one process

def test_logits_shape_and_loss_is_masked_mean_cross_entropy():
    model = build_model(_config(), ProcessGroups.single_process())
    ids, labels, mask = _batch()
    logits = model.logits(ids)
    assert logits.shape == (BATCH, SEQ, VOCAB)
    per_token = F.cross_entropy(logits.reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    torch.testing.assert_close(model(ids, labels), per_token.mean(), rtol=1e-6, atol=1e-6)
    masked = (per_token * mask.reshape(-1)).sum() / mask.sum()
    torch.testing.assert_close(model(ids, labels, loss_mask=mask), masked, rtol=1e-6, atol=1e-6)
    # Padding labels (-100) under a zero mask change nothing.
    padded = labels.masked_fill(mask == 0, -100)
    torch.testing.assert_close(model(ids, padded, loss_mask=mask), masked, rtol=1e-6, atol=1e-6)


def test_loss_with_num_loss_tokens_is_sum_over_that_count():
    model = build_model(_config(), ProcessGroups.single_process())
    ids, labels, mask = _batch()
    per_token = F.cross_entropy(model.logits(ids).reshape(-1, VOCAB), labels.reshape(-1), reduction="none")
    expected = (per_token * mask.reshape(-1)).sum() / 100.0
    torch.testing.assert_close(model(ids, labels, loss_mask=mask, num_loss_tokens=100.0), expected)


def test_micro_batches_with_global_token_count_accumulate_to_full_batch_grads():
    ids, labels, mask = _batch()
    full = build_model(_config(), ProcessGroups.single_process())
    full(ids, labels, loss_mask=mask).backward()
    acc = build_model(_config(), ProcessGroups.single_process())
    for rows in (slice(0, 1), slice(1, BATCH)):  # uneven micro-batches, uneven token counts
        acc(ids[rows], labels[rows], loss_mask=mask[rows], num_loss_tokens=mask.sum()).backward()
    for (name, p), q in zip(full.named_parameters(), acc.parameters()):
        torch.testing.assert_close(q.grad, p.grad, rtol=1e-5, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_causal_future_tokens_do_not_change_earlier_logits():
    model = build_model(_config(qk_norm=True), ProcessGroups.single_process())
    ids, _, _ = _batch()
    j = 9
    changed = ids.clone()
    changed[:, j] = (changed[:, j] + 1) % VOCAB
    with torch.no_grad():
        a, b = model.logits(ids), model.logits(changed)
    torch.testing.assert_close(a[:, :j], b[:, :j], rtol=0, atol=1e-6)
    assert (a[:, j:] - b[:, j:]).abs().amax(-1).min() > 1e-4


def test_tied_embeddings_share_storage_and_untied_do_not():
    tied = build_model(_config(tie=True), ProcessGroups.single_process())
    assert tied.lm_head.weight is tied.embed.weight
    assert tied.lm_head.weight.data_ptr() == tied.embed.weight.data_ptr()
    untied = build_model(_config(tie=False), ProcessGroups.single_process())
    assert untied.lm_head.weight.data_ptr() != untied.embed.weight.data_ptr()
    n_tied = sum(p.numel() for p in tied.parameters())
    assert sum(p.numel() for p in untied.parameters()) - n_tied == VOCAB * HIDDEN


def test_same_seed_same_weights_other_seed_other_weights():
    a = build_model(_config(seed=1), ProcessGroups.single_process()).state_dict()
    b = build_model(_config(seed=1), ProcessGroups.single_process()).state_dict()
    c = build_model(_config(seed=2), ProcessGroups.single_process()).state_dict()
    for name in a:
        torch.testing.assert_close(a[name], b[name], rtol=0, atol=0)
    assert not torch.equal(a["layers.0.attn.qkv.weight"], c["layers.0.attn.qkv.weight"])
    # Every matrix has its own draw.
    assert not torch.equal(a["layers.0.mlp.fc2.weight"][:, :HIDDEN], a["layers.1.mlp.fc2.weight"][:, :HIDDEN])


def test_rmsnorm_matches_formula_with_eps():
    norm = RMSNorm(8, eps=0.5)
    with torch.no_grad():
        norm.weight.copy_(torch.arange(1.0, 9.0))
    x = torch.randn(3, 8)
    expected = x / torch.sqrt((x * x).mean(-1, keepdim=True) + 0.5) * torch.arange(1.0, 9.0)
    torch.testing.assert_close(norm(x), expected)


def test_positions_shift_invariance_and_batched_positions():
    model = build_model(_config(qk_norm=True), ProcessGroups.single_process())
    ids, _, _ = _batch()
    base = torch.arange(SEQ)
    with torch.no_grad():
        plain = model.logits(ids)
        # Rotary attention depends on position differences only.
        torch.testing.assert_close(model.logits(ids, base + 11), plain, rtol=1e-4, atol=1e-5)
        torch.testing.assert_close(model.logits(ids, base.expand(BATCH, SEQ)), plain, rtol=0, atol=1e-6)
        # Restarting positions in the middle (a packed document) changes later logits.
        packed = torch.cat([torch.arange(8), torch.arange(8)])
        assert not torch.allclose(model.logits(ids, packed)[:, 8:], plain[:, 8:], atol=1e-4)


# --------------------------------------------------------------------------- layouts

STEPS, LR, MAX_NORM = 3, 1e-2, 0.5


def _gather_grads(model, groups):
    """Every grad as the global tensor (tp shards concatenated the way they were split)."""
    out = {}
    tp = groups.size("tp")
    for name, p in model.named_parameters():
        g = p.grad.detach().clone()
        if p.parallel == "tp" and tp > 1:
            shards = [torch.empty_like(g) for _ in range(tp)]
            dist.all_gather(shards, g, group=groups.tp)
            g = unshard_tp(shards, p.tp_dim, p.tp_parts)
        out[name] = g
    return out


def _train(model, groups, ids, labels, mask):
    """STEPS AdamW steps; the first step's synced grads, and every step's loss and norm."""
    opt = torch.optim.AdamW(model.parameters(), lr=LR, weight_decay=0.1)
    dp_cp = groups.size("dp_cp")
    losses, norms, grads = [], [], None
    for step in range(STEPS):
        opt.zero_grad()
        loss = model(ids, labels, loss_mask=mask)
        loss.backward()
        sync_grads(model.parameters(), groups, bucket_numel=20000)
        if step == 0:
            grads = _gather_grads(model, groups)
        norms.append(clip_grad_norm_(model.parameters(), MAX_NORM, groups).item())
        losses.append((all_reduce(loss.detach(), groups.dp_cp) / dp_cp).item())
        opt.step()
    return {"losses": losses, "norms": norms, "grads": grads}


def _layouts_rank(rank, world_size, specs):
    """Train every layout of ``specs`` in turn (one process start for several layouts)."""
    results = []
    for spec in specs:
        groups = create_process_groups(ParallelLayout(world_size, tp=spec["tp"]))
        model = build_model(_config(qk_norm=spec["qk_norm"], tie=spec["tie"], sp=spec["sp"]), groups)
        ids, labels, mask = _batch()
        dp, me = groups.size("dp_cp"), groups.rank_in("dp_cp")
        rows = slice(me * BATCH // dp, (me + 1) * BATCH // dp)
        out = _train(model, groups, ids[rows], labels[rows], mask[rows])
        # numpy, not tensors: the harness's queue would share tensor storage by file
        # descriptor, which dies with the rank process.
        out["grads"] = {k: g.numpy() for k, g in out["grads"].items()}
        results.append(out)
    return results


LAYOUTS = {
    2: {"tp2-sp": dict(tp=2, sp=True, qk_norm=True, tie=True),
        "tp2": dict(tp=2, sp=False, qk_norm=True, tie=False),
        "dp2": dict(tp=1, sp=False, qk_norm=False, tie=False)},
    4: {"tp2-dp2-sp": dict(tp=2, sp=True, qk_norm=True, tie=True),
        "tp2-dp2": dict(tp=2, sp=False, qk_norm=False, tie=True)},
}


@pytest.mark.parametrize("world", list(LAYOUTS))
def test_layouts_match_single_process(world):
    specs = LAYOUTS[world]
    results = run_ranks(_layouts_rank, world, list(specs.values()), timeout=150)
    for i, (name, spec) in enumerate(specs.items()):
        ref_model = build_model(_config(qk_norm=spec["qk_norm"], tie=spec["tie"]), ProcessGroups.single_process())
        ref = _train(ref_model, ProcessGroups.single_process(), *_batch())
        assert ref["norms"][0] > MAX_NORM  # clipping is exercised
        assert ref["losses"][-1] < ref["losses"][0]
        for rank, per_rank in enumerate(results):
            got = per_rank[i]
            where = f"layout {name} rank {rank}"
            assert got["grads"].keys() == ref["grads"].keys()
            for pname, g in ref["grads"].items():
                torch.testing.assert_close(torch.from_numpy(got["grads"][pname]), g, rtol=1e-4, atol=1e-6,
                                           msg=lambda m: f"{where} grad {pname}: {m}")
            torch.testing.assert_close(got["norms"], ref["norms"], rtol=1e-5, atol=0,
                                       msg=lambda m: f"{where} grad norms: {m}")
            torch.testing.assert_close(got["losses"], ref["losses"], rtol=1e-5, atol=0,
                                       msg=lambda m: f"{where} losses: {m}")



def _cp_logits_rank(rank, world_size):
    groups = create_process_groups(ParallelLayout(world_size, cp=world_size))
    model = build_model(_config(qk_norm=True), groups)
    ids, _, _ = _batch()
    with torch.no_grad():
        # No positions given: the model must use this rank's zigzag positions.
        return model.logits(zigzag_split(ids, groups.rank_in("cp"), world_size)).numpy()


def test_context_parallel_default_positions_are_the_rank_zigzag_shard():
    """``positions=None`` under cp 2: each rank's logits are its zigzag shard of one process's
    (rotary positions 0..S_local-1 on every rank would change every attention score)."""
    ids, _, _ = _batch()
    with torch.no_grad():
        ref = build_model(_config(qk_norm=True), ProcessGroups.single_process()).logits(ids)
    for rank, got in enumerate(run_ranks(_cp_logits_rank, 2, timeout=150)):
        torch.testing.assert_close(torch.from_numpy(got), zigzag_split(ref, rank, 2), rtol=1e-5, atol=1e-5,
                                   msg=lambda m: f"cp rank {rank}: {m}")


def _shortcut_config():
    """A LongCat-Flash-shaped model: shortcut_moe blocks of two MLA sublayers, 6 experts and
    3 zero experts, top-3, LoRA-scaled latents."""
    config = Config()
    config.model = ModelConfig(vocab_size=VOCAB, hidden_size=42, num_layers=2, num_heads=6, num_kv_heads=6,
                               ffn_hidden_size=50, seq_length=SEQ, init_std=0.1, attention="mla", q_lora_rank=14,
                               kv_lora_rank=10, qk_nope_head_dim=6, qk_rope_head_dim=4, v_head_dim=5,
                               rope_interleave=True, block="shortcut_moe", mla_lora_scale=True, mla_norm_eps=1e-6,
                               norm_eps=1e-5)
    moe = config.moe
    moe.num_experts, moe.zero_experts, moe.topk, moe.ffn_hidden_size = 6, 3, 3, 22
    moe.pre_softmax, moe.expert_bias, moe.scaling_factor = True, True, 6.0
    return config


def _longcat_layer_written_out(block, x, cos, sin):
    """transformers' LongcatFlashDecoderLayer, written with the block's own parts: the MoE
    reads the first sublayer's post-attention norm, its output joins at the end."""
    first, second = block.sublayers
    h = x + first.attn(first.attn_norm(x), cos, sin)
    normed = first.mlp_norm(h)
    shortcut = block.mlp(normed.flatten(0, 1)).reshape(h.shape)
    h = h + first.mlp(normed.flatten(0, 1)).reshape(h.shape)
    h = h + second.attn(second.attn_norm(h), cos, sin)
    return h + second.mlp(second.mlp_norm(h).flatten(0, 1)).reshape(h.shape) + shortcut


def test_shortcut_moe_block_is_longcat_flash_layer_written_out_forward_and_backward():
    """The block's forward and grads equal LongCat's layer written out; with the attention
    recomputed (train.recompute=full) too; the MLA latents are scaled as configured."""
    from moe_fold.models.model import ShortcutMoEBlock, set_recompute
    from moe_fold.models.rotary import cos_sin

    model = build_model(_shortcut_config(), ProcessGroups.single_process())
    block = model.layers[0]
    assert isinstance(block, ShortcutMoEBlock) and len(block.sublayers) == 2
    assert block.sublayers[1].attn.q_scale == (42 / 14) ** 0.5 and block.sublayers[1].attn.kv_scale == (42 / 10) ** 0.5
    assert block.sublayers[0].attn.kv_norm.eps == 1e-6 and block.sublayers[0].attn_norm.eps == 1e-5
    x = torch.randn(SEQ, 2, 42, generator=torch.Generator().manual_seed(0))
    cos, sin = cos_sin(torch.arange(SEQ), 4, 1e4, torch.float32, None)
    grads = {}
    for mode in ("none", "full", "written"):
        block.zero_grad()
        xi = x.clone().requires_grad_(True)
        if mode == "written":
            out = _longcat_layer_written_out(block, xi, cos, sin)
        else:
            set_recompute(model, mode)
            assert block.recompute == ("attention" if mode == "full" else "none")
            out = block(xi, cos, sin)
        (out * torch.linspace(-1, 1, out.numel()).reshape(out.shape)).sum().backward()
        grads[mode] = (out.detach(), xi.grad, {n: p.grad.clone() for n, p in block.named_parameters()})
    for mode in ("none", "full"):
        torch.testing.assert_close(grads[mode][0], grads["written"][0], rtol=0, atol=0)
        torch.testing.assert_close(grads[mode][1], grads["written"][1], rtol=1e-6, atol=1e-7)
        for name, g in grads["written"][2].items():
            assert g.abs().max() > 0, name
            torch.testing.assert_close(grads[mode][2][name], g, rtol=1e-6, atol=1e-7, msg=lambda m: f"{name}: {m}")


def test_shortcut_moe_cached_decode_equals_the_full_forward():
    """Sampling's cache holds each attention sublayer's keys apart (the second in
    LayerCache.sublayer(1)): the prompt then one token at a time give the full forward's logits."""
    from moe_fold.models.kv_cache import KVCache
    from moe_fold.models.sampling import forward_cached

    model = build_model(_shortcut_config(), ProcessGroups.single_process()).eval()
    ids = torch.randint(0, VOCAB, (2, 10), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        full = model.logits(ids)
        cache = KVCache([0, 1])
        steps = [forward_cached(model, ids[:, :6], cache)] + [forward_cached(model, ids[:, t:t + 1], cache)
                                                              for t in range(6, 10)]
    assert cache[0].sublayer(1).length == 10 and cache[0].length == 10
    torch.testing.assert_close(torch.cat(steps, dim=1), full, rtol=1e-5, atol=1e-5)
