"""Differentiable collectives over a process group, for moving tokens between expert-parallel ranks.

Each forward collective has the adjoint collective as its backward:

    all_to_all (splits in -> out)   <->  all_to_all (splits out -> in)
    all_gather (concatenate ranks)  <->  reduce_scatter (sum, keep own block)

so autograd carries gradients back across ranks. The all-to-all also comes split in
two (`all_to_all_start`, then `.wait()`), so that compute placed in between overlaps
the exchange, in the forward and in the backward. Every rank of the group must
run the same sequence of collectives, forward and backward; the dispatchers
guarantee that by calling each one unconditionally, even with zero rows.

A failed collective (a peer process died, or did not arrive within the process
group's timeout) is re-raised as `CollectiveError` with a message that says so.
"""

from __future__ import annotations

from contextlib import contextmanager

import torch
import torch.distributed as dist

# torch >= 2.13 renamed the tensor forms (the old names warn); older releases only have the old ones.
_all_gather_tensor = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
_reduce_scatter_tensor = getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor


class CollectiveError(RuntimeError):
    """A collective over the EP group failed because a peer rank died or timed out."""


@contextmanager
def _explained(op: str, group):
    try:
        yield
    except RuntimeError as err:
        size = dist.get_world_size(group)
        raise CollectiveError(
            f"{op} over a group of {size} ranks failed: a peer rank died or timed out "
            f"(the limit is parallel.timeout_s); check the other ranks' logs. Cause: {err}"
        ) from err


def group_size(group) -> int:
    return dist.get_world_size(group)


def all_to_all_counts(send_counts: torch.Tensor, group) -> torch.Tensor:
    """Exchange equal-sized blocks of int64 counts: row j of [world, n] goes to rank j; not differentiable."""
    recv_counts = torch.empty_like(send_counts)
    with _explained("all_to_all of token counts", group):
        dist.all_to_all_single(recv_counts, send_counts.contiguous(), group=group)
    return recv_counts


def all_gather_sizes(n: int, device: torch.device, group) -> list[int]:
    """Every rank's `n`, in group-rank order (a small synchronous all-gather)."""
    size = group_size(group)
    mine = torch.tensor([n], dtype=torch.int64, device=device)
    out = torch.empty(size, dtype=torch.int64, device=device)
    with _explained("all_gather of token counts", group):
        _all_gather_tensor(out, mine, group=group)
    return out.tolist()


class _RowExchange:
    """One all_to_all of token rows, launched asynchronously; `wait()` returns the received rows."""

    def __init__(self, x_ND: torch.Tensor, out_rows: list[int], in_rows: list[int], group):
        # Checked here so that a caller's mistake is not reported as a communication failure.
        size = group_size(group)
        if len(in_rows) != size or len(out_rows) != size or sum(in_rows) != x_ND.shape[0]:
            raise ValueError(
                f"all_to_all splits {in_rows} -> {out_rows} do not fit {x_ND.shape[0]} rows on a group of {size} ranks."
            )
        self.group = group
        self.x_ND = x_ND.contiguous()  # held until wait(): the exchange reads it meanwhile
        self.out_MD = x_ND.new_empty((sum(out_rows), *x_ND.shape[1:]))
        with _explained("all_to_all of token rows", group):
            self.work = dist.all_to_all_single(self.out_MD, self.x_ND, out_rows, in_rows, group=group, async_op=True)

    def wait(self) -> torch.Tensor:
        with _explained("all_to_all of token rows", self.group):
            self.work.wait()
        self.x_ND = None
        return self.out_MD


class _Link:
    """What the two halves of a split all_to_all share: the splits, and the exchange in flight in each direction."""

    def __init__(self, out_rows: list[int], in_rows: list[int], group):
        self.out_rows, self.in_rows, self.group = out_rows, in_rows, group
        self.forward: _RowExchange | None = None  # the rows, launched by _Start.forward
        self.backward: _RowExchange | None = None  # their gradient, launched by _Wait.backward


def _once(link: _Link | None) -> _Link:
    if link is None:
        raise RuntimeError(
            "the backward of a split all_to_all runs once: do not backward through it a second time "
            "(retain_graph=True); run the forward again instead."
        )
    return link


class _Start(torch.autograd.Function):
    """Launches the exchange; its output is an empty token that only ties _Wait to it in the graph."""

    @staticmethod
    def forward(ctx, x_ND, link):
        link.forward = _RowExchange(x_ND, link.out_rows, link.in_rows, link.group)
        ctx.link = link
        return x_ND.new_empty(0)

    @staticmethod
    def backward(ctx, grad_token):
        # The graph (and its ctx attributes) lives until the loss is dropped, after the whole backward: let go
        # of the exchange here, or every layer's received gradient rows would stay alive until then.
        link, ctx.link = _once(ctx.link), None
        grad_ND = link.backward.wait()
        link.backward = None
        return grad_ND, None


class _Wait(torch.autograd.Function):
    """Completes the exchange; its backward launches the gradient's reverse exchange, which _Start's completes."""

    @staticmethod
    def forward(ctx, token, link):
        if link.forward is None:
            raise RuntimeError("this all_to_all was already waited for: call wait() once.")
        rows_MD = link.forward.wait()
        link.forward = None  # the receive buffer now belongs to the caller
        ctx.link = link
        return rows_MD

    @staticmethod
    def backward(ctx, grad_MD):
        link, ctx.link = _once(ctx.link), None  # _Start's ctx holds it until the reverse exchange completes
        link.backward = _RowExchange(grad_MD, link.in_rows, link.out_rows, link.group)
        return grad_MD.new_zeros(0), None


