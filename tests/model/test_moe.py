"""The router and MoE layer against plain per-token formulas."""

import math

import pytest
import torch
import torch.nn.functional as F

from optimus.config import MoEConfig
from optimus.model.moe import MoE
from optimus.model.moe.router import Router

D, FF, E = 16, 24, 6


def make_moe(seed=0, **overrides) -> MoE:
    # No router losses by default: their gradients ride on the layer's output (see optimus.model.moe.stats),
    # which the per-token reference does not have.
    defaults = {"n_experts": E, "top_k": 2, "expert_dim": FF, "aux_loss_coef": 0.0, "z_loss_coef": 0.0}
    cfg = MoEConfig(**{**defaults, **overrides})
    torch.manual_seed(seed)
    moe = MoE(D, cfg, kernels="torch")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    return moe


def naive_routing(logits_E: torch.Tensor, cfg: MoEConfig, bias_E: torch.Tensor):
    """Per-token routing from the textbook definitions: chosen experts, their weights, their raw scores."""
    if cfg.router == "softmax":
        probs = torch.exp(logits_E) / torch.exp(logits_E).sum()
        chosen = sorted(range(E), key=lambda e: -probs[e].item())[: cfg.top_k]
        weights = raw = [probs[e] for e in chosen]
        if cfg.norm_topk:
            total = sum(weights)
            weights = [w / total for w in weights]
    else:
        scores = 1 / (1 + torch.exp(-logits_E))
        chosen = sorted(range(E), key=lambda e: -(scores[e] + bias_E[e]).item())[: cfg.top_k]
        raw = [scores[e] for e in chosen]
        weights = [scores[e] / sum(raw) for e in chosen]
    return chosen, weights, raw


def naive_expert(x_D, w13_DF2, w2_FD):
    gate, up = x_D @ w13_DF2[:, :FF], x_D @ w13_DF2[:, FF:]
    return (gate * torch.sigmoid(gate) * up) @ w2_FD


def naive_moe(moe: MoE, x_TD: torch.Tensor) -> torch.Tensor:
    """Loop over tokens; capacity keeps each expert's most probable assignments (raw score), ties by position."""
    cfg = MoEConfig(
        n_experts=E,
        top_k=moe.router.top_k,
        router=moe.router.score_func,
        norm_topk=moe.router.norm_topk,
        capacity_factor=moe.router.capacity_factor,
    )
    routes = []
    for t in range(x_TD.shape[0]):
        logits_E = x_TD[t] @ moe.router.gate.weight.T
        chosen, weights, raw = naive_routing(logits_E, cfg, moe.router.expert_bias)
        routes.append(list(zip(chosen, weights, raw)))
    keep = {(t, k): True for t in range(len(routes)) for k in range(cfg.top_k)}
    if cfg.capacity_factor is not None:
        capacity = math.ceil(cfg.capacity_factor * len(routes) * cfg.top_k / E)
        for e in range(E):
            assigned = [(t, k) for t, r in enumerate(routes) for k, (ee, _, _) in enumerate(r) if ee == e]
            assigned.sort(key=lambda tk: -routes[tk[0]][tk[1]][2].item())  # stable: position breaks ties
            for tk in assigned[capacity:]:
                keep[tk] = False
    outputs = []
    for t, r in enumerate(routes):
        y = torch.zeros(D)
        for k, (e, w, _) in enumerate(r):
            if keep[(t, k)]:
                y = y + w * naive_expert(x_TD[t], moe.experts.w13[e], moe.experts.w2[e])
        if moe.shared is not None:
            y = y + moe.shared(x_TD[t])
        outputs.append(y)
    return torch.stack(outputs)


CASES = [
    dict(router="softmax"),
    dict(router="softmax", norm_topk=True),
    dict(router="sigmoid"),
    dict(router="softmax", capacity_factor=0.5),
    dict(router="softmax", norm_topk=True, capacity_factor=0.5),
    dict(router="sigmoid", capacity_factor=0.75),
    dict(router="softmax", n_shared_experts=1),
    dict(router="softmax", top_k=1),
    dict(router="sigmoid", top_k=4, n_shared_experts=2),
]


