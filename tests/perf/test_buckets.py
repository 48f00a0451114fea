"""The gradient buckets' latency share and the bucket size that makes them bandwidth-bound (optimus.perf.buckets),
against a ring reduce-scatter worked by hand on a known link."""

import pytest

from optimus.perf.buckets import BucketAdvice, advice_line, bucket_advice, latency_share
from optimus.perf.machine import Link, MachineModel

MiB, US = 2**20, 1e-6


def machine(latency_us: float = 50.0) -> MachineModel:
    """2 devices per package joined by 10 GB/s with `latency_us` per ring step; 4 per node (20 GB/s, 100 us)."""
    return MachineModel(
        name="hand", peak_flops=1e12, peak_flops_fp32=0.5e12, gemm_efficiency=1.0, attention_efficiency=1.0,
        memory_bandwidth=1e11, kernel_floor=0.0, ranks_per_node=4, devices_per_package=2,
        package=Link(10e9, latency_us * US), node=Link(20e9, 100 * US), network=Link(25e9, 10 * US),
        nics_per_node=1, library="ring",
    )  # fmt: skip


def reduce_scatter(ranks: list[int], size: int, phase: str = "backward layers.0") -> dict:
    return {"e": "comm", "id": 0, "async": True, "call": {"op": "reduce_scatter", "phase": phase, "ranks": ranks,
                                                           "bytes": size}}  # fmt: skip


def trace(*events: dict, rank: int = 0) -> dict[int, dict]:
    return {0: {"rank": rank, "events": list(events)}}


def test_latency_share_of_a_ring_reduce_scatter():
    # Two ranks of one package: one ring step of 50 us moving half of the 4 MiB at 10 GB/s.
    size = 4 * MiB
    seconds = size / 2 / 10e9 + 50 * US
    call = {"op": "reduce_scatter", "ranks": [0, 1], "bytes": size}
    assert latency_share(machine(), call, 0) == pytest.approx(50 * US / seconds)
    assert latency_share(machine(latency_us=0.0), call, 0) == pytest.approx(0.0, abs=1e-12)


def test_the_smallest_power_of_two_that_is_bandwidth_bound():
    # Buckets of 1 MiB of bf16 parameters reduce 4 MiB of fp32 gradients. The share is under 10% once the bytes'
    # time, size / 2 / 10 GB/s, is at least 9 x 50 us: size >= 9 MB, a bucket of 9e6 / 4 MiB = 2.15 MiB: 4 MiB
    # (at 2 MiB the share is 50 / (419.4 + 50) = 10.7%). The group's 17 MiB of gradients take more than one.
    events = [reduce_scatter([0, 1], 4 * MiB)] * 4 + [reduce_scatter([0, 1], MiB)]
    advice = bucket_advice(1.0, machine(), trace(*events))
    assert advice.group_size == 2
    assert advice.latency_share == pytest.approx(50 * US / (4 * MiB / 2 / 10e9 + 50 * US))
    assert advice.advised_mb == 4
    assert advice.advised_share == pytest.approx(50 * US / (16 * MiB / 2 / 10e9 + 50 * US))
    assert "optim.bucket_mb=4 would take it to 6%" in advice_line(advice)


def test_a_group_whose_gradients_fit_one_bucket_needs_no_larger_one():
    # 1 ms per ring step: 10% would take 180 MB, but the group's 12 MiB reduce in one bucket from 4 MiB on, where
    # the share is 1 ms / (12 MiB / 2 / 10 GB/s + 1 ms) = 61%: nothing larger helps.
    events = [reduce_scatter([0, 1], 4 * MiB)] * 3
    advice = bucket_advice(1.0, machine(latency_us=1000.0), trace(*events))
    assert advice.advised_mb == 4
    assert advice.advised_share == pytest.approx(1e-3 / (12 * MiB / 2 / 10e9 + 1e-3))
    assert "optim.bucket_mb=4 would take it to 61% (each group under 10% or in one bucket;" in advice_line(advice)


