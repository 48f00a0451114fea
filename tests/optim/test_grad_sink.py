"""Gradient-accumulation fusion (optimus.kernels.grad_sink): which optimizer groups offer their fp32 buffer, and
the Triton expert kernels adding every micro-batch's weight gradient there, against fp32 gradients summed by hand.

Runs the Triton kernels under the interpreter (tests/conftest.py sets TRITON_INTERPRET=1 without a GPU), in fp16:
the interpreter's tl.dot is wrong for bf16 inputs."""

from __future__ import annotations

import pytest
import torch

from optimus.kernels import grad_sink, reference
from optimus.kernels.torch_private import TorchDispatchMode
from optimus.model.moe.experts import GroupedExperts
from optimus.optim.shard_group import GroupComm, ShardGroup
from optimus.optim.sharder import _accumulation, _arrival, _storing

pytest.importorskip("triton", reason="triton is not installed (pip install triton); the triton backend is optional")

E, D, F, ROWS = 3, 16, 8, 20


def expert_group(
    experts: GroupedExperts,
    zero: int = 1,
    grad_dtype=torch.float32,
    grad_sinks: bool = True,
    hooked: bool = True,
    micro_batches: int = 2,
):
    """One rank's optimizer group over the experts' weights for steps of `micro_batches`, as the sharder builds it
    on a world of one (`hooked`: with the hooks the sharder registers)."""
    named = list(experts.named_parameters())
    group = ShardGroup(named, GroupComm(None, 1, 0), 1 << 20, zero, grad_dtype, None, micro_batches, None, grad_sinks)
    for i, s in enumerate(group.flat.slots if hooked else []):
        if zero == 2:
            s.param.register_hook(_arrival(group, i))
            s.param.register_post_accumulate_grad_hook(_storing(group, i))
        elif group.grads_by_hook:
            s.param.register_post_accumulate_grad_hook(_accumulation(group, i))
    return group


def new_experts(dtype: torch.dtype) -> GroupedExperts:
    experts = GroupedExperts(E, D, F, kernels="triton")
    gen = torch.Generator().manual_seed(0)
    with torch.no_grad():
        experts.w13.copy_(torch.randn(E, D, 2 * F, generator=gen) / D**0.5)
        experts.w2.copy_(torch.randn(E, F, D, generator=gen) / F**0.5)
    return experts.to(dtype)


def micro_batches(dtype: torch.dtype) -> list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]]:
    """(rows sorted by expert, rows per expert, upstream gradient) per micro-batch; expert 1 gets none in the
    second."""
    gen = torch.Generator().manual_seed(1)
    out = []
    for counts in ([7, 5, 8], [12, 0, 8]):
        x = torch.randn(ROWS, D, generator=gen).to(dtype)
        out.append((x, torch.tensor(counts), torch.randn(ROWS, D, generator=gen).to(dtype)))
    return out


def fp32_sums(experts: GroupedExperts) -> dict[str, torch.Tensor]:
    """The oracle: each micro-batch's fp32 gradient of the same (rounded) values, summed."""
    return fp32_sums_of(experts, micro_batches(torch.float16))


def fp32_sums_of(experts: GroupedExperts, batches) -> dict[str, torch.Tensor]:
    """fp32_sums over `batches` (as micro_batches returns them)."""
    want = {"w13": torch.zeros(E, D, 2 * F), "w2": torch.zeros(E, F, D)}
    for x, counts, dy in batches:
        w13_32, w2_32 = (w.detach().float().requires_grad_() for w in (experts.w13, experts.w2))
        offsets = torch.cumsum(counts, 0)
        y = reference.expert_swiglu_mlp(x.float(), w13_32, w2_32, offsets)
        d13, d2 = torch.autograd.grad(y, (w13_32, w2_32), dy.float())
        want["w13"] += d13
        want["w2"] += d2
    return want


