"""The split all-to-all (start, then wait) and the dispatcher that overlaps it with compute, on gloo ranks.

Three things are checked. The order of events: compute placed between start and wait
runs while the exchange is in flight in the forward, and its backward runs while the
reverse exchange is in flight (the autograd engine's order, not assumed but recorded).
The values: an MoE layer with parallel.ep_overlap_chunks=2, shared experts included,
gives the output and gradients of the one-chunk path and of a single process running
the whole layer. The trainer: the loss trajectory through the CLI is that of chunks=1.
"""

from __future__ import annotations

import copy
from contextlib import contextmanager

import pytest
import torch
import torch.distributed as dist

from optimus.config import ConfigError, OptimusConfig, ParallelConfig
from optimus.config_checks import validate
from optimus.parallel.alltoall_dispatch import token_chunks
from optimus.parallel.collectives import all_to_all_start
from optimus.parallel.expert_parallel import apply_expert_parallel
from optimus.parallel.state import build_parallel_state
from tests.distributed import run_distributed
from tests.parallel.test_collectives import block, rows_sent
from tests.parallel.test_dispatchers import BASE, autocast, layer_loss, make_inputs, make_layer, reference_per_chunk
from tests.parallel.test_expert_parallel_training import COMMON, assert_same_trajectory
from tests.trajectories import train_layouts


class _Wrapped:
    """A launched work whose wait() is recorded."""

    def __init__(self, work, log: list, n: int):
        self.work, self.log, self.n = work, log, n

    def wait(self):
        self.log.append(("wait", self.n))
        return self.work.wait()


@contextmanager
def record_exchanges():
    """Log ("launch", n) and ("wait", n) of every asynchronous all_to_all_single, and what marks add."""
    real, log = dist.all_to_all_single, []

    def recording(*args, **kwargs):
        work = real(*args, **kwargs)
        if not kwargs.get("async_op"):
            return work
        n = sum(1 for event in log if event[0] == "launch")
        log.append(("launch", n))
        return _Wrapped(work, log, n)

    dist.all_to_all_single = recording
    try:
        yield log
    finally:
        dist.all_to_all_single = real


def in_flight(log: list) -> int:
    """Exchanges launched and not yet waited for, at the end of `log`."""
    return sum(1 for e in log if e[0] == "launch") - sum(1 for e in log if e[0] == "wait")


class _Mark(torch.autograd.Function):
    """Identity that logs (name, direction, exchanges in flight) when it runs, forward and backward."""

    @staticmethod
    def forward(ctx, x, log, name):
        ctx.log, ctx.name = log, name
        log.append((name, "forward", in_flight(log)))
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        ctx.log.append((ctx.name, "backward", in_flight(ctx.log)))
        return grad, None, None


def mark_module(module, log: list, name: str) -> None:
    """Log around `module`'s forward: marks on its input and output bracket its forward and its backward."""
    forward = module.forward

    def marked(x, *args):
        x = _Mark.apply(x, log, f"{name} in")
        return _Mark.apply(forward(x, *args), log, f"{name} out")

    module.forward = marked


# ---- the split all-to-all ----------------------------------------------------------------


def check_start_wait_order() -> None:
    rank, world = dist.get_rank(), dist.get_world_size()
    in_rows = [rows_sent(rank, j) for j in range(world)]
    out_rows = [rows_sent(j, rank) for j in range(world)]
    x = torch.cat([block(rank, j, seed=0) for j in range(world)]).requires_grad_(True)
    w = torch.tensor(2.0, dtype=torch.float64, requires_grad=True)
    with record_exchanges() as log:
        pending = all_to_all_start(x, out_rows, in_rows, None)
        # Compute that does not depend on the exchange, created between start and wait.
        other = _Mark.apply(w * 3.0, log, "compute").sum()
        y = pending.wait()
        loss = (y * torch.cat([block(j, rank, seed=1) for j in range(world)])).sum() + other
        loss.backward()
    # In the backward, the compute's backward runs while the gradient's reverse exchange is in flight.
    assert log == [
        ("launch", 0), ("compute", "forward", 1), ("wait", 0),
        ("launch", 1), ("compute", "backward", 1), ("wait", 1),
    ], log  # fmt: skip
    # The values are those of the definition (tests/parallel/test_collectives.py): exact, whatever the split.
    torch.testing.assert_close(y, torch.cat([block(j, rank, seed=0) for j in range(world)]), rtol=0, atol=0)
    torch.testing.assert_close(x.grad, torch.cat([block(rank, j, seed=1) for j in range(world)]), rtol=0, atol=0)
    assert w.grad.item() == 3.0
    # Nothing of either exchange is held once the backward is done, though the loss (and so the graph) lives on.
    assert pending._link.forward is None and pending._link.backward is None
    with pytest.raises(RuntimeError, match="already waited"):
        pending.wait()
    # A second backward through a retained graph is refused with a message, before any rank sends anything.
    again = all_to_all_start(x, out_rows, in_rows, None).wait().sum()
    again.backward(retain_graph=True)
    with pytest.raises(RuntimeError, match="runs once"):
        again.backward()


