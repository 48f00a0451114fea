"""Expert-parallel dispatchers against a single-process MoE layer, on 2 and 4 gloo ranks.

Every rank builds the same full layer and the same inputs for all ranks. The
reference runs the full layer (local dispatcher, all experts) on each rank's
chunk of tokens; the expert-parallel layer runs only this rank's chunk. Outputs,
input gradients and the gradients of the router and shared expert must match
this rank's chunk; the gradients of the local experts must equal the reference
gradients summed over the chunks of the EP group (every peer's tokens reach them).
"""

from __future__ import annotations

import copy
import os
import signal
import time
from contextlib import contextmanager, nullcontext

import pytest
import torch
import torch.distributed as dist

from optimus.config import ConfigError, MoEConfig, ParallelConfig
from optimus.model.moe import MoE, RouterStats
from optimus.parallel.alltoall_dispatch import regroup_by_local_expert
from optimus.parallel.collectives import CollectiveError
from optimus.parallel.expert_parallel import apply_expert_parallel
from optimus.parallel.state import build_parallel_state
from tests.distributed import run_distributed, spawn_ranks

D, FF, T = 16, 24, 16


def make_layer(case: dict) -> MoE:
    cfg = MoEConfig(
        n_experts=case["n_experts"],
        top_k=case["top_k"],
        expert_dim=FF,
        n_shared_experts=case.get("shared", 0),
        router=case["router"],
        norm_topk=case.get("norm_topk", False),
        capacity_factor=case.get("capacity"),
        aux_loss_coef=0.1,  # router losses with weights far from 0, so that their gradients matter
        z_loss_coef=0.01,
    )
    torch.manual_seed(case.get("seed", 0))
    moe = MoE(D, cfg, kernels="torch")
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
        if case.get("starve"):
            # Every input has x[:, 0] ~ 3 (see make_inputs): a large negative weight on that
            # feature makes the starved experts' logits hopeless, so no token picks them.
            moe.router.gate.weight[:, 0] = 0.0
            moe.router.gate.weight[case["starve"], 0] = -20.0
    return moe


def make_inputs(case: dict, world: int) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
    gen = torch.Generator().manual_seed(1000 + case.get("seed", 0))
    xs = [torch.randn(T, D, generator=gen) for _ in range(world)]
    if case.get("starve"):
        for x in xs:
            x[:, 0] = 3.0 + 0.1 * x[:, 0]
    grads = [torch.randn(T, D, generator=gen) for _ in range(world)]
    return xs, grads


def layer_loss(moe: MoE, x: torch.Tensor, grad_out: torch.Tensor):
    stats = RouterStats([moe.layer_idx], moe.router.n_experts)
    moe.stats = stats
    y = moe(x)
    # A fixed random projection of the output plus the router's losses, so every path carries gradient.
    # (the router's aux and z losses, weighted 0.1 and 0.01 by make_layer, ride on the backward of y)
    return (y * grad_out).sum(), y, stats.tokens_per_expert()[0]


def autocast(case: dict):
    return torch.autocast("cpu", dtype=torch.bfloat16) if case.get("bf16") else nullcontext()


@contextmanager
def record_collective_dtypes():
    """(collective, dtype on the wire) of the token rows (and their gradients) that the dispatchers send,
    forward and backward."""
    import optimus.parallel.collectives as collectives

    sent, originals, inside = [], {}, []
    wires = {"all_to_all_single": 1, "_all_gather_tensor": 1, "reduce_scatter_sum": 1}  # which arg is sent
    for name, arg in wires.items():
        holder = dist if name == "all_to_all_single" else collectives
        originals[name] = (holder, real := getattr(holder, name))

        def recording(*args, real=real, name=name, arg=arg, **kwargs):
            x = args[arg]
            # Token rows, not routing weights; a reduce-scatter's own exchange (gloo) counts as the reduce-scatter.
            if x.is_floating_point() and x.dim() == 2 and x.shape[1] == D and not inside:
                sent.append((name, x.dtype))
            inside.append(name)
            try:
                return real(*args, **kwargs)
            finally:
                inside.pop()

        setattr(holder, name, recording)
    try:
        yield sent
    finally:
        for name, (holder, real) in originals.items():
            setattr(holder, name, real)