def test_the_worst_group_decides_and_a_group_of_one_bucket_is_left_out():
    # The data-parallel group [0, 1] (one package) and the expert group [0, 2] across packages, on the node link
    # (20 GB/s, 100 us a step): the latter needs bytes / 2 / 20 GB/s >= 900 us, 36 MB: a bucket of 16 MiB
    # (64 MiB of gradients); the first needs 4 MiB (their 20 and 80 MiB of gradients take several buckets at those
    # sizes). A third group reduces all its gradients in one bucket: a larger one would not change it, however
    # latency-bound it is.
    events = [reduce_scatter([0, 1], 4 * MiB)] * 5 + [reduce_scatter([0, 2], 4 * MiB)] * 20
    events.append(reduce_scatter([0, 3], 64))
    advice = bucket_advice(1.0, machine(), trace(*events))
    assert advice.group_size == 2
    assert advice.latency_share == pytest.approx(100 * US / (4 * MiB / 2 / 20e9 + 100 * US))
    assert advice.advised_mb == 16


def test_no_advice_without_bucketed_reductions():
    # ZeRO-1 reduces in the optimizer step, and a synchronous collective or an all-reduce is no bucket.
    optimizer = reduce_scatter([0, 1], 4 * MiB, phase="optimizer")
    sync = {**reduce_scatter([0, 1], 4 * MiB), "async": False}
    assert bucket_advice(1.0, machine(), trace(optimizer, optimizer, sync, sync)) is None


def test_gloo_reduce_scatter_recorded_as_all_to_all_counts_as_one():
    # On gloo, optimus issues the reduce-scatter as an all-to-all; the trace says what it stands for.
    stand_in = {"e": "comm", "id": 1, "async": True, "as": "reduce_scatter",
                "call": {"op": "all_to_all", "phase": "backward", "ranks": [0, 1], "bytes": 4 * MiB}}  # fmt: skip
    advice = bucket_advice(1.0, machine(), trace(*[stand_in] * 5))
    assert advice.advised_mb == 4


def test_lines_for_bandwidth_bound_and_hopeless_buckets():
    fine = BucketAdvice(bucket_mb=64, group_size=8, latency_share=0.04, advised_mb=8, advised_share=0.08)
    assert advice_line(fine).endswith("(bandwidth-bound)")
    hopeless = BucketAdvice(bucket_mb=32, group_size=8, latency_share=0.9, advised_mb=None, advised_share=None)
    assert "no bucket up to 4096 MiB" in advice_line(hopeless)


def test_a_collective_cap_below_the_advice_bounds_it():
    # As test_the_smallest_power_of_two_that_is_bandwidth_bound, with optim.max_collective_numel allowing a bucket
    # 2 MiB of parameters: 4 MiB would be capped to 2 MiB, whose share (10.7%) is above 10%; no size is advised
    # and the line says to raise the cap. At a cap of 3 MiB, the traced 1 MiB buckets still scale to 4 MiB.
    events = [reduce_scatter([0, 1], 4 * MiB)] * 4 + [reduce_scatter([0, 1], MiB)]
    capped = bucket_advice(1.0, machine(), trace(*events), cap_mb=2.0)
    assert capped.advised_mb is None and capped.cap_mb == 2.0
    assert "caps a bucket at 2 MiB" in advice_line(capped) and "raise optim.max_collective_numel" in advice_line(capped)
    assert bucket_advice(1.0, machine(), trace(*events), cap_mb=8.0).advised_mb == 4


def test_buckets_traced_at_the_cap_are_scaled_from_it():
    # optim.bucket_mb=8 under a cap of 2 MiB: the traced buckets are the cap's (4 MiB of gradients each, 19%).
    # Sizes are scaled from the cap: 1 and 2 MiB are the only ones a run would get, and neither is under 10%.
    events = [reduce_scatter([0, 1], 4 * MiB)] * 4 + [reduce_scatter([0, 1], MiB)]
    at_cap = bucket_advice(8.0, machine(), trace(*events), cap_mb=2.0)
    assert at_cap.latency_share == pytest.approx(50 * US / (4 * MiB / 2 / 10e9 + 50 * US))
    assert at_cap.advised_mb is None
    # Read as uncapped 8 MiB buckets, the same trace would have 32 MiB advised (4 MiB x 32 / 8 = 16 MiB of
    # gradients, 5.9%): a size the cap would hold at 2 MiB.
    assert bucket_advice(8.0, machine(), trace(*events)).advised_mb == 32
