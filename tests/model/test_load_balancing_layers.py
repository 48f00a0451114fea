"""model.moe.aux_loss_layers over several MoE layers and micro-batches: `pooled` against transformers' own
load_balancing_loss_func, `mean` against a plain per-layer reference; the logged value of each micro-batch and
every gradient of the model. As in a training loop around a transformers model, each micro-batch's loss is
computed on its own (lm + coef x aux) and the step back-propagates their mean."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from optimus.config import ConfigError, ModelConfig, MoEConfig
from optimus.config_checks import validate
from optimus.model import Transformer, moe_layer_ids
from optimus.model.moe import RouterStats
from tests.distributed import run_distributed
from tests.model.test_loss import assert_relative_error

E, K, COEF, MICRO_BATCHES = 6, 2, 0.5, 3


def model_config(aux_loss_layers: str, aux_loss_coef: float, vocab_size: int = 128) -> ModelConfig:
    """One dense block, then three MoE blocks; no z-loss, so the aux loss is the only router loss."""
    moe = MoEConfig(
        n_experts=E, top_k=K, expert_dim=16, aux_loss_coef=aux_loss_coef, z_loss_coef=0.0,
        aux_loss_layers=aux_loss_layers,
    )  # fmt: skip
    return ModelConfig(
        n_layers=4, first_k_dense=1, dim=32, n_heads=4, n_kv_heads=2, vocab_size=vocab_size, ffn_dim=48, moe=moe
    )


def sharpen_routers(model: Transformer) -> None:
    """Router weights large enough that the layers route differently (pooling then changes the loss)."""
    with torch.no_grad():
        for moe in model.moe_layers:
            gen = torch.Generator().manual_seed(moe.layer_idx)
            moe.router.gate.weight.copy_(torch.randn(moe.router.gate.weight.shape, generator=gen) * 0.5)


def built(cfg: ModelConfig) -> Transformer:
    model = Transformer(cfg, kernels="torch")
    model.init_weights(5)
    sharpen_routers(model)
    return model


def micro_batches(vocab_size: int = 128) -> list[torch.Tensor]:
    gen = torch.Generator().manual_seed(2)
    return [torch.randint(0, vocab_size, (2, 11), generator=gen) for _ in range(MICRO_BATCHES)]


def optimus_step(aux_loss_layers: str) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """The trainer's way: the router losses ride on the LM loss's backward; values from RouterStats."""
    cfg = model_config(aux_loss_layers, COEF)
    model = built(cfg)
    stats = RouterStats(moe_layer_ids(cfg), E, grad_scale=1.0 / MICRO_BATCHES)
    model.attach_router_stats(stats)
    for batch in micro_batches():
        (model(batch[:, :-1], batch[:, 1:]).mean() / MICRO_BATCHES).backward()
    grads = {name: param.grad for name, param in model.named_parameters()}
    return stats.micro_batch_means(MICRO_BATCHES)[:, 0], grads


def reference_step(aux_fn) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """lm + COEF x aux_fn(every MoE layer's router logits), per micro-batch, from a model whose own aux loss is
    off; the logits are made from each router's input again, on the graph."""
    model = built(model_config("mean", 0.0))
    logits = []
    for moe in model.moe_layers:
        moe.router.register_forward_hook(lambda router, args, _: logits.append(args[0].float() @ router.gate.weight.T))
    values = []
    for batch in micro_batches():
        logits.clear()
        lm_loss = model(batch[:, :-1], batch[:, 1:]).mean()
        aux_loss = aux_fn(tuple(logits))
        ((lm_loss + COEF * aux_loss) / MICRO_BATCHES).backward()
        values.append(aux_loss.detach())
    return torch.stack(values), {name: param.grad for name, param in model.named_parameters()}


def transformers_pooled(logits_L: tuple[torch.Tensor, ...]) -> torch.Tensor:
    modeling = pytest.importorskip("transformers.models.olmoe.modeling_olmoe")
    assert len(logits_L) == 3
    return modeling.load_balancing_loss_func(logits_L, E, K)


def per_layer_mean(logits_L: tuple[torch.Tensor, ...]) -> torch.Tensor:
    """Each layer's E * sum_e f_e P_e (f_e: its choices of e over its tokens), averaged over the layers."""
    losses = []
    for logits_TE in logits_L:
        probs_TE = logits_TE.softmax(-1)
        chosen_TE = F.one_hot(probs_TE.topk(K, dim=-1).indices, E).sum(1).float()
        losses.append(E * (chosen_TE.mean(0) * probs_TE.mean(0)).sum())
    return torch.stack(losses).mean()


def assert_same_step(got, expected) -> None:
    (values, grads), (ref_values, ref_grads) = got, expected
    torch.testing.assert_close(values, ref_values, rtol=1e-5, atol=0)
    assert grads.keys() == ref_grads.keys()
    for name, grad in grads.items():
        assert_relative_error(grad, ref_grads[name], tol=1e-5)


def test_pooled_matches_transformers_load_balancing_loss():
    assert_same_step(optimus_step("pooled"), reference_step(transformers_pooled))


def test_mean_averages_each_layers_own_loss():
    assert_same_step(optimus_step("mean"), reference_step(per_layer_mean))


def test_the_two_forms_differ_here():
    """The comparisons above tell the forms apart: the values and the router gradients move by far more than
    their tolerance from one form to the other."""
    (pooled, pooled_grads), (mean, mean_grads) = optimus_step("pooled"), optimus_step("mean")
    assert ((pooled - mean).abs() / mean).min() > 1e-3
    router_grads = [name for name in pooled_grads if name.endswith("router.gate.weight")]
    assert len(router_grads) == 3
    for name in router_grads:
        gap = (pooled_grads[name] - mean_grads[name]).norm() / mean_grads[name].norm()
        assert gap > 1e-3, name


def test_pooled_is_refused_with_pipeline_parallelism():
    from optimus.cli import load_config

    cfg = load_config(["model.moe.aux_loss_layers=pooled", "parallel.pp=2", "model.n_layers=4"])
    with pytest.raises(ConfigError, match="aux_loss_layers=pooled does not combine with parallel.pp > 1"):
        validate(cfg, world_size=2)
    with pytest.raises(ConfigError, match="aux_loss_layers='layers' is not supported"):
        validate(load_config(["model.moe.aux_loss_layers=layers"]))


# ---- tensor parallelism: the model split over two ranks against one process ------------------------------


def _tensor_parallel_grads(sp: bool) -> dict[str, float]:
    """Rank body: two micro-batches through a tp=2 model (pooled aux loss, vocabulary 1000 padded to 1024, so
    the head's second half holds the padding) and through the same model in one process; the worst
    difference of the per-token losses, the logged aux losses and each parameter's gradient."""
    from torch.distributed.tensor import DTensor

    from optimus.parallel.state import build_parallel_state
    from optimus.parallel.tensor_parallel import PARTIAL, tp_grad_roles
    from tests.builds import rank_model

    ps = build_parallel_state(1, 60, tp=2, sp=sp)
    cfg = model_config("pooled", COEF, vocab_size=1000)
    models = {
        "tp": rank_model(cfg, ps, seed=3),
        "one": rank_model(cfg, seed=3),
    }
    worst, losses = {}, {}
    for key, model in models.items():
        sharpen_routers(model)
        stats = RouterStats(moe_layer_ids(cfg), E, grad_scale=0.5)
        model.attach_router_stats(stats)
        losses[key] = [model(batch[:, :-1], batch[:, 1:]) for batch in micro_batches(1000)[:2]]
        for loss_BS in losses[key]:
            (loss_BS.mean() / 2).backward()
        aux_M = stats.micro_batch_means(2)[:, 0].contiguous()
        if key == "tp":  # each tp rank holds its share's value: their mean is the micro-batch's
            dist.all_reduce(aux_M)
            aux_M /= 2
        losses[key].append(aux_M)
    worst["loss"] = max((a - b).abs().max().item() for a, b in zip(losses["tp"], losses["one"]))
    roles, ref_params = tp_grad_roles(models["tp"]), dict(models["one"].named_parameters())
    for name, param in models["tp"].named_parameters():
        if isinstance(param.grad, DTensor):
            grad = param.grad.full_tensor()
        else:
            grad = param.grad.clone()
            if roles.get(name) == PARTIAL or name not in roles:
                dist.all_reduce(grad)
        worst[name] = (grad - ref_params[name].grad).abs().max().item()
    return worst


@pytest.mark.parametrize("sp", [True, False])
def test_tensor_parallel_pooled_model_over_padded_vocabulary_matches_one_process(sp):
    """The pooled loss's gradients under tp (each rank routes half of each sequence) and the vocab-parallel
    loss over the real vocabulary (the padding columns all on the second rank) equal one process's."""
    worst, _ = run_distributed(_tensor_parallel_grads, 2, sp)
    assert max(worst.values()) < 2e-6, {k: v for k, v in worst.items() if v >= 2e-6}


# ---- the trainer: every pp = 1 layout reproduces one process -------------------------------------------------


@pytest.mark.slow
def test_pooled_layouts_match_single_process(tmp_path, corpus_file, single_threaded):
    """The layout oracle (tests/parallel/test_tensor_parallel.py) with the pooled loss and a padded vocabulary:
    data parallelism, expert parallelism and tensor parallelism (sp off, so each tp rank slices its share of
    the sequence) each pool their own counts and reproduce one process's trajectory."""
    from tests.parallel.test_tensor_parallel import ORACLE
    from tests.trajectories import assert_same_trajectory, train_layouts

    args = [*ORACLE, "data=text", f"data.path={corpus_file}", "model.moe.aux_loss_layers=pooled"]
    args += ["model.moe.aux_loss_coef=0.1", "model.vocab_size=1000"]
    runs = {
        "nproc=1": [],
        "dp=2": ["parallel.nproc=2"],
        "ep=2": ["parallel.nproc=2", "parallel.ep=2"],
        "tp=2 no sp": ["parallel.nproc=2", "parallel.tp=2", "parallel.sp=false"],
    }
    metrics, _ = train_layouts(tmp_path, runs, args)
    reference = metrics.pop("nproc=1")
    for layout, run in metrics.items():
        assert_same_trajectory(run, reference, layout)