def assert_sums(group: ShardGroup, flat_grad: torch.Tensor, want: dict[str, torch.Tensor]) -> None:
    for slot in group.flat.slots:
        name = slot.name
        got = flat_grad[slot.start : slot.end].view(want[name].shape)
        err = (got - want[name]).abs().max() / want[name].abs().max()
        assert err < 2e-2, (name, float(err))  # fp16 activations between the products, fp32 sums
        assert got[1].abs().max() > 0  # expert 1's rows of the first micro-batch are in its sum


def test_zero1_fp32_gradients_of_low_precision_weights_are_added_by_the_kernels():
    experts = new_experts(torch.float16)
    group = expert_group(experts)
    for x, counts, dy in micro_batches(torch.float16):
        experts(x, counts).backward(dy)
    assert experts.w13.grad is None and experts.w2.grad is None  # the hook dropped what autograd stored
    assert_sums(group, group.full_grad, fp32_sums(experts))
    grad_sink.mark_added(experts.w13)  # a backward that stopped between its kernel and its hook
    group.zero_grad()
    assert not grad_sink.take_added(experts.w13) and group.full_grad.abs().max() == 0


def test_zero2_sums_of_a_steps_micro_batches_are_added_by_the_kernels():
    # ZeRO-2 keeps each weight's sum of the step's micro-batches until the last completes it and it is reduced: the
    # kernels add into that sum, made on their first use, and no hook adds anything of the weights' size.
    # The first micro-batch's kernels write their fp32 gradients as the sums (no sum is zeroed, none read), the
    # second's add into them.
    experts = new_experts(torch.float16)
    group = expert_group(experts, zero=2)
    sizes = {tuple(experts.w13.shape), tuple(experts.w2.shape), (experts.w13.numel(),), (experts.w2.numel(),)}
    with _AddedShapes() as added:
        for x, counts, dy in micro_batches(torch.float16):
            experts(x, counts).backward(dy)
    assert not sizes & added.shapes and not sizes & added.filled
    wgrads = [name for name, _ in added.calls if name.startswith("optimus.triton_grouped_wgrad")]
    assert wgrads == ["optimus.triton_grouped_wgrad"] * 2 + ["optimus.triton_grouped_wgrad_into"] * 2
    assert {dtype for name, dtype in added.calls if name == "optimus.triton_grouped_wgrad"} == {torch.float32}
    assert experts.w13.grad is None and not group.partial  # the last micro-batch packed both sums and freed them
    group.reduce_rest()
    assert_sums(group, group.grad_shard, fp32_sums(experts))


class _AddedShapes(TorchDispatchMode):
    """While active: the output shapes of every `aten.add` (`shapes`) and of every fill with zeros (`filled`), every
    operator's `namespace.name` with its output's dtype (None for one that returns none) in order (`calls`), and the
    rows each grouped weight-gradient kernel took (`wgrad_rows`)."""

    _FILLS = ("zeros", "zero_", "zeros_like", "new_zeros", "fill_")

    def __init__(self):
        super().__init__()
        self.shapes: set[tuple[int, ...]] = set()
        self.filled: set[tuple[int, ...]] = set()
        self.calls: list[tuple[str, torch.dtype | None]] = []
        self.wgrad_rows: list[int] = []  # rows of each grouped weight-gradient kernel, both parts' where it has two

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        name = func._overloadpacket.__name__
        if name.startswith("triton_grouped_wgrad"):  # (x, g, offsets, dtype or sum, x2, g2, offsets2)
            parts = [args[0], *args[4:5]]
            self.wgrad_rows.append(sum(x.shape[0] for x in parts if isinstance(x, torch.Tensor)))
        if func._overloadpacket in (torch.ops.aten.add, torch.ops.aten.add_):
            self.shapes.add(tuple(out.shape))
        if func.namespace == "aten" and name in self._FILLS:
            self.filled.add(tuple(out.shape))
        self.calls.append((f"{func.namespace}.{name}", out.dtype if isinstance(out, torch.Tensor) else None))
        return out


