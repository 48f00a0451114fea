"""machine=local's table of operators: a traced call's signature runs the same operator again, on tensors of
the same shapes, strides and dtypes, and its measured time replaces the roofline's."""

from __future__ import annotations

import json

import pytest
import torch

from optimus.config_checks import validate_machine_and_data
from optimus.operators import op_signature
from optimus.perf.costs import op_time
from optimus.perf.machine import Link, MachineModel, with_timed_ops
from optimus.perf.op_timing import _decode, _operator, time_signature, traced_signatures
from optimus.recipes import load_config

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


# ---- a GPU's step: traced on the stand-in device, replayed on the device that times it


def test_a_stand_in_step_replays_on_the_device_that_times_it():
    """The cuda path's step, traced on the stand-in device, names its tensors as the accelerator's; replayed on
    this CPU (as `optimus plan --calibrate` replays it on a GPU), every operator but the GPU-only attention
    kernels runs and is timed."""
    from optimus.dry_run import dry_run_rank
    from optimus.perf.op_timing import time_signatures
    from optimus.perf.step_trace import StepTrace

    cfg = load_config(["model=tiny", "machine=nvidia", "kernels=torch"])
    trace = dry_run_rank(cfg, 1, 0, 1.0, "cuda", step_trace=StepTrace(signatures=True))
    kernels = [op for e in trace["events"] if e["e"] == "ops" for op in e["ops"] if op[0] != "view"]
    assert kernels and all(op[4] is not None for op in kernels)  # every kernel of the device's step described
    signatures = traced_signatures({0: trace})
    assert all('{"t":' not in sig for sig in signatures if "_grouped_mm" in sig)  # its tensors: the device's
    names = {json.loads(sig)[0] for sig in signatures}
    assert {"aten._grouped_mm.default", "aten.index_add_.default"} <= names  # the GPU's expert path, not the CPU's
    timed = time_signatures(signatures, torch.device("cpu"), rounds=1)
    untimed = {json.loads(sig)[0] for sig in signatures if sig not in timed}
    assert untimed <= {"aten._scaled_dot_product_flash_attention.default",
                       "aten._scaled_dot_product_flash_attention_backward.default"}  # fmt: skip


def _made(func, args, kwargs=None):
    from optimus.perf.op_timing import _made_call

    name, encoded_args, encoded_kwargs = json.loads(op_signature(func, args, kwargs or {}))
    return _made_call(_operator(name), encoded_args, encoded_kwargs, torch.device("cpu"))


def test_values_that_decide_the_work_are_those_of_a_balanced_routing():
    # 10 rows over 4 experts: cumulative ends 2, 5, 7, 10 (floor of 10 x i / 4), for each grouped product.
    offs = torch.zeros(4, dtype=torch.int32)
    args, _ = _made(aten._grouped_mm.default, (torch.randn(10, 8), torch.randn(4, 8, 6), offs))
    assert args[2].tolist() == [2, 5, 7, 10]
    # x^T @ dy by expert (two matrices): the groups split the shared dimension, dy's 10 rows.
    args, _ = _made(aten._grouped_mm.default, (torch.randn(8, 10).t().t(), torch.randn(10, 6), offs))
    assert args[2].tolist() == [2, 5, 7, 10]
    # A scatter's index spreads over the target's rows (3 of them), in element order.
    index = torch.zeros(7, dtype=torch.int64)
    args, _ = _made(aten.index_add_.default, (torch.zeros(3, 4), 0, index, torch.randn(7, 4)))
    assert args[2].tolist() == [0, 1, 2, 0, 1, 2, 0]
    args, _ = _made(aten.index.Tensor, (torch.randn(5, 2), [torch.zeros(6, dtype=torch.int64)]))
    assert args[1][0].tolist() == [0, 1, 2, 3, 4, 0]
    mask = torch.zeros(5, dtype=torch.bool)  # a boolean index keeps its zeros (nothing selected is valid)
    args, _ = _made(aten.index.Tensor, (torch.randn(5, 2), [mask]))
    assert not args[1][0].any()
    # An embedding's lookups spread over its rows, and its gradient's over num_weights.
    args, _ = _made(aten.embedding.default, (torch.randn(5, 2), torch.zeros(7, dtype=torch.int64)))
    assert args[1].tolist() == [0, 1, 2, 3, 4, 0, 1]
    backward = (torch.randn(7, 2), torch.zeros(7, dtype=torch.int64), 3, -1, False)
    args, _ = _made(aten.embedding_dense_backward.default, backward)
    assert args[1].tolist() == [0, 1, 2, 0, 1, 2, 0]
    # An expanded index (one element in memory) cannot hold a spread: it stays zeros, still valid.
    args, _ = _made(aten.index_select.default, (torch.randn(5, 2), 0, torch.zeros(1, dtype=torch.int64).expand(4)))
    assert args[2].tolist() == [0, 0, 0, 0]


