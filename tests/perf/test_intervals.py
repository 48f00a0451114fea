"""The prediction's interval (machine.perf.ranges): the machine at the two ends of its ranges against values
worked by hand on a two-number toy machine, the bounds checked against machines drawn inside the ranges on a
traced step, and the refusal of ranges that do not make sense."""

from __future__ import annotations

import random

import pytest

from optimus.config import RANGED_PERF_KEYS, ConfigError
from optimus.perf.machine import (
    _MODEL_NUMBER,
    FASTER_WHEN_HIGHER,
    SLOWER_WHEN_HIGHER,
    Link,
    MachineModel,
    machine_model,
)
from optimus.perf.predict import prediction_of, trace_step
from optimus.perf.replay import Stream
from optimus.recipes import load_config
from tests.conftest import TINY_MODEL

GB = 1e9


def toy(**ranges) -> MachineModel:
    """1 TFLOP/s peak, 100 GB/s memory, one device; only the numbers in `ranges` are uncertain."""
    link = Link(10 * GB, 1e-6)
    return MachineModel(
        name="toy", peak_flops=1e12, peak_flops_fp32=0.5e12, gemm_efficiency=0.5, attention_efficiency=0.5,
        memory_bandwidth=100 * GB, kernel_floor=0.0, ranks_per_node=1, devices_per_package=1, package=link,
        node=link, network=link, nics_per_node=1, ranges=ranges,
    )  # fmt: skip


def test_the_two_ends_of_a_two_number_toy_machine():
    # A 1 GFLOP matrix product (compute-bound) then a 1 GB elementwise kernel (bytes-bound), in series.
    machine = toy(gemm_efficiency=(0.25, 0.8), memory_bandwidth=(50 * GB, 200 * GB))
    events = [{"e": "ops", "where": "layers.0", "bw": False,
               "ops": [["mm", 10**9, 0, False, None, 1], ["mem", 0, 10**9, False, None, 1]]}]  # fmt: skip

    def step(m: MachineModel) -> float:
        stream = Stream(m, rank=0).run(events)
        stream.drain()
        return stream.t

    assert step(machine) == pytest.approx(1e9 / (1e12 * 0.5) + 1e9 / (100 * GB))  # 2 ms + 10 ms
    assert step(machine.at_end("fast")) == pytest.approx(1e9 / (1e12 * 0.8) + 1e9 / (200 * GB))  # 1.25 + 5 ms
    assert step(machine.at_end("slow")) == pytest.approx(1e9 / (1e12 * 0.25) + 1e9 / (50 * GB))  # 4 + 20 ms
    assert machine.at_end("fast").ranges == {}
    # Latencies and the kernel floor are slow at their high end.
    latent = toy(kernel_floor=(1e-6, 9e-6), **{"node.latency": (1e-6, 30e-6)})
    assert latent.at_end("fast").kernel_floor == 1e-6 and latent.at_end("slow").kernel_floor == 9e-6
    assert latent.at_end("fast").node.latency == 1e-6 and latent.at_end("slow").node.latency == 30e-6
    assert latent.at_end("slow").node.bandwidth == 10 * GB  # unranged: as it was


def test_every_ranged_number_has_a_direction():
    names = {name for name, _ in _MODEL_NUMBER.values()}
    assert set(_MODEL_NUMBER) == set(RANGED_PERF_KEYS)
    assert names == set(FASTER_WHEN_HIGHER) | set(SLOWER_WHEN_HIGHER)
    assert not set(FASTER_WHEN_HIGHER) & set(SLOWER_WHEN_HIGHER)


@pytest.mark.parametrize("machine", ["frontier", "aurora", "nvidia"])
def test_every_cluster_number_has_a_range_that_holds_it(machine):
    cfg = load_config([f"machine={machine}"])
    perf = cfg.machine.perf
    for key in RANGED_PERF_KEYS:
        value = getattr(perf, key)
        stands_in = key == "attention_efficiency" or key.startswith("package") and perf.package_gbs is None
        spec_peak = key == "peak_flops_fp32"  # a spec: what a kernel reaches of it is the efficiency's range
        if value is not None and not stands_in and not spec_peak:
            low, high = perf.ranges[key]
            assert low <= value <= high, key


def test_a_machine_without_a_network_predicts_one_node_only():
    """A machine measured on one node (a calibration) has no NIC numbers: its model serves a world that fits on
    the node, whose ranks send nothing over a network, and refuses a larger one naming what is missing."""
    no_nic = ["machine=frontier", "machine.perf.nic_gbs=null", "machine.perf.network_latency_us=null",
              "machine.perf.nics_per_node=null", "~machine.perf.ranges.nic_gbs",
              "~machine.perf.ranges.network_latency_us"]  # fmt: skip
    cfg = load_config(no_nic)
    model = machine_model(cfg.machine, cfg.machine.ranks_per_node)
    assert model.network == model.node and model.nics_per_node == 1
    with pytest.raises(ConfigError, match=r"machine.perf.nic_gbs, machine.perf.nics_per_node, machine.perf.network"):
        machine_model(cfg.machine, cfg.machine.ranks_per_node + 1)