@pytest.mark.slow
@pytest.mark.parametrize("world", [2, 4])
def test_split_all_to_all_overlaps_compute_forward_and_backward(world):
    run_distributed(check_start_wait_order, world)


def test_token_chunks_cover_the_tokens_in_order():
    for n, chunks in [(16, 2), (7, 2), (1, 2), (0, 2), (10, 3), (5, 1)]:
        slices = token_chunks(n, chunks)
        assert len(slices) == chunks
        assert [t for s in slices for t in range(n)[s]] == list(range(n))
        sizes = [s.stop - s.start for s in slices]
        assert max(sizes) - min(sizes) <= 1


def test_overlap_chunks_are_validated():
    cfg = OptimusConfig()
    cfg.parallel.ep_overlap_chunks = 0
    with pytest.raises(ConfigError, match="ep_overlap_chunks=0 must be a whole number"):
        validate(cfg)
    cfg.parallel.ep_overlap_chunks, cfg.parallel.dispatcher = 2, "allgather"
    with pytest.raises(ConfigError, match="needs parallel.dispatcher=alltoall"):
        validate(cfg)


# ---- the overlapped dispatcher against one chunk and one process ---------------------------


def run_layer(full, ps, chunks: int, x: torch.Tensor, grad_out: torch.Tensor, case: dict):
    """Output, input grad, parameter grads and event log of the EP layer with `chunks`."""
    world = dist.get_world_size()
    moe = apply_expert_parallel(
        copy.deepcopy(full), ps, ParallelConfig(nproc=world, ep=world, ep_overlap_chunks=chunks)
    )
    x = x.clone().requires_grad_(True)
    with record_exchanges() as log:
        mark_module(moe.experts, log, "experts")
        if moe.shared is not None:
            mark_module(moe.shared, log, "shared")
        with autocast(case):
            loss, y, _ = layer_loss(moe, x, grad_out)
            loss.backward()
    grads = {n: p.grad for n, p in moe.named_parameters()}
    return y.detach(), x.grad, grads, log


def check_overlapped_layer(case: dict) -> dict:
    rank, world = dist.get_rank(), dist.get_world_size()
    full = make_layer(case)
    xs, grads = make_inputs(case, world)
    if "tokens" in case:  # uneven token counts over the ranks
        xs, grads = [x[:n] for x, n in zip(xs, case["tokens"])], [g[:n] for g, n in zip(grads, case["tokens"])]
    ref = reference_per_chunk(full, xs, grads, case)
    ps = build_parallel_state(world, timeout_s=60)
    one = run_layer(full, ps, 1, xs[rank], grads[rank], case)
    two = run_layer(full, ps, 2, xs[rank], grads[rank], case)

    tol = dict(rtol=2e-2, atol=2e-2) if case.get("bf16") else dict(rtol=1e-5, atol=1e-5)
    n_local = case["n_experts"] // world
    start = rank * n_local
    for path, (y, x_grad, param_grads, _) in {"chunks=1": one, "chunks=2": two}.items():
        torch.testing.assert_close(y, ref[rank]["y"], **tol, msg=lambda m, p=path: f"{p} output: {m}")
        torch.testing.assert_close(x_grad, ref[rank]["x_grad"], **tol, msg=lambda m, p=path: f"{p} input grad: {m}")
        for name, grad in param_grads.items():
            if ".experts." in f".{name}":  # every rank's tokens reach this rank's experts
                expected = sum(r["grads"][name] for r in ref)[start : start + n_local]
            else:
                expected = ref[rank]["grads"][name]
            torch.testing.assert_close(grad, expected, **tol, msg=lambda m, p=path, n=name: f"{p} grad {n}: {m}")
    # And with each other (the expert gradients are sums split in two: equal up to rounding).
    torch.testing.assert_close(two[0], one[0], **tol)
    for name in one[2]:
        torch.testing.assert_close(two[2][name], one[2][name], **tol, msg=lambda m, n=name: f"grad {n}: {m}")
    return {
        "chunks=1": one[3],
        "chunks=2": two[3],
        "received": int(sum(r["counts"][start : start + n_local].sum() for r in ref)),
    }