@pytest.mark.parametrize("zero", [1, 2])
def test_weights_used_twice_in_a_forward_add_both_gradients_and_sum_no_placeholders(zero):
    # parallel.ep_overlap_chunks=2 runs the experts on each half of a micro-batch's rows: two backwards of the same
    # weights, whose gradients both go into the sink; autograd gets one placeholder (the other call returns None),
    # so it adds none together, and the hook drops it (ZeRO-2: and counts one arrival, not the step's last).
    whole, halves = new_experts(torch.float16), new_experts(torch.float16)
    groups = [expert_group(whole, zero=zero), expert_group(halves, zero=zero)]
    x, counts, dy = micro_batches(torch.float16)[0]
    whole(x, counts).backward(dy)
    first, second = torch.tensor([7, 0, 0]), torch.tensor([0, 5, 8])  # rows [0, 7) and [7, 20), by expert
    with _AddedShapes() as added:
        torch.cat([halves(x[:7], first), halves(x[7:], second)]).backward(dy)
    assert tuple(halves.w13.shape) not in added.shapes and tuple(halves.w2.shape) not in added.shapes
    assert halves.w13.grad is None and not grad_sink.take_added(halves.w13)
    # The first use's product waited for the second's: one pass over each weight's sum with both halves' rows.
    assert added.wgrad_rows == [20, 20]

    def sums(group: ShardGroup) -> torch.Tensor:
        if zero == 1:
            return group.full_grad
        assert group.arrivals == [1, 1] and not any(group.packed)  # one micro-batch of two: nothing reduced yet
        return torch.cat([group.sink_for(i) for i in range(len(group.flat.slots))])

    torch.testing.assert_close(sums(groups[1]), sums(groups[0]), rtol=1e-3, atol=1e-3)


@pytest.mark.parametrize(
    "case",
    [
        dict(zero=2, micro_batches=1),  # ZeRO-2 with one micro-batch sums nothing: the gradient is reduced at once
        dict(grad_dtype=torch.float16),  # autograd accumulates in the parameter dtype into .grad views
        dict(grad_sinks=False),  # a schedule with a weight pass of its own (zero bubble)
    ],
    ids=["zero2-one-micro-batch", "grads-in-param-dtype", "not-wanted"],
)
def test_no_sink_is_offered_where_kernels_must_return_the_gradient(case):
    experts = new_experts(torch.float16)
    first = expert_group(experts, hooked=False)
    assert grad_sink.sink_of(experts.w13) is not None
    expert_group(experts, **case)  # a new optimizer over the same model takes the earlier offer back
    assert grad_sink.sink_of(experts.w13) is None and grad_sink.sink_of(experts.w2) is None
    x, counts, dy = micro_batches(torch.float16)[0]
    experts(x, counts).backward(dy)
    assert not grad_sink.take_added(experts.w13) and not grad_sink.take_added(experts.w2)  # returned, not added
    del first


def test_fp32_weights_offer_no_sink():
    experts = new_experts(torch.float32)
    expert_group(experts)  # fp32 gradients of fp32 weights: .grad views of the buffer, as before
    assert grad_sink.sink_of(experts.w13) is None


