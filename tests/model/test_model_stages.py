"""A model that can be cut into pipeline stages: tensor-in, tensor-out blocks, router losses on the
backward, routing statistics in a collector, stages that are the same class with a subset of layers."""

import pytest
import torch
import torch.nn.functional as F

from optimus.config import ModelConfig, MoEConfig
from optimus.model import Transformer, moe_layer_ids
from optimus.model.moe import MoE, RouterStats, router_loss

D, V = 32, 100


def model_config(**moe_overrides) -> ModelConfig:
    moe = MoEConfig(**{"n_experts": 4, "top_k": 2, "expert_dim": 24, "z_loss_coef": 0.01, **moe_overrides})
    return ModelConfig(n_layers=4, dim=D, n_heads=4, n_kv_heads=2, vocab_size=V, ffn_dim=48, first_k_dense=1, moe=moe)


def build(cfg: ModelConfig, **stage) -> Transformer:
    model = Transformer(cfg, kernels="torch", **stage)
    model.init_weights(0)
    return model


def collector(cfg: ModelConfig, grad_scale: float = 1.0) -> RouterStats:
    stats = RouterStats(moe_layer_ids(cfg), cfg.moe.n_experts)
    stats.grad_scale = grad_scale
    return stats


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, V, (2, 9), generator=torch.Generator().manual_seed(seed))


def lm_loss(logits_BSV: torch.Tensor, tokens_BS1: torch.Tensor) -> torch.Tensor:
    return F.cross_entropy(logits_BSV.flatten(0, 1), tokens_BS1[:, 1:].reshape(-1))


@pytest.mark.parametrize(
    "moe_overrides",
    [dict(router="softmax", aux_loss_coef=0.05), dict(router="sigmoid", seq_aux_loss_coef=0.1, aux_loss_coef=0.02)],
    ids=["softmax", "sigmoid-seq"],
)
def test_router_losses_ride_on_the_backward(moe_overrides):
    """lm.backward() with the losses attached gives the gradients of scale * (lm + weighted mean router losses),
    built explicitly from the routers' own (differentiable) losses on a copy without the attachment."""
    cfg, scale = model_config(**moe_overrides), 0.25
    model = build(cfg)
    model.attach_router_stats(collector(cfg, grad_scale=scale))
    batch = tokens()
    (scale * lm_loss(model(batch[:, :-1]), batch)).backward()

    # Reference: the same model with nothing attached (coefficients 0 inside its MoE layers); the router
    # losses added to the loss by hand, captured from each router's output on the same forward pass.
    reference = build(cfg)
    captured = []
    for moe in reference.moe_layers:
        moe.router_loss_coefs = (0.0, 0.0, 0.0)
        moe.router.register_forward_hook(lambda module, args, routing: captured.append(routing))
    logits = reference(batch[:, :-1])
    means = [torch.stack([getattr(r, k) for r in captured]).mean() for k in ("aux_loss", "z_loss", "seq_aux_loss")]
    (scale * (lm_loss(logits, batch) + router_loss(cfg.moe, *means))).backward()

    grads = dict(reference.named_parameters())
    for name, param in model.named_parameters():
        torch.testing.assert_close(param.grad, grads[name].grad, rtol=1e-5, atol=1e-7, msg=name)
    gate = model.moe_layers[0].router.gate.weight
    assert gate.grad.abs().sum() > 0