def assert_overlapped(log: list, name: str, times: int) -> None:
    """`name` ran `times` times each way, each time with an exchange in flight on both sides of it."""
    for direction in ("forward", "backward"):
        seen = [e for e in log if e[0] in (f"{name} in", f"{name} out") and e[1] == direction]
        assert len(seen) == 2 * times, (name, direction, log)
        assert all(e[2] >= 1 for e in seen), (name, direction, log)


CASES = {
    "softmax-shared-2ranks": {**BASE, "shared": 1, "world": 2},
    "sigmoid-capacity-shared-4ranks": {**BASE, "router": "sigmoid", "capacity": 1.0, "shared": 1, "world": 4},
    # Rank 1's experts (2 and 3) are starved: it receives no rows in either chunk.
    "softmax-empty-rank-shared-2ranks": {**BASE, "starve": [2, 3], "shared": 1, "world": 2},
    # One token on rank 0: its first chunk is empty.
    "sigmoid-top3-8experts-uneven-tokens-4ranks": {
        **BASE, "n_experts": 8, "top_k": 3, "router": "sigmoid", "world": 4, "tokens": [1, 16, 5, 9],
    },
    "softmax-shared-bf16-autocast-2ranks": {**BASE, "shared": 1, "world": 2, "bf16": True},
}  # fmt: skip


@pytest.mark.slow
@pytest.mark.parametrize("name", list(CASES))
def test_overlapped_layer_matches_one_chunk_and_single_process(name):
    case = CASES[name]
    results = run_distributed(check_overlapped_layer, case["world"], case)
    if case.get("starve"):
        assert results[1]["received"] == 0 and results[0]["received"] > 0
    for key in ("chunks=1", "chunks=2"):  # every rank launches and waits for the exchanges in the same order
        exchanges = [[e for e in r[key] if e[0] in ("launch", "wait")] for r in results]
        assert all(seq == exchanges[0] for seq in exchanges), (key, exchanges)
    for r in results:
        if case.get("shared"):
            # The shared experts overlap the first exchange with one chunk already, both ways.
            assert_overlapped(r["chunks=1"], "shared", 1)
            assert_overlapped(r["chunks=2"], "shared", 1)
        # With two chunks, each chunk's experts run while the other chunk's rows are in flight, both ways.
        assert_overlapped(r["chunks=2"], "experts", 2)


# ---- through the trainer ------------------------------------------------------------------


@pytest.mark.slow
def test_overlapped_training_matches_one_chunk(tmp_path, corpus_file, single_threaded):
    data = ["data=text", f"data.path={corpus_file}", "parallel.nproc=2", "parallel.ep=2"]
    runs = {
        "chunks=1": [],
        "chunks=2": ["parallel.ep_overlap_chunks=2"],
        # Full recomputation reruns the experts and shared experts while the exchanges are in flight.
        "chunks=2 full checkpointing": ["parallel.ep_overlap_chunks=2", "train.activation_checkpointing=full"],
    }
    metrics, _ = train_layouts(tmp_path, runs, [*COMMON, *data])
    reference = metrics["chunks=1"]
    assert len({round(m["loss"], 6) for m in reference[1:]}) == len(reference) - 1  # the loss moves (after step 0)
    for layout, m in metrics.items():
        assert_same_trajectory(m, reference, layout)