def _traced_small_step(pp: int):
    overrides = [*TINY_MODEL, "machine=frontier", "train.seq_len=32", "train.global_batch=32",
                 "train.micro_batch=2", "parallel.ep=4", f"parallel.pp={pp}"]  # fmt: skip
    cfg = load_config(overrides)
    return cfg, trace_step(cfg, 16, progress="none")


@pytest.mark.parametrize("pp", [1, 2])
def test_the_interval_holds_every_machine_inside_the_ranges(pp):
    # Frontier at 2 nodes (16 ranks: every link class), without and with a pipeline; the point and 12 machines
    # drawn inside the box of ranges all lie within the two ends. Without a pipeline the replay's monotonicity
    # in each number says they must; with one, on this layout, the stages composed from per-layer means are too.
    cfg, traces = _traced_small_step(pp)
    machine = machine_model(cfg.machine, 16)
    pred = prediction_of(cfg, 16, machine, traces)
    fast, slow = pred.step_time_s_range
    assert fast < pred.step_time_s < slow
    tokens = 32 * 32
    assert pred.tokens_per_s_range == pytest.approx([tokens / slow, tokens / fast])
    assert pred.mfu_range == pytest.approx([pred.mfu * pred.step_time_s / slow, pred.mfu * pred.step_time_s / fast])
    draw = random.Random(5)
    for _ in range(12):
        inside = {name: (v, v) for name, (lo, hi) in machine.ranges.items() for v in [draw.uniform(lo, hi)]}
        drawn = MachineModel(**{**vars(machine), "ranges": inside}).at_end("fast")
        step = prediction_of(cfg, 16, drawn, traces).step_time_s
        assert fast * (1 - 1e-9) <= step <= slow * (1 + 1e-9)


@pytest.mark.parametrize(
    "override, words",
    [
        ("machine.perf.ranges.gemm_efficiency=[0.7,0.9]", "lies outside its range"),
        ("machine.perf.ranges.gemm_efficiency=[0.5,1.2]", "within (0, 1]"),
        ("machine.perf.ranges.node_gbs=[100,50]", "0 < low <= high"),
        ("machine.perf.ranges.node_gbs=[100]", "[low, high]"),
        ("+machine.perf.ranges.nics_per_node=[4,8]", "has no range"),
        ("machine.perf.ranges.node_gbs=[true,100]", "[low, high]"),
        ("machine.perf.attention_efficiency=null +machine.perf.ranges.attention_efficiency=[0.1,0.2]", "null"),
        ("machine=nvidia +machine.perf.ranges.package_latency_us=[30,40]", "without machine.perf.package_gbs"),
        ("machine.perf.peak_flops_fp32=null +machine.perf.ranges.peak_flops_fp32=[1e13,5e13]", "a quarter of"),
        ("machine=local +machine.perf.ranges.gemm_efficiency=[0.1,0.2]", "machine=local measures its numbers"),
        ("machine.perf.ranges.rank_variability=[0.005,1.5]", "keep it below 1"),
        ("machine.perf.rank_variability=1.5", "a fraction of a rank's step time"),
    ],
)
def test_ranges_that_make_no_sense_are_refused(capsys, override, words):
    from optimus.cli import main

    assert main(["plan", "machine=frontier", *override.split()]) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err, err


def test_the_same_work_per_rank_costs_the_same_compute_at_any_world_size():
    # Weak scaling of a pipelined MoE layout (pp 2, ep 4) from 2 to 4 of frontier's nodes: each rank runs the
    # same micro-batches through the same stage, so its compute and its pipeline bubble are the same; only the
    # data-parallel reductions (and the optimizer's shard) change. On the CPU build's trace the Aurora
    # 220B-A10B's compute + bubble was 3.84 s at 32 nodes and 3.61 s at 128 (benchmarks/results/predict.md,
    # "Anomalies explained"); on the device path it is the same at every size, as here.
    splits = {}
    for world, batch in ((16, 32), (32, 64)):
        overrides = [*TINY_MODEL, "machine=frontier", "train.seq_len=32", f"train.global_batch={batch}",
                     "train.micro_batch=2", "parallel.ep=4", "parallel.pp=2"]  # fmt: skip
        cfg = load_config(overrides)
        splits[world] = prediction_of(
            cfg, world, machine_model(cfg.machine, world), trace_step(cfg, world, progress="none")
        ).time_split
    for part in ("compute", "pipeline_bubble", "exposed_expert_exchange"):
        assert splits[16].get(part, 0) == pytest.approx(splits[32].get(part, 0), rel=1e-9), part
    assert splits[32]["exposed_data_parallel"] > splits[16]["exposed_data_parallel"]