def test_collector_records_per_layer_and_micro_batch():
    """Means over layers per micro-batch, counts summed over micro-batches, one row per MoE layer."""
    cfg = model_config()
    model = build(cfg)
    stats = collector(cfg)
    model.attach_router_stats(stats)
    captured = []
    for moe in model.moe_layers:
        moe.router.register_forward_hook(lambda module, args, routing: captured.append(routing))
    for seed in range(3):
        model(tokens(seed)[:, :-1])
    n_moe = len(moe_layer_ids(cfg))
    per_pass = [captured[i * n_moe : (i + 1) * n_moe] for i in range(3)]  # [micro-batch][layer]
    expected_M3 = torch.tensor(
        [[torch.stack([getattr(r, k) for r in layers]).mean().item() for k in ("aux_loss", "z_loss", "seq_aux_loss")]
         for layers in per_pass]
    )  # fmt: skip
    torch.testing.assert_close(stats.micro_batch_means(3), expected_M3, rtol=0, atol=0)
    expected_LE = torch.stack([sum(p[layer].tokens_per_expert_E for p in per_pass) for layer in range(n_moe)])
    torch.testing.assert_close(stats.tokens_per_expert(), expected_LE, rtol=0, atol=0)
    assert stats.tokens_per_expert().sum() == 3 * n_moe * 2 * 8 * cfg.moe.top_k  # every token's K choices

    with pytest.raises(RuntimeError, match="ran 3 forward passes in a step of 2 micro-batches"):
        stats.micro_batch_means(2)
    model.eval()
    model(tokens()[:, :-1])  # evaluation is not recorded
    stats.reset()
    assert stats.tokens_per_expert().sum() == 0


def test_stages_compose_to_the_full_model():
    """Two stages (embedding + layers 0-1, layers 2-3 + head) initialised on their own hold the full model's
    values under the same names, compute its logits and gradients, and their collectors add up to its."""
    cfg = model_config()
    full, first, last = build(cfg), build(cfg, layer_ids=[0, 1], head=False), build(cfg, layer_ids=[2, 3], embed=False)
    assert list(first.layers) == ["0", "1"] and list(last.layers) == ["2", "3"]
    assert first.lm_head is None and first.norm is None and last.embed is None
    full_params = dict(full.named_parameters())
    stage_params = {**dict(first.named_parameters()), **dict(last.named_parameters())}
    assert sorted(stage_params) == sorted(full_params)
    for name, param in stage_params.items():
        torch.testing.assert_close(param, full_params[name], rtol=0, atol=0, msg=name)

    full_stats, first_stats, last_stats = collector(cfg), collector(cfg), collector(cfg)
    full.attach_router_stats(full_stats)
    first.attach_router_stats(first_stats)
    last.attach_router_stats(last_stats)
    batch = tokens()
    hidden_BSD = first(batch[:, :-1])
    assert hidden_BSD.shape == (2, 8, D)
    stage_logits = last(hidden_BSD)
    full_logits = full(batch[:, :-1])
    torch.testing.assert_close(stage_logits, full_logits, rtol=0, atol=0)
    lm_loss(stage_logits, batch).backward()
    lm_loss(full_logits, batch).backward()
    for name, param in stage_params.items():
        torch.testing.assert_close(param.grad, full_params[name].grad, rtol=1e-6, atol=1e-8, msg=name)

    torch.testing.assert_close(
        first_stats.micro_batch_means(1) + last_stats.micro_batch_means(1), full_stats.micro_batch_means(1)
    )
    torch.testing.assert_close(
        first_stats.tokens_per_expert() + last_stats.tokens_per_expert(), full_stats.tokens_per_expert()
    )
    assert first_stats.tokens_per_expert()[first_stats.row(2)].sum() == 0  # layer 2 is the other stage's


def test_tied_stages_hold_their_own_embedding_or_head():
    """Cut apart, a tied model's first stage holds the embedding and its last stage a head of its own (the
    pipeline keeps the two equal and adds the head's gradient into the embedding's); whole, they are one."""
    cfg = model_config()
    cfg.tie_embeddings = True
    first = Transformer(cfg, kernels="torch", layer_ids=[0, 1], head=False)
    last = Transformer(cfg, kernels="torch", layer_ids=[2, 3], embed=False)
    assert first.lm_head is None and last.embed is None and last.lm_head.weight.requires_grad
    whole = Transformer(cfg, kernels="torch")
    assert whole.lm_head.weight is whole.embed.weight


def test_bias_update_goes_through_the_moe_layer():
    """MoE.update_bias moves the sigmoid router's selection bias by rate * sign(mean load - load)."""
    moe = MoE(D, MoEConfig(n_experts=4, top_k=2, expert_dim=8, router="sigmoid"), kernels="torch")
    moe.update_bias(torch.tensor([10.0, 0.0, 5.0, 5.0]), rate=0.01)
    torch.testing.assert_close(moe.router.expert_bias, torch.tensor([-0.01, 0.01, 0.0, 0.0]))
