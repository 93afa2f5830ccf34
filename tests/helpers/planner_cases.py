"""The planner's test cases shared by tests/planner/: two layouts of world 4 with every
group kind the MoE step uses, one training step on them inside the byte counter, the rows
each rank's routing sent, and a config small enough to count by hand."""

import torch

from moe_fold import comm
from moe_fold.config import config_from_dict
from moe_fold.layout import ParallelLayout, create_process_groups
from moe_fold.planner.comm import Routing

from tests.helpers.router_outputs import router_outputs

# Two layouts of world 4 with every group kind the MoE step uses:
# "etp2": tp 2 (SP), ep 2, etp 2 -> dp 2, edp 1; distributed optimizer; qk-norm, a gated
#         shared expert, z-loss and the global aux loss; one dense and one MoE layer; one
#         MTP depth (an MoE block, like the last layer).
# "etp1": tp 2 (SP), ep 2, etp 1 -> dp 2, edp 2; experts padded to capacity, so every
#         split is known from the config: the planner's uniform rows are exact; OLMoE's
#         QK-norm over the whole (tp-split) q and k projections.
LAYOUTS = {
    "etp2": {
        "model": {"qk_norm": True, "mtp_num_layers": 1},
        "moe": {"moe_layer_freq": [0, 1], "shared_expert_ffn_hidden_size": 32, "shared_expert_gate": True,
                "z_loss_coeff": 1e-3, "global_aux_loss_coeff": 1e-3},
        "parallel": {"tp": 2, "ep": 2, "sequence_parallel": True},
        "optimizer": {"distributed": True},
    },
    "etp1": {
        "model": {"qk_norm": True, "qk_norm_scope": "projection"},
        "moe": {"moe_layer_freq": 1, "capacity_factor": 1.5, "pad_to_capacity": True},
        "parallel": {"tp": 2, "ep": 2, "etp": 1, "sequence_parallel": True},
    },
    # "mla": "etp1" with multi-head latent attention (its latents, not the hidden states,
    # gathered over tp), a dense first layer and an ungated shared expert.
    "mla": {
        "model": {"attention": "mla", "num_kv_heads": 4, "q_lora_rank": 12, "kv_lora_rank": 10,
                  "qk_nope_head_dim": 6, "qk_rope_head_dim": 4, "v_head_dim": 5},
        "moe": {"moe_layer_freq": [0, 1], "capacity_factor": 1.5, "pad_to_capacity": True,
                "shared_expert_ffn_hidden_size": 32},
        "parallel": {"tp": 2, "ep": 2, "etp": 1, "sequence_parallel": True},
    },
}


def layout_config(name: str):
    base = {
        "model": {"vocab_size": 64, "hidden_size": 32, "num_layers": 2, "num_heads": 4, "num_kv_heads": 2,
                  "ffn_hidden_size": 64, "seq_length": 16},
        "moe": {"num_experts": 4, "topk": 2, "ffn_hidden_size": 32},
        "train": {"micro_batch_size": 2, "global_batch_size": 8},
    }
    for section, values in LAYOUTS[name].items():
        base.setdefault(section, {}).update(values)
    return config_from_dict(base)


def train_step(rank: int, world: int, names: list[str]) -> dict:
    """One training step (forward and backward of every micro-batch, then
    apply_gradients) per layout, inside the byte counter; also this rank's parameters
    and the per-expert token counts of every MoE layer and micro-batch."""
    from moe_fold.models.model import build_model
    from moe_fold.training.optim import apply_gradients, build_optimizer

    out = {}
    for name in names:
        config = layout_config(name)
        p = config.parallel
        groups = create_process_groups(ParallelLayout(world, tp=p.tp, ep=p.ep, etp=p.etp))
        model = build_model(config, groups)
        optimizer = build_optimizer(model, config.optimizer, groups)
        t = config.train
        micro = t.global_batch_size // (t.micro_batch_size * groups.size("dp"))
        gen = torch.Generator().manual_seed(100 + groups.rank_in("dp"))
        counts = []
        with comm.count_bytes() as sent:
            for _ in range(micro):
                ids = torch.randint(0, config.model.vocab_size, (t.micro_batch_size, config.model.seq_length),
                                    generator=gen)
                mtp = None
                if model.mtp is not None:
                    # Every rank's rows are whole and unmasked: each depth's count is known
                    # without the per-micro-batch all-reduce (training counts once per step).
                    mtp = model.mtp_targets(ids, ids, None, None)
                    mtp.num_tokens = mtp.mask.sum(dim=(1, 2)) * groups.size("dp")
                with router_outputs(model) as seen:
                    loss = model(ids, ids, mtp=mtp)
                counts.append([out.stats.tokens_per_expert.tolist() for _, out in seen])
                loss.backward()
            apply_gradients(list(model.parameters()), optimizer, groups, config.optimizer.clip_grad)
        params = [(n, q.numel(), q.parallel) for n, q in model.named_parameters()]
        out[name] = {"sent": dict(sent), "counts": counts, "params": params}
    return out


def measured_routing(layout: ParallelLayout, counts: list, rank: int, num_experts: int) -> list[list[Routing]]:
    """Rows of each MoE layer and micro-batch on ``rank`` from every rank's per-expert
    counts: the dispatcher sends a rank's rows for other ep ranks' experts, receives its
    ep peers' rows for its own experts (peers share its etp rank), and all-gathers the
    rows it holds over its etp group."""
    local = num_experts // layout.ep

    def mine(r):
        j = layout.coords(r)["ep"]
        return range(j * local, (j + 1) * local)

    def held(r, mb, layer):
        return sum(counts[q][mb][layer][e] for q in layout.group_of("ep", r) for e in mine(r))

    out = []
    for mb in range(len(counts[rank])):
        layers = []
        for layer in range(len(counts[rank][mb])):
            own = counts[rank][mb][layer]
            sent = sum(own) - sum(own[e] for e in mine(rank))
            received = held(rank, mb, layer) - sum(own[e] for e in mine(rank))
            held_etp = sum(held(t, mb, layer) for t in layout.group_of("etp", rank))
            layers.append(Routing(sent, received, held(rank, mb, layer), held_etp, meta=4))
        out.append(layers)
    return out


def hand_config(**parallel):
    """V 16, H 8, 2 heads of 4 with 1 kv head, layer 0 dense (F 12), layer 1 MoE (4
    experts of width 6, top-2, a gated shared expert of width 4), seq 4, untied, bf16."""
    return config_from_dict({
        "model": {"vocab_size": 16, "hidden_size": 8, "num_layers": 2, "num_heads": 2, "num_kv_heads": 1,
                  "ffn_hidden_size": 12, "seq_length": 4},
        "moe": {"num_experts": 4, "topk": 2, "ffn_hidden_size": 6, "moe_layer_freq": [0, 1],
                "shared_expert_ffn_hidden_size": 4, "shared_expert_gate": True},
        "parallel": parallel,
        "train": {"micro_batch_size": 1, "global_batch_size": 2, "precision": "bf16"},
    })