def test_the_expert_paths_token_indices_spread_over_the_tokens():
    pytest.importorskip("triton")
    import optimus.kernels.triton_backend  # noqa: F401  (registers the optimus:: operators)

    token_idx = torch.zeros(6, dtype=torch.int64)
    args, _ = _made(torch.ops.optimus.triton_combine.default, (torch.randn(6, 4), token_idx, torch.rand(6), 3,
                                                                  torch.float32))  # fmt: skip
    assert args[1].tolist() == [0, 1, 2, 0, 1, 2]
    order, seg_end = torch.zeros(6, dtype=torch.int64), torch.zeros(3, dtype=torch.int32)
    args, _ = _made(torch.ops.optimus.triton_segment_sum.default, (torch.randn(6, 4), order, seg_end, torch.float32))
    assert args[1].tolist() == list(range(6)) and args[2].tolist() == [2, 4, 6]
    # A weight gradient of two batches of rows: each batch's group ends split its own rows.
    wgrad = (torch.randn(6, 4), torch.randn(6, 5), seg_end, torch.float32, torch.randn(9, 4), torch.randn(9, 5),
             torch.zeros(3, dtype=torch.int32))  # fmt: skip
    args, _ = _made(torch.ops.optimus.triton_grouped_wgrad.default, wgrad)
    assert args[2].tolist() == [2, 4, 6] and args[6].tolist() == [3, 6, 9]


# ---- the file a calibration writes


def test_operator_times_round_trip_into_the_machine(tmp_path):
    from optimus.config import ConfigError
    from optimus.perf.machine import machine_model
    from optimus.perf.op_timing import operator_times_json

    signature = op_signature(*_calls()[0])
    file = tmp_path / "operators.json"
    file.write_text(operator_times_json({signature: 2.5e-4}, {"device": "1 x H200", "date": "2026-11-30"}, 0.1))
    cfg = load_config(["machine=nvidia", "machine.peak_flops=9.89e14", f"machine.perf.operator_times={file}"])
    machine = machine_model(cfg.machine, 8)
    assert machine.op_seconds == {signature: 2.5e-4}
    assert machine.sources["operators"] == f"{file}: 1 operators timed on 1 x H200, 2026-11-30, +-10%"
    assert op_time(machine, "mm", 2e9, 0, False, signature) == 2.5e-4
    # The interval's ends take the times' spread, as every measured number's range.
    assert op_time(machine.at_end("fast"), "mm", 2e9, 0, False, signature) == pytest.approx(2.25e-4)
    assert op_time(machine.at_end("slow"), "mm", 2e9, 0, False, signature) == pytest.approx(2.75e-4)
    for content in ("not json", '{"format": "another"}'):
        file.write_text(content)
        with pytest.raises(ConfigError, match="is not an operators.json of `optimus plan --calibrate`"):
            machine_model(cfg.machine, 8)
    file.unlink()
    with pytest.raises(ConfigError, match=r"operator_times=.* is not a file: run `optimus plan --calibrate"):
        machine_model(cfg.machine, 8)
    with pytest.raises(ConfigError, match="machine=local times the traced step's operators here"):
        validate_machine_and_data(load_config([f"machine.perf.operator_times={file}"]))
