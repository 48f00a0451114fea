"""machine=local's table of operators: a traced call's signature runs the same operator again, on tensors of
the same shapes, strides and dtypes, and its measured time replaces the roofline's."""

from __future__ import annotations

import json

import pytest
import torch

from optimus.perf.costs import op_time
from optimus.perf.machine import Link, MachineModel, with_timed_ops
from optimus.perf.op_timing import _decode, _operator, op_signature, time_signature, traced_signatures

aten = torch.ops.aten


def _calls():
    """Operator calls as a step makes them: strided inputs, integer indices, dtype and list arguments."""
    x = torch.randn(6, 4, dtype=torch.bfloat16)  # [S, D]
    w = torch.randn(8, 4)  # [N, D]
    return [
        (aten.mm.default, (x.float(), w.t()), {}),  # a transposed weight: stride (1, 4)
        (aten.index_select.default, (w, 0, torch.tensor([3, 1, 3])), {}),
        (aten.sum.dim_IntList, (x, [1]), {"keepdim": True}),
        (aten._to_copy.default, (x,), {"dtype": torch.float32}),
        (
            aten.embedding_dense_backward.default,
            (torch.randn(6, 4), torch.tensor([7, 0, 1, 2, 3, 4]), 8, -1, False),
            {},
        ),
    ]


@pytest.mark.parametrize("index", range(5))
def test_a_signature_replays_the_same_call(index):
    func, args, kwargs = _calls()[index]
    signature = op_signature(func, args, kwargs)
    name, encoded_args, encoded_kwargs = json.loads(signature)
    replayed_args = _decode(encoded_args)
    replayed_kwargs = {key: _decode(value) for key, value in encoded_kwargs.items()}
    for original, replayed in zip(args, replayed_args):
        if isinstance(original, torch.Tensor):
            assert (replayed.shape, replayed.stride(), replayed.dtype) == (
                original.shape, original.stride(), original.dtype
            )  # fmt: skip
    out, replayed_out = func(*args, **kwargs), _operator(name)(*replayed_args, **replayed_kwargs)
    assert (replayed_out.shape, replayed_out.dtype) == (out.shape, out.dtype)
    assert time_signature(signature) > 0


def test_calls_that_cannot_be_replayed():
    x = torch.randn(4)
    assert op_signature(aten.normal.Tensor_float, (x,), {"generator": torch.Generator()}) is None
    # Arguments that no made-up data makes valid: timed as nothing, priced by the roofline.
    assert time_signature(op_signature(aten.narrow_copy.default, (x, 0, 3, 5), {})) is None


def _machine(**changes) -> MachineModel:
    link = Link(1e9, 1e-6)
    values = dict(name="hand", peak_flops=1e12, peak_flops_fp32=1e12, gemm_efficiency=1.0, attention_efficiency=1.0,
                  memory_bandwidth=1e11, kernel_floor=0.0, ranks_per_node=1, devices_per_package=1, package=link,
                  node=link, network=link, nics_per_node=1, host_op=1e-6)  # fmt: skip
    return MachineModel(**{**values, **changes})


def test_a_timed_operator_takes_its_measured_time():
    func, args, kwargs = _calls()[0]
    signature = op_signature(func, args, kwargs)
    roofline = 2e9 / 1e12 + 1e-6  # 2 GFLOP at 1 TFLOP/s, plus the host's time per operator
    assert op_time(_machine(), "mm", 2e9, 0, False, signature) == pytest.approx(roofline)
    assert op_time(_machine(op_seconds={signature: 0.25}), "mm", 2e9, 0, False, signature) == 0.25
    assert op_time(_machine(op_seconds={signature: 0.25}), "mm", 2e9, 0, False, None) == pytest.approx(roofline)


def test_traced_signatures_are_distinct_and_skip_views():
    embed = [["mem", 0, 8, False, "a", 2], ["view", 0, 0, False, None, 3]]
    head = [["mm", 4, 8, False, "b", 1], ["mem", 0, 8, False, "a", 1]]
    events = [
        {"e": "ops", "where": "embed", "bw": False, "ops": embed},
        {"e": "comm", "id": 0},
        {"e": "ops", "where": "head", "bw": False, "ops": head},
    ]
    assert traced_signatures({0: {"events": events}, 1: {"events": events[2:]}}) == ["a", "b"]


def test_every_rank_times_the_traced_operators():
    # Two ranks' processes time the trace's two kernels at once; a call no made-up input makes valid keeps
    # the roofline, and the machine's sources say so.
    x = torch.randn(64, 32)
    mm = op_signature(aten.mm.default, (x, x.t()), {})
    bad = op_signature(aten.narrow_copy.default, (x, 0, 60, 10), {})
    ops = [["mm", 2 * 64 * 32 * 64, 0, False, mm, 3], ["mem", 0, 8, False, bad, 1], ["view", 0, 0, False, None, 2]]
    trace = {"events": [{"e": "ops", "where": "layers.0", "bw": False, "ops": ops}]}
    timed = with_timed_ops(_machine(op_threads=1, ranks_per_node=2), {0: trace})
    assert set(timed.op_seconds) == {mm} and timed.op_seconds[mm] > 0
    assert (
        "1 distinct operators of the traced step timed here by 2 process(es) at once, 1 not"
        in (timed.sources["operators"])
    )
    assert with_timed_ops(_machine(), {0: trace}).op_seconds == {}  # a machine that prices by the roofline