def reference_per_chunk(full: MoE, xs, grads, case: dict) -> list[dict]:
    """Output, input grad, parameter grads and routing counts of the full layer on each chunk alone."""
    results = []
    for x, g in zip(xs, grads):
        moe = copy.deepcopy(full)
        x = x.clone().requires_grad_(True)
        with autocast(case):
            loss, y, counts_E = layer_loss(moe, x, g)
            loss.backward()
        routing = moe.router(x.detach())
        results.append(
            {
                "y": y.detach(),
                "x_grad": x.grad,
                "grads": {n: p.grad.clone() for n, p in moe.named_parameters()},
                "counts": counts_E,
                "dropped": 0 if routing.keep_TK is None else int((~routing.keep_TK).sum()),
            }
        )
    return results


def check_moe_layer(case: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    ep = case["ep"]
    full = make_layer(case)
    xs, grads = make_inputs(case, world)
    ref = reference_per_chunk(full, xs, grads, case)

    ps = build_parallel_state(ep, timeout_s=60)
    moe = apply_expert_parallel(
        copy.deepcopy(full), ps, ParallelConfig(nproc=world, ep=ep, dispatcher=case["dispatcher"])
    )
    x = xs[rank].clone().requires_grad_(True)
    with autocast(case), record_collective_dtypes() as sent:
        loss, y, counts_E = layer_loss(moe, x, grads[rank])
        loss.backward()

    # bf16: every path rounds to bf16 the same way, but sums (combine, reductions) run in other orders.
    tol = dict(rtol=2e-2, atol=2e-2) if case.get("bf16") else dict(rtol=1e-5, atol=1e-5)
    if case.get("bf16"):  # token rows and expert outputs travel in bf16, not in the fp32 of the residual stream;
        # sums over ranks (reduce-scatter) travel in fp32, so that they are rounded once
        assert sent, sent
        for name, dtype in sent:
            assert dtype == (torch.float32 if name == "reduce_scatter_sum" else torch.bfloat16), sent
    mine = ref[rank]
    torch.testing.assert_close(y, mine["y"], **tol)
    torch.testing.assert_close(x.grad, mine["x_grad"], **tol)
    torch.testing.assert_close(counts_E, mine["counts"])
    n_local = case["n_experts"] // ep
    start = ps.ep_rank * n_local
    ep_peers = [ps.edp_rank * ep + j for j in range(ep)]
    for name, p in moe.named_parameters():
        if ".experts." in f".{name}":
            expected = sum(ref[r]["grads"][name] for r in ep_peers)[start : start + n_local]
        else:
            expected = mine["grads"][name]
        torch.testing.assert_close(p.grad, expected, **tol, msg=lambda m, name=name: f"grad of {name}: {m}")
    assert moe.experts.w13.shape[0] == n_local and moe.experts.expert_offset == start
    received = int(sum(r["counts"][start : start + n_local].sum() for r in (ref[j] for j in ep_peers)))
    return {"received": received, "dropped": sum(r["dropped"] for r in ref), "counts": mine["counts"].tolist()}


BASE = {"n_experts": 4, "top_k": 2, "router": "softmax"}
CASES = {
    "softmax-top2-shared-2ranks": {**BASE, "shared": 1, "world": 2, "ep": 2},
    "sigmoid-top2-capacity-4ranks": {**BASE, "router": "sigmoid", "capacity": 1.0, "shared": 1, "world": 4, "ep": 4},
    "softmax-top1-dp2xep2": {**BASE, "top_k": 1, "capacity": 1.25, "world": 4, "ep": 2},
    "sigmoid-top3-8experts-4ranks": {**BASE, "n_experts": 8, "top_k": 3, "router": "sigmoid", "world": 4, "ep": 4},
    "softmax-norm-top2-8experts-empty-expert": {
        **BASE, "n_experts": 8, "norm_topk": True, "starve": [5], "world": 2, "ep": 2,
    },
    # Rank 1's experts (2 and 3) are starved: rank 1 receives no rows at all and every
    # token's two choices land on rank 0.
    "softmax-empty-rank": {**BASE, "starve": [2, 3], "shared": 1, "world": 2, "ep": 2},
    "sigmoid-empty-rank-capacity": {
        **BASE, "router": "sigmoid", "starve": [2, 3], "capacity": 1.0, "world": 2, "ep": 2,
    },
    "softmax-top2-shared-bf16-autocast-dp2xep2": {**BASE, "shared": 1, "world": 4, "ep": 2, "bf16": True},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
@pytest.mark.parametrize("name", list(CASES))
def test_ep_layer_matches_single_process(name, dispatcher):
    case = {**CASES[name], "dispatcher": dispatcher}
    results = run_distributed(check_moe_layer, case["world"], case)
    if "capacity" in case:
        assert results[0]["dropped"] > 0, "the capacity case should drop some assignments"
    if case.get("starve"):
        for e in case["starve"]:
            assert all(r["counts"][e] == 0 for r in results)
    if case.get("starve") == [2, 3]:
        assert results[1]["received"] == 0 and results[0]["received"] > 0


def test_regroup_by_local_expert():
    # 2 source ranks x 3 local experts; rows arrive (source, expert)-major.
    counts_PL = torch.tensor([[2, 0, 1], [1, 3, 0]])
    labels = [(p, e) for p in range(2) for e in range(3) for _ in range(int(counts_PL[p, e]))]
    order_R, inverse_R = regroup_by_local_expert(counts_PL)
    regrouped = [labels[i] for i in order_R.tolist()]
    assert regrouped == sorted(labels, key=lambda pe: (pe[1], pe[0]))
    assert [regrouped[i] for i in inverse_R.tolist()] == labels


def test_regroup_with_no_rows():
    order_R, inverse_R = regroup_by_local_expert(torch.zeros(3, 2, dtype=torch.int64))
    assert order_R.numel() == 0 and inverse_R.numel() == 0


# ---- unequal token counts and failure handling --------------------------------------------


def allgather_unequal_tokens() -> str:
    rank = dist.get_rank()
    case = {**BASE, "ep": 2, "dispatcher": "allgather"}
    moe = apply_expert_parallel(
        make_layer(case), build_parallel_state(2, 60), ParallelConfig(ep=2, dispatcher="allgather")
    )
    try:
        moe(torch.randn(T + rank, D))
    except ConfigError as err:
        return str(err)
    return "no error"


def test_allgather_rejects_unequal_token_counts():
    messages = run_distributed(allgather_unequal_tokens, 2)
    for msg in messages:
        assert "same number of tokens on every EP rank" in msg and "[16, 17]" in msg


def train_until_killed(dispatcher_name: str, timeout_s: float) -> dict:
    """Rank 1 SIGKILLs itself in the middle of a step; rank 0 must fail fast with a clear message."""
    rank = dist.get_rank()
    case = {**BASE, "ep": 2}
    ps = build_parallel_state(2, timeout_s=timeout_s)
    moe = apply_expert_parallel(make_layer(case), ps, ParallelConfig(ep=2, dispatcher=dispatcher_name))
    start = time.monotonic()
    try:
        for step in range(1000):
            x = torch.randn(T, D, requires_grad=True)
            y = moe(x)
            if rank == 1 and step == 3:
                os.kill(os.getpid(), signal.SIGKILL)  # dies between forward and backward
            y.square().sum().backward()
    except CollectiveError as err:
        return {"error": str(err), "elapsed": time.monotonic() - start}
    return {"error": None}


@pytest.mark.slow
@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_killed_rank_makes_peer_fail_within_timeout(dispatcher):
    timeout_s = 10.0
    outcomes = spawn_ranks(train_until_killed, 2, (dispatcher, timeout_s), timeout_s=60, pg_timeout_s=timeout_s)
    survivor, killed = outcomes
    assert killed.exitcode == -signal.SIGKILL and not killed.reported
    assert survivor.ok, survivor.error
    assert survivor.result["error"] is not None
    assert "a peer rank died or timed out" in survivor.result["error"]
    assert survivor.result["elapsed"] < timeout_s + 5


def stall_peer(timeout_s: float) -> dict:
    """Rank 1 stops taking part (alive but silent); rank 0's all-to-all must hit the group timeout."""
    ps = build_parallel_state(2, timeout_s=timeout_s)
    moe = apply_expert_parallel(make_layer({**BASE, "ep": 2}), ps, ParallelConfig(ep=2))
    if dist.get_rank() == 1:
        time.sleep(timeout_s + 3)  # silent for longer than the timeout
        return {"error": None}
    start = time.monotonic()
    try:
        moe(torch.randn(T, D))
    except CollectiveError as err:
        return {"error": str(err), "elapsed": time.monotonic() - start}
    return {"error": None}


@pytest.mark.slow
def test_stalled_rank_times_out_with_configured_timeout():
    timeout_s = 3.0
    outcomes = spawn_ranks(stall_peer, 2, (timeout_s,), timeout_s=60, pg_timeout_s=timeout_s, grace_s=0.5)
    survivor = outcomes[0]
    assert survivor.ok, survivor.error
    assert "a peer rank died or timed out" in survivor.result["error"]
    # Bounded by parallel.timeout_s on the EP group (not gloo's 30-minute default).
    assert timeout_s - 0.5 <= survivor.result["elapsed"] < timeout_s + 10
