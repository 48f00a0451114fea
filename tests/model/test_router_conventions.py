"""Router conventions against references: transformers' load-balancing loss, DeepSeek-V3's group-limited
routing, routed scaling and sequence-wise loss (plain per-token PyTorch), global-batch balancing (gloo)."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from optimus.config import ConfigError, ModelConfig, MoEConfig, moe_aux_loss_coef
from optimus.config_checks import validate_model
from optimus.layout import Layout
from optimus.model.moe.layer import MoE
from optimus.model.moe.router import Router
from optimus.parallel import ParallelState
from optimus.parallel.expert_parallel import install_balance_group
from tests.distributed import run_distributed

D = 16


def make_router(seed=0, **moe) -> Router:
    torch.manual_seed(seed)
    router = Router(D, MoEConfig(**{"n_experts": 6, "top_k": 2, **moe}))
    with torch.no_grad():
        router.gate.weight.normal_(0, 0.5)
    return router


@pytest.mark.parametrize("n_experts, top_k", [(4, 1), (6, 2), (10, 3), (12, 8)])
def test_aux_loss_matches_transformers_load_balancing_loss(n_experts, top_k):
    modeling = pytest.importorskip("transformers.models.olmoe.modeling_olmoe")
    router = make_router(n_experts=n_experts, top_k=top_k)
    x_TD = torch.randn(50, D)
    routing = router(x_TD)
    logits_TE = x_TD @ router.gate.weight.T
    expected = modeling.load_balancing_loss_func((logits_TE,), n_experts, top_k)
    torch.testing.assert_close(routing.aux_loss, expected, rtol=1e-5, atol=1e-6)


def test_sigmoid_router_has_no_aux_loss_unless_asked():
    assert moe_aux_loss_coef(MoEConfig(router="sigmoid")) == 0.0
    assert moe_aux_loss_coef(MoEConfig(router="softmax")) == 0.01
    assert moe_aux_loss_coef(MoEConfig(router="sigmoid", aux_loss_coef=0.003)) == 0.003


def naive_group_limited(choice_E: torch.Tensor, n_groups: int, topk_groups: int, top_k: int) -> list[int]:
    """One token: groups ranked by the sum of their two best scores, experts chosen inside the best groups."""
    size = len(choice_E) // n_groups
    group_score = [sorted(choice_E[g * size : (g + 1) * size].tolist(), reverse=True)[:2] for g in range(n_groups)]
    best = sorted(range(n_groups), key=lambda g: -sum(group_score[g]))[:topk_groups]
    allowed = [e for e in range(len(choice_E)) if e // size in best]
    return sorted(allowed, key=lambda e: -choice_E[e].item())[:top_k]


@pytest.mark.parametrize("router_kind", ["softmax", "sigmoid"])
def test_group_limited_routing_and_scaling_match_per_token_reference(router_kind):
    moe = dict(n_experts=12, top_k=3, n_groups=4, topk_groups=2, routed_scaling_factor=2.5, router=router_kind)
    router = make_router(**moe)
    router.expert_bias.copy_(torch.linspace(-0.2, 0.2, 12))
    x_TD = torch.randn(30, D)
    routing = router(x_TD)
    logits_TE = x_TD @ router.gate.weight.T
    for t in range(30):
        if router_kind == "softmax":
            scores_E = logits_TE[t].softmax(-1)
            choice_E = scores_E
        else:
            scores_E = logits_TE[t].sigmoid()
            choice_E = scores_E + router.expert_bias
        chosen = naive_group_limited(choice_E, 4, 2, 3)
        assert sorted(routing.expert_idx_TK[t].tolist()) == sorted(chosen)
        raw = scores_E[routing.expert_idx_TK[t]]
        expected = raw / raw.sum() if router_kind == "sigmoid" else raw
        torch.testing.assert_close(routing.weight_TK[t], 2.5 * expected)


def test_group_limiting_keeps_tokens_inside_their_groups():
    router = make_router(n_experts=16, top_k=4, n_groups=8, topk_groups=2)
    routing = router(torch.randn(64, D))
    groups_per_token = [len(set((routing.expert_idx_TK[t] // 2).tolist())) for t in range(64)]
    assert max(groups_per_token) <= 2


def test_sequence_wise_loss_matches_deepseek_v3_formula():
    router = make_router(n_experts=6, top_k=2, router="sigmoid", seq_aux_loss_coef=1e-4)
    B, S = 3, 10
    x_TD = torch.randn(B * S, D)
    routing = router(x_TD, seq_len=S)
    scores = torch.sigmoid(x_TD @ router.gate.weight.T)
    probs = scores / scores.sum(-1, keepdim=True)
    losses = []
    for b in range(B):
        rows = slice(b * S, (b + 1) * S)
        chosen = routing.expert_idx_TK[rows]
        f = torch.tensor([6 / (2 * S) * (chosen == e).sum().item() for e in range(6)])
        losses.append((f * probs[rows].mean(0)).sum())
    torch.testing.assert_close(routing.seq_aux_loss, torch.stack(losses).mean())
    assert make_router(n_experts=6, router="sigmoid")(x_TD, seq_len=S).seq_aux_loss.item() == 0.0


@pytest.mark.parametrize(
    "moe, match",
    [
        (dict(n_experts=12, n_groups=5), "n_groups"),
        (dict(n_experts=12, n_groups=4, topk_groups=5), "topk_groups"),
        (dict(n_experts=12, top_k=8, n_groups=4, topk_groups=2), "top_k"),
        (dict(aux_loss_scope="batch"), "aux_loss_scope"),
        (dict(routed_scaling_factor=0.0), "routed_scaling_factor"),
    ],
)
def test_bad_routing_settings_are_config_errors(moe, match):
    with pytest.raises(ConfigError, match=match):
        validate_model(ModelConfig(moe=MoEConfig(**moe)))


def global_aux_losses(x_RTD: torch.Tensor, state: dict) -> float:
    """One rank: its aux loss with counts summed over the world (balance group installed from outside)."""
    moe = MoE(D, MoEConfig(n_experts=6, top_k=2, aux_loss_scope="global"))
    moe.router.load_state_dict(state)
    ps = ParallelState(rank=dist.get_rank(), layout=Layout(world=dist.get_world_size(), ep=1))
    install_balance_group(moe, ps)
    return moe.router(x_RTD[dist.get_rank()]).aux_loss.item()


def test_global_scope_counts_experts_over_the_data_parallel_ranks():
    router = make_router(n_experts=6, top_k=2)
    x_RTD = torch.randn(2, 20, D)
    got = run_distributed(global_aux_losses, 2, x_RTD, router.state_dict())
    # Reference: f_e from both ranks' tokens together, P_e from each rank's own tokens.
    chosen = torch.cat([router(x_RTD[r]).expert_idx_TK for r in range(2)])
    f = torch.stack([(chosen == e).sum() for e in range(6)]).float() / 40
    for rank in range(2):
        probs = (x_RTD[rank] @ router.gate.weight.T).softmax(-1)
        assert got[rank] == pytest.approx((6 * (f * probs.mean(0)).sum()).item(), rel=1e-5)
    local = [router(x_RTD[r]).aux_loss.item() for r in range(2)]
    assert got != pytest.approx(local)  # the scope changed something


def test_router_loss_weights_each_term_by_its_coefficient():
    from optimus.model import Transformer, moe_layer_ids
    from optimus.model.moe import RouterStats, router_loss

    moe = MoEConfig(n_experts=4, top_k=2, expert_dim=8, router="sigmoid", seq_aux_loss_coef=0.5, z_loss_coef=0.25)
    cfg = ModelConfig(n_layers=2, dim=16, n_heads=2, n_kv_heads=2, vocab_size=50, moe=moe)
    torch.manual_seed(0)
    model = Transformer(cfg, kernels="torch")
    model.init_weights()
    stats = RouterStats(moe_layer_ids(cfg), moe.n_experts)
    model.attach_router_stats(stats)
    model(torch.randint(0, 50, (2, 6)))
    aux_loss, z_loss, seq_aux_loss = stats.micro_batch_means(1)[0]
    assert seq_aux_loss > 0  # sigmoid: no load-balancing term unless aux_loss_coef is set
    torch.testing.assert_close(router_loss(moe, aux_loss, z_loss, seq_aux_loss), 0.5 * seq_aux_loss + 0.25 * z_loss)
    moe.aux_loss_coef = 0.1
    torch.testing.assert_close(
        router_loss(moe, aux_loss, z_loss, seq_aux_loss), 0.1 * aux_loss + 0.5 * seq_aux_loss + 0.25 * z_loss
    )