def test_zero2_sums_under_zero_bubbles_input_and_weight_passes_are_added_once_by_the_kernels():
    # A zero-bubble schedule runs each micro-batch's backward as torch's input pass (autograd.grad towards the
    # stage's input) and, later, its weight pass (towards the weights), which assigns what it gets to .grad. The
    # input pass adds nothing to the sums (its kernels compute no weight gradient), the weight pass adds each
    # micro-batch's once; the placeholders it assigns are dropped at the next event, and nothing of the
    # weights' size is added by torch or by a hook. The inner gradient (dh13) is computed once per micro-batch, by
    # the input pass, which keeps it for the weight pass.
    from torch.distributed.pipelining._backward import stage_backward_input, stage_backward_weight

    experts = new_experts(torch.float16)
    group = expert_group(experts, zero=2)
    weights = [experts.w13, experts.w2]
    sizes = {tuple(w.shape) for w in weights} | {(w.numel(),) for w in weights}
    with _AddedShapes() as added:
        for done, (x, counts, dy) in enumerate(micro_batches(torch.float16)):
            x_in = x.clone().requires_grad_()  # a stage's received activations
            y = experts(x_in, counts)
            before = {slot: held.clone() for slot, held in group.partial.items()}
            (dx,), param_groups = stage_backward_input([y], [dy], [x_in], iter(weights))
            assert dx is not None and group.arrivals == [done, done]  # no weight gradient in the input pass
            assert all(torch.equal(group.partial[slot], held) for slot, held in before.items())
            stage_backward_weight(iter(weights), param_groups)
    assert not sizes & added.shapes
    inner = [name for name, _ in added.calls if name == "optimus.triton_swiglu_backward"]
    assert len(inner) == len(micro_batches(torch.float16))
    group.collect()  # after the backwards: the last weight pass's placeholders dropped
    assert experts.w13.grad is None and experts.w2.grad is None
    group.reduce_rest()
    assert_sums(group, group.grad_shard, fp32_sums(experts))


@pytest.mark.parametrize("wanted", ["weights", "all"])
def test_a_later_backward_with_another_gradient_does_not_reuse_the_input_passs_inner_gradient(wanted):
    # An input-only backward keeps the experts' inner gradient for zero bubble's weight pass, which sends the same
    # dy; a later backward of the same graph with another dy (retain_graph) must compute its own.
    experts = new_experts(torch.float16)
    x, counts, dy1 = micro_batches(torch.float16)[0]
    dy2 = micro_batches(torch.float16)[1][2]
    x = x.clone().requires_grad_()
    y = experts(x, counts)
    torch.autograd.grad(y, x, dy1, retain_graph=True)
    inputs = (experts.w13, experts.w2) if wanted == "weights" else (x, experts.w13, experts.w2)
    got = torch.autograd.grad(y, inputs, dy2)
    leaves32 = [t.detach().float().requires_grad_() for t in inputs]
    x32 = leaves32[0] if wanted == "all" else x.detach().float()
    w13_32, w2_32 = leaves32[-2:]
    want = torch.autograd.grad(
        reference.expert_swiglu_mlp(x32, w13_32, w2_32, torch.cumsum(counts, 0)), leaves32, dy2.float()
    )
    for g, w in zip(got, want):
        assert (g.float() - w).abs().max() / w.abs().max() < 2e-2


@pytest.mark.parametrize("zero", [1, 2])
def test_a_product_held_back_is_added_by_the_hook_or_forgotten_by_a_new_step(zero):
    # One use of a weight in a backward holds its product back for a second use that never comes: the optimizer's
    # hook adds it (the sums are those of an unpaired kernel); a step stopped before the hook forgets it.
    experts = new_experts(torch.float16)
    group = expert_group(experts, zero=zero)
    x, counts, dy = micro_batches(torch.float16)[0]
    with _AddedShapes() as added:
        experts(x, counts).backward(dy)
    assert added.wgrad_rows == [ROWS, ROWS] and grad_sink.take_deferred(experts.w13) is None
    one = fp32_sums_of(experts, [(x, counts, dy)])
    got = group.full_grad if zero == 1 else torch.cat([group.sink_for(i) for i in range(len(group.flat.slots))])
    for slot in group.flat.slots:
        err = (got[slot.start : slot.end].view(one[slot.name].shape) - one[slot.name]).abs().max()
        assert err / one[slot.name].abs().max() < 2e-2, slot.name
    group.zero_grad()
    added_alone = []
    grad_sink.mark_added(experts.w13)
    grad_sink.defer(experts.w13, (x,), lambda: added_alone.append(True))  # a backward stopped here
    group.zero_grad()
    assert grad_sink.take_deferred(experts.w13) is None and not grad_sink.take_added(experts.w13) and not added_alone