@pytest.mark.parametrize("case", CASES, ids=lambda c: "-".join(f"{k}={v}" for k, v in c.items()))
def test_moe_layer_matches_per_token_loop(case):
    moe = make_moe(**case)
    if case["router"] == "sigmoid":
        moe.router.expert_bias.copy_(torch.linspace(-0.5, 0.5, E))
    x = torch.randn(2, 7, D, requires_grad=True)
    y = moe(x)
    x_ref = x.detach().clone().requires_grad_(True)
    y_ref = naive_moe(moe, x_ref.view(-1, D)).view_as(x)
    torch.testing.assert_close(y, y_ref, rtol=1e-5, atol=1e-5)

    grad_out = torch.randn_like(y)
    params = [p for p in moe.parameters()]
    grads = torch.autograd.grad((y * grad_out).sum(), [x, *params], allow_unused=True)
    grads_ref = torch.autograd.grad((y_ref * grad_out).sum(), [x_ref, *params], allow_unused=True)
    for g, g_ref in zip(grads, grads_ref):
        if g_ref is None:
            assert g is None or g.abs().max() == 0
        else:
            torch.testing.assert_close(g, g_ref, rtol=1e-5, atol=1e-5)


def per_token_experts(moe: MoE, x_TD: torch.Tensor, routing) -> torch.Tensor:
    """sum over each token's kept choices of weight * expert(x), one token at a time, on the layer's own routing."""
    outputs = []
    for t in range(x_TD.shape[0]):
        y = x_TD.new_zeros(D)
        for k, e in enumerate(routing.expert_idx_TK[t].tolist()):
            if routing.keep_TK is None or routing.keep_TK[t, k]:
                y = y + routing.weight_TK[t, k] * naive_expert(x_TD[t], moe.experts.w13[e], moe.experts.w2[e])
        outputs.append(y)
    return torch.stack(outputs)


@pytest.mark.parametrize("case", [CASES[1], CASES[5]], ids=["softmax-norm_topk", "sigmoid-capacity"])
def test_fp64_expert_path_of_the_layer_matches_per_token_loop(case):
    # The layer's expert path (permute, grouped experts, weighted combine) in fp64, on the router's own choices
    # (the router computes in fp32 by design): values and the gradients of the input, the expert weights and
    # the router gate (through the combine weights, the routing probabilities) to 1e-10.
    moe = make_moe(**case).double()
    if case["router"] == "sigmoid":
        moe.router.expert_bias.copy_(torch.linspace(-0.5, 0.5, E))
    x = torch.randn(2, 7, D, dtype=torch.float64, requires_grad=True)
    x_TD = x.view(-1, D)
    routing = moe.router(x_TD, seq_len=7)
    y = moe.dispatcher(x_TD, routing, moe.experts)
    y_ref = per_token_experts(moe, x_TD, routing)
    torch.testing.assert_close(y, y_ref, rtol=1e-10, atol=1e-10)
    grad_out = torch.randn_like(y)
    inputs = [x, moe.experts.w13, moe.experts.w2, moe.router.gate.weight]
    grads = torch.autograd.grad((y * grad_out).sum(), inputs, retain_graph=True)
    grads_ref = torch.autograd.grad((y_ref * grad_out).sum(), inputs)
    for g, g_ref in zip(grads, grads_ref):
        torch.testing.assert_close(g, g_ref, rtol=1e-10, atol=1e-10)


def test_capacity_drops_assignments():
    moe = make_moe(capacity_factor=0.25)
    x = torch.randn(1, 16, D)
    routing = moe.router(x.view(-1, D))
    capacity = math.ceil(0.25 * 16 * 2 / E)
    kept_E = torch.bincount(routing.expert_idx_TK[routing.keep_TK], minlength=E)
    assert kept_E.max() <= capacity
    assert (~routing.keep_TK).any()
    assert (routing.weight_TK[~routing.keep_TK] == 0).all()


