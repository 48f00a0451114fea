"""Other libraries' MoE expert paths, for `benchmarks/moe_layer.py --peers`: timed in the same process and rounds.

Each peer gets the same weights, tokens and routing as Optimus's row (the routing handed to it in its own
[T, K] form, so no peer's router is timed) and computes permute -> SwiGLU experts -> weighted combine,
forward and backward, under the same autocast.

  hf_eager       transformers' MixtralExperts, `experts_implementation="eager"` (a loop over experts hit)
  hf_grouped_mm  the same module with `experts_implementation="grouped_mm"`
  torchtitan     torchtitan's RoutedExperts (LocalTokenDispatcher + GroupedExperts on torch._grouped_mm);
                 bf16 only: its experts always compute in bf16

Neither library is a dependency of Optimus. transformers comes with the `hf` extra. torchtitan pins its own
dependencies, so keep it out of the project's environment:

    python -m venv --system-site-packages .venv-peers && .venv-peers/bin/pip install torchtitan
    .venv-peers/bin/python benchmarks/moe_layer.py --peers

A peer that does not import is reported as missing, and its column stays empty.
"""

from __future__ import annotations

import torch


def routing_by_token(token_idx_A, weight_A, offsets_E, n_tokens: int, top_k: int):
    """Expert-sorted assignments -> (expert ids [T, K] int64, weights [T, K]); the weights stay differentiable
    in weight_A. Every token must have exactly `top_k` assignments (dropless routing)."""
    counts_E = torch.diff(offsets_E.long(), prepend=offsets_E.new_zeros(1).long())
    expert_A = torch.repeat_interleave(torch.arange(counts_E.shape[0], device=counts_E.device), counts_E)
    by_token_A = torch.argsort(token_idx_A, stable=True)  # [A], each token's K rows together
    ids_TK = expert_A[by_token_A].view(n_tokens, top_k)
    weights_TK = weight_A[by_token_A].view(n_tokens, top_k)
    return ids_TK, weights_TK


def _leaf(t: torch.Tensor) -> torch.Tensor:
    return t.detach().contiguous().clone().requires_grad_()


def make_hf(problem, s, device, context, implementation: str):
    """transformers' MixtralExperts, with its weights in its own layout ([E, 2F, D] and [E, D, F])."""
    from transformers import MixtralConfig
    from transformers.models.mixtral.modeling_mixtral import MixtralExperts

    x_TD, w13_EDF2, w2_EFD, dout_TD = problem
    config = MixtralConfig(
        hidden_size=s["D"],
        intermediate_size=s["F"],
        num_local_experts=s["E"],
        num_experts_per_tok=s["K"],
        hidden_act="silu",
    )
    config._experts_implementation = implementation
    experts = MixtralExperts(config).to(device, w13_EDF2.dtype)
    experts.gate_up_proj = torch.nn.Parameter(_leaf(w13_EDF2.transpose(1, 2)))  # [E, 2F, D] = [gate | up]
    experts.down_proj = torch.nn.Parameter(_leaf(w2_EFD.transpose(1, 2)))  # [E, D, F]
    weights = (experts.gate_up_proj, experts.down_proj)

    def forward_backward(routing):
        token_idx_A, weight_A, offsets_E = routing
        with context():
            ids_TK, weights_TK = routing_by_token(token_idx_A, weight_A, offsets_E, s["T"], s["K"])
            out_TD = experts(x_TD, ids_TK, weights_TK)
        return out_TD, torch.autograd.grad(out_TD, (x_TD, weight_A, *weights), dout_TD.to(out_TD.dtype))

    return forward_backward


def make_torchtitan(problem, s, device, context):
    """torchtitan's RoutedExperts: its token reorder, grouped experts and combine."""
    from torchtitan.models.common.moe import GroupedExperts, RoutedExperts
    from torchtitan.models.common.token_dispatcher import LocalTokenDispatcher

    x_TD, w13_EDF2, w2_EFD, dout_TD = problem
    T, D, F, E, K = s["T"], s["D"], s["F"], s["E"], s["K"]
    config = RoutedExperts.Config(
        inner_experts=GroupedExperts.Config(dim=D, hidden_dim=F, num_experts=E),
        token_dispatcher=LocalTokenDispatcher.Config(num_experts=E, top_k=K),
    )
    routed = config.build().to(device)
    experts = routed.inner_experts
    experts.w1_EFD = torch.nn.Parameter(_leaf(w13_EDF2[:, :, :F].transpose(1, 2)))  # [E, F, D]
    experts.w3_EFD = torch.nn.Parameter(_leaf(w13_EDF2[:, :, F:].transpose(1, 2)))  # [E, F, D]
    experts.w2_EDF = torch.nn.Parameter(_leaf(w2_EFD.transpose(1, 2)))  # [E, D, F]
    weights = (experts.w1_EFD, experts.w3_EFD, experts.w2_EDF)

    def forward_backward(routing):
        token_idx_A, weight_A, offsets_E = routing
        counts_E = torch.diff(offsets_E.long(), prepend=offsets_E.new_zeros(1).long())
        with context():
            ids_TK, weights_TK = routing_by_token(token_idx_A, weight_A, offsets_E, T, K)
            out_TD = routed(x_TD.view(1, T, D), weights_TK.view(1, T, K), ids_TK.view(1, T, K), counts_E).view(T, D)
        return out_TD, torch.autograd.grad(out_TD, (x_TD, weight_A, *weights), dout_TD.to(out_TD.dtype))

    return forward_backward


PEERS = {
    "hf_eager": lambda problem, s, device, context: make_hf(problem, s, device, context, "eager"),
    "hf_grouped_mm": lambda problem, s, device, context: make_hf(problem, s, device, context, "grouped_mm"),
    "torchtitan": make_torchtitan,
}
COMPUTES_ONLY_BF16 = ("torchtitan",)
# Relative error (of norms) a peer's output and gradients may have against Optimus's on one routing: a peer
# outside it computes something else, and its timing would mean nothing.
TOLERANCE = {torch.float32: 1e-4, torch.bfloat16: 3e-2}


def _relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a.float() - b.float()).norm() / b.float().norm().clamp_min(1e-30)).item()


def peer_steps(problem, routings, reference, s, dtype, device, context) -> tuple[dict, dict]:
    """-> ({peer: step} for the peers that import and compute in `dtype`, {peer: why it has no column}).

    `problem`: the leaves (x, W13, W2, the output gradient); `reference`: Optimus's routing -> (out, grads of x and
    the routing weights first); `context`: the autocast context every method runs under. Each peer's output and
    those two gradients are first checked against Optimus's on one routing; a peer outside TOLERANCE raises."""
    steps, missing = {}, {}
    routing = routings()
    out_ref, grads_ref = reference(routing)
    for name, make in PEERS.items():
        if name in COMPUTES_ONLY_BF16 and dtype != torch.bfloat16:
            missing[name] = "computes in bf16 only"
            continue
        try:
            forward_backward = make(problem, s, device, context)
        except ImportError as err:
            missing[name] = f"not installed ({err.name})"
            continue
        out, grads = forward_backward(routing)
        error = max(_relative_error(a, b) for a, b in zip((out, *grads[:2]), (out_ref, *grads_ref[:2])))
        if error > TOLERANCE[dtype]:
            raise RuntimeError(f"{name} differs from Optimus by {error:.1e} (relative): it is not the same layer.")
        steps[name] = lambda forward_backward=forward_backward: forward_backward(routings())
    return steps, missing
