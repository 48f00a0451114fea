"""The step trace's records for known operators and collectives: FLOPs and bytes, which collectives the code
waits for where it issues them, and where it waits for the others."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from optimus.kernels import get_backend
from optimus.operators import attention_flops, op_cost
from optimus.parallel.collectives import reduce_scatter_sum
from optimus.perf.step_trace import StepTrace
from tests.distributed import run_distributed


def _known_step():
    """Rank r of 2: a matrix product, a synchronous all-reduce, an async one read two operators later, an
    attention kernel, and a view."""
    a, b = torch.randn(8, 16), torch.randn(16, 4)  # [M, K], [K, N]
    trace = StepTrace(signatures=True)
    with trace:
        c = a @ b  # 2 M K N FLOPs
        dist.all_reduce(c)
        work = dist.all_reduce(c, async_op=True)
        d = a * 2  # does not read c: no wait yet
        e = c + 1  # reads what the async all-reduce wrote: its wait
        work.wait()
        c.view(32)  # no kernel
        q = torch.randn(1, 2, 8, 4)
        F.scaled_dot_product_attention(q, q, q, is_causal=True)
        reduce_scatter_sum(torch.empty(8), torch.randn(16), dist.group.WORLD)  # gloo's: an all-to-all
    del d, e
    return trace.finish()


def test_known_operators_and_collectives():
    events, _ = run_distributed(_known_step, 2)
    kinds = [e["e"] for e in events]
    comms = [e for e in events if e["e"] == "comm"]
    assert [(c["call"]["op"], c["async"]) for c in comms] == [
        ("all_reduce", False), ("all_reduce", True), ("all_to_all", True)
    ]  # fmt: skip
    assert [c.get("as") for c in comms] == [None, None, "reduce_scatter"]  # priced as the GPU's reduce-scatter
    waits = [i for i, e in enumerate(events) if e["e"] == "wait"]
    assert [events[i]["id"] for i in waits] == [comms[1]["id"], comms[2]["id"]]  # the sum reads the exchange
    # The wait comes after `a * 2` (which does not read the result) and before `c + 1`.
    between = [e for e in events[kinds.index("comm", kinds.index("comm") + 1) + 1 : waits[0]] if e["e"] == "ops"]
    assert sum(n for e in between for kind, _, _, _, _, n in e["ops"] if kind == "mem") == 1
    ops = [op for e in events if e["e"] == "ops" for op in e["ops"]]
    mm = [op for op in ops if op[0] == "mm"]
    assert [op[:4] + op[5:] for op in mm] == [["mm", 2 * 8 * 16 * 4, (8 * 16 + 16 * 4 + 8 * 4) * 4, True, 1]]
    assert json.loads(mm[0][4]) == ["aten.mm.default", [{"t": [[8, 16], [16, 1], "float32"]},
                                                         {"t": [[16, 4], [4, 1], "float32"]}], {}]  # fmt: skip
    attention = [op for op in ops if op[0] == "attn"]
    assert len(attention) == 1 and attention[0][1] == attention_flops(
        torch.empty(1, 2, 8, 4), torch.empty(1, 2, 8, 4), True, False
    )
    assert attention[0][1] == 2 * 2 * 2 * 8 * 8 * 4 // 2  # two products of 8 x 8 x 4 per head, half of them causal
    assert any(op[0] == "view" for op in ops)
    assert all(op[4] is None for op in ops if op[0] == "view")  # a view has no kernel to time


def _gathers_into_one_buffer():
    """Rank r of 2: two async all-gathers into the two halves of one flat buffer, as the sharder issues them."""
    flat = torch.zeros(8)  # [2 gathers x 2 ranks x 2]
    trace = StepTrace()
    with trace:
        first = dist.all_gather_into_tensor(flat[0:4], torch.ones(2), async_op=True)
        second_half = flat[4:8]  # a view: no read yet
        second = dist.all_gather_into_tensor(second_half, torch.ones(2), async_op=True)
        flat[0:4].sum()  # reads the first gather's bytes only
        flat[4:8].sum()
        first.wait()
        second.wait()
    return trace.finish()


def test_a_read_waits_for_the_collective_that_wrote_its_bytes_only():
    events, _ = run_distributed(_gathers_into_one_buffer, 2)
    order = [(e["e"], e.get("id")) for e in events if e["e"] in ("comm", "wait")]
    first, second = (e["id"] for e in events if e["e"] == "comm")
    # Both gathers are in flight before any wait: issuing the second into the other half waited for nothing.
    assert order == [("comm", first), ("comm", second), ("wait", first), ("wait", second)]
    reads = [i for i, e in enumerate(events) if e["e"] == "ops" and any(op[0] == "mem" for op in e["ops"])]
    w1, w2 = (i for i, e in enumerate(events) if e["e"] == "wait")
    assert any(w1 < i < w2 for i in reads) and any(i > w2 for i in reads)  # each just before the sum of its half


def test_an_fp32_dry_runs_grouped_gemm_is_traced_as_its_products():
    # torch's grouped GEMM has no fp32 fake kernel: a dry run stands in for it with the products the CPU kernel
    # runs, one expert at a time. Its outputs are the real kernel's (shape, strides, dtype), for both forms,
    # and the trace holds their FLOPs: 2 A K N for each form.
    from optimus.kernels.torch_backend import RowBounds, _grouped_mm
    from optimus.kernels.torch_private import FakeTensorMode
    from optimus.kernels.torch_private import grouped_mm as torch_grouped_mm

    if torch_grouped_mm is None:
        pytest.skip("this torch has no grouped GEMM")
    n_experts, rows, k, n = 4, 48, 16, 32
    x_AK, w_EKN, g_AN = torch.randn(rows, k), torch.randn(n_experts, k, n), torch.randn(rows, n)
    offsets_E = torch.tensor([12, 24, 36, 48], dtype=torch.int32)
    real = [torch_grouped_mm(x_AK, w_EKN, offs=offsets_E), torch_grouped_mm(x_AK.t(), g_AN, offs=offsets_E)]
    with FakeTensorMode() as mode:
        fx, fw, fg, fo = (mode.from_tensor(t) for t in (x_AK, w_EKN, g_AN, offsets_E))
        trace = StepTrace()
        with trace:
            bounds = RowBounds(fo, rows)  # a real step's (no dry-run reads: the even split)
            fake = [_grouped_mm(fx, fw, bounds), _grouped_mm(fx.t(), fg, bounds)]
    for f, r in zip(fake, real):
        assert (f.shape, f.stride(), f.dtype) == (r.shape, r.stride(), r.dtype)
    ops = [op for e in trace.finish() if e["e"] == "ops" for op in e["ops"]]
    assert sum(op[1] * op[5] for op in ops if op[0] == "mm") == 2 * (2 * rows * k * n)


def test_a_profiler_range_is_no_kernel():
    """torch.profiler.record_function (the ranges Optimus opens around its data-parallel collectives) dispatches
    operators of its own; a trace prices them as no kernel, as it does a view."""
    from optimus.operators import launches_kernel

    assert not launches_kernel(torch.ops.profiler._record_function_enter_new.default)
    assert not launches_kernel(torch.ops.profiler._record_function_exit._RecordFunction)
    assert launches_kernel(torch.ops.aten.mul.Tensor)


def test_an_argument_written_in_place_is_read_and_written_and_no_operand():
    """A custom operator that adds a bf16 product into an fp32 argument and returns nothing (the fused weight
    gradient, optimus::triton_grouped_wgrad_into) moves that argument twice and multiplies in bf16; an in-place
    aten operator, which returns its `self`, is counted the same way."""
    pytest.importorskip("triton", reason="the triton backend registers the operator")
    get_backend("triton")
    x_AM, g_AN = torch.ones(6, 4, dtype=torch.bfloat16), torch.ones(6, 3, dtype=torch.bfloat16)
    offsets_E, sum_EMN = torch.tensor([2, 6], dtype=torch.int32), torch.zeros(2, 4, 3)  # fp32 sum
    op = torch.ops.optimus.triton_grouped_wgrad_into.default
    kind, flops, moved, fp32 = op_cost(op, (x_AM, g_AN, offsets_E, sum_EMN), {}, None)
    assert (kind, flops, fp32) == ("mm", 2 * 6 * 4 * 3, False)
    assert moved == 2 * (6 * 4 + 6 * 3) + 4 * 2 + 2 * 4 * 24  # x, g, offsets; the sum read and written
    a, b = torch.zeros(5), torch.ones(5, dtype=torch.bfloat16)
    assert op_cost(torch.ops.aten.add_.Tensor, (a, b), {}, a)[2] == 2 * 20 + 10
    foreach = op_cost(torch.ops.aten._foreach_add_.Scalar, ([a, a.clone()], 1.0), {}, None)
    assert foreach[2] == 2 * 40  # each list element read and written


def test_a_bf16_attention_backward_is_priced_in_bf16():
    """The backward of a bf16 attention kernel reads the forward's fp32 logsumexp; its products are still bf16,
    so the trace marks it as no fp32 product (priced at the bf16 peak, as its forward is), and an fp32
    attention as one."""
    for dtype in (torch.bfloat16, torch.float32):
        q = torch.randn(1, 2, 8, 4, dtype=dtype, requires_grad=True)  # [B, H, S, D]
        trace = StepTrace()
        with trace:
            F.scaled_dot_product_attention(q, q, q, is_causal=True).sum().backward()
        attention = [op for e in trace.finish() if e["e"] == "ops" for op in e["ops"] if op[0] == "attn"]
        flops = [attention_flops(q, q, True, backward) for backward in (False, True)]
        assert [(op[1], op[3]) for op in attention] == [(f, dtype == torch.float32) for f in flops]


def test_a_view_without_the_schemas_mark_and_a_fill_like_its_argument_move_what_they_write():
    """`_unsafe_view` (reshape's result after a copy) shares its input's storage: no kernel; `new_zeros` and
    `ones_like` read only their argument's shape and dtype: they move what they write, not what they are like."""
    x = torch.ones(64, 32, dtype=torch.bfloat16)
    view = torch.ops.aten._unsafe_view.default
    assert view(x, [2048]).untyped_storage().data_ptr() == x.untyped_storage().data_ptr()
    assert op_cost(view, (x, [2048]), {}, view(x, [2048])) == ("view", 0, 0, False)
    empty = torch.ops.aten.new_zeros.default(x, [0])
    assert op_cost(torch.ops.aten.new_zeros.default, (x, [0]), {}, empty) == ("mem", 0, 0, False)
    ones = torch.ops.aten.ones_like.default(x)
    assert op_cost(torch.ops.aten.ones_like.default, (x,), {}, ones)[2] == 64 * 32 * 2  # written only
    assert op_cost(torch.ops.aten.mul.Tensor, (x, x), {}, x * x)[2] == 3 * 64 * 32 * 2  # a kernel that reads