class PendingRows:
    """The rows of an all_to_all in flight (see `all_to_all_start`); `wait()` returns them, once."""

    def __init__(self, token: torch.Tensor, link: _Link):
        self._token, self._link = token, link

    def wait(self) -> torch.Tensor:
        return _Wait.apply(self._token, self._link)


def all_to_all_start(x_ND: torch.Tensor, out_rows: list[int], in_rows: list[int], group) -> PendingRows:
    """Launch `all_to_all` (same splits) and return at once; compute placed before `.wait()` overlaps it.

    Differentiable, with the same overlap in the backward: `wait`'s backward launches the reverse
    exchange of the gradient and `all_to_all_start`'s backward waits for it. The autograd engine runs
    the ready node created last first, so the backward of whatever was computed between start and
    wait in the forward runs while that reverse exchange is in flight (tests/parallel/test_exchange_overlap.py
    checks the order). `x_ND` must not be modified before `wait()`, and the backward runs once (the exchange
    is let go of as soon as it is used, not kept for a second backward through a retained graph).
    """
    link = _Link(list(out_rows), list(in_rows), group)
    return PendingRows(_Start.apply(x_ND, link), link)


def all_to_all(x_ND: torch.Tensor, out_rows: list[int], in_rows: list[int], group) -> torch.Tensor:
    """Send rows `in_rows[j]` (consecutive blocks of x) to rank j; receive `out_rows[j]` rows from rank j."""
    return all_to_all_start(x_ND, out_rows, in_rows, group).wait()


class _SummedExchange:
    """A reduce-scatter in flight as an all-to-all of the blocks; `wait()` adds the received blocks."""

    def __init__(self, work, received: torch.Tensor, out: torch.Tensor, world: int):
        self.work, self.received, self.out, self.world = work, received, out, world

    def wait(self) -> bool:
        self.work.wait()
        torch.sum(self.received.view(self.world, -1), dim=0, out=self.out.view(-1))
        return True


def reduce_scatter_sum(out: torch.Tensor, src: torch.Tensor, group, async_op: bool = False):
    """`out` = this rank's block of the sum over `group` of `src` (world blocks of out.numel(), contiguous).

    gloo's reduce_scatter is slower than an all-reduce of the whole (benchmarks/collectives.py:
    1.4-1.9x over 2 and 4 CPU ranks). On gloo it is therefore an all-to-all of the blocks, each
    rank receiving every peer's copy of its own block (a reduce-scatter's traffic), and a local
    sum, which takes half the time or less; it needs a receive buffer the size of `src` while in
    flight. Other backends (NCCL, RCCL, XCCL) use their native reduce-scatter. CPU tensors are what gloo
    carries (the device, not the group's backend, decides: a dry run's fake group issues what the real
    backend would). With `async_op`, returns an object whose `wait()` completes it (the sum happens there)."""
    world = group_size(group)
    if src.device.type != "cpu":
        return _reduce_scatter_tensor(out, src, op=dist.ReduceOp.SUM, group=group, async_op=async_op)
    received = torch.empty_like(src)  # [world x block]: every rank's copy of this rank's block
    exchange = _SummedExchange(dist.all_to_all_single(received, src, group=group, async_op=True), received, out, world)
    if async_op:
        return exchange
    exchange.wait()
    return None


def _gather(x: torch.Tensor, group) -> torch.Tensor:
    out = x.new_empty((group_size(group) * x.shape[0], *x.shape[1:]))
    with _explained("all_gather", group):
        _all_gather_tensor(out, x.contiguous(), group=group)
    return out


def _reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """Sum over ranks, accumulated in at least fp32 (a bf16 sum of P partials loses bits at every add)."""
    size = group_size(group)
    if x.shape[0] % size:
        raise ValueError(f"reduce_scatter needs a row count divisible by the group size {size}, got {x.shape[0]}.")
    wire = torch.promote_types(x.dtype, torch.float32)
    out = x.new_empty((x.shape[0] // size, *x.shape[1:]), dtype=wire)
    with _explained("reduce_scatter", group):
        reduce_scatter_sum(out, x.to(wire).contiguous(), group)
    return out.to(x.dtype)


class _AllGather(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _gather(x, group)

    @staticmethod
    def backward(ctx, grad):
        # Every rank's loss depends on every rank's copy: our block's gradient is the sum over ranks.
        return _reduce_scatter(grad, ctx.group), None


class _ReduceScatter(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, group):
        ctx.group = group
        return _reduce_scatter(x, group)

    @staticmethod
    def backward(ctx, grad):
        return _gather(grad, ctx.group), None


def all_gather(x: torch.Tensor, group) -> torch.Tensor:
    """[N, ...] on each rank -> [world * N, ...], blocks in group-rank order; every rank must pass the same N."""
    return _AllGather.apply(x, group)


def reduce_scatter(x: torch.Tensor, group) -> torch.Tensor:
    """[world * N, ...] on each rank -> [N, ...]: this rank's block of the sum over ranks (summed in >= fp32)."""
    return _ReduceScatter.apply(x, group)