@pytest.mark.parametrize("score_func", ["softmax", "sigmoid"])
def test_router_losses_match_formulas(score_func):
    router = Router(D, MoEConfig(n_experts=E, top_k=3, router=score_func))
    x = torch.randn(40, D)
    routing = router(x)
    logits = x @ router.gate.weight.T
    if score_func == "softmax":
        probs = F.softmax(logits, dim=-1)
    else:
        probs = torch.sigmoid(logits) / torch.sigmoid(logits).sum(-1, keepdim=True)
    chosen = routing.expert_idx_TK
    f = torch.tensor([(chosen == e).sum().item() / 40 for e in range(E)])  # all k choices count: sums to k
    expected_aux = E * sum(f[e] * probs[:, e].mean() for e in range(E))
    expected_z = (torch.log(torch.exp(logits).sum(-1)) ** 2).mean()
    torch.testing.assert_close(routing.aux_loss, expected_aux, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(routing.z_loss, expected_z, rtol=1e-5, atol=1e-6)
    # Top-k are the k largest (biased) scores.
    ranking = torch.argsort(logits, dim=-1, descending=True)[:, :3]
    assert torch.equal(torch.sort(chosen, -1).values, torch.sort(ranking, -1).values)


@pytest.mark.parametrize("top_k", [1, 2, 4])
def test_balanced_routing_gives_aux_loss_top_k(top_k):
    router = Router(D, MoEConfig(n_experts=4, top_k=top_k))
    with torch.no_grad():
        router.gate.weight.zero_()
    routing = router(torch.randn(8, D))  # uniform probs: P_e = 1/E whatever the choice
    torch.testing.assert_close(routing.aux_loss, torch.tensor(float(top_k)))


def test_sigmoid_bias_selects_but_does_not_weight():
    router = Router(D, MoEConfig(n_experts=E, top_k=2, router="sigmoid"))
    router.expert_bias[3] = 100.0
    x = torch.randn(20, D)
    routing = router(x)
    assert (routing.expert_idx_TK == 3).any(dim=1).all()
    scores = torch.sigmoid(x @ router.gate.weight.T)
    picked = scores.gather(1, routing.expert_idx_TK)
    torch.testing.assert_close(routing.weight_TK, picked / picked.sum(1, keepdim=True))


def test_bias_update_moves_toward_balance():
    router = Router(D, MoEConfig(n_experts=4, top_k=1, router="sigmoid"))
    router.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]), rate=0.01)
    torch.testing.assert_close(router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
    # Repeated updates on a skewed load flip which experts get chosen.
    router = Router(D, MoEConfig(n_experts=4, top_k=1, router="sigmoid"))
    x = torch.randn(256, D)
    before = torch.bincount(router(x).expert_idx_TK.view(-1), minlength=4).float()
    for _ in range(200):
        router.update_bias(torch.bincount(router(x).expert_idx_TK.view(-1), minlength=4).float(), rate=0.01)
    after = torch.bincount(router(x).expert_idx_TK.view(-1), minlength=4).float()
    assert after.max() / after.mean() < before.max() / before.mean()


def test_router_stays_fp32_under_bf16_autocast():
    """Autocast would run the gate matmul in bf16; routing must match the fp32 reference exactly."""
    router = Router(D, MoEConfig(n_experts=E, top_k=2))
    x = torch.randn(64, D)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        routing = router(x.bfloat16())
    assert routing.weight_TK.dtype == torch.float32
    # The input itself was rounded to bf16; compare against fp32 routing of that same input.
    reference = router(x.bfloat16().float())
    assert torch.equal(routing.expert_idx_TK, reference.expert_idx_TK)
    torch.testing.assert_close(routing.weight_TK, reference.weight_TK, rtol=0, atol=0)
    torch.testing.assert_close(routing.z_loss, reference.z_loss, rtol=0, atol=0)
