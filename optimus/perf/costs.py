"""The time of one operator and of one collective on a machine model.

An operator: a roofline. A matrix product or attention kernel takes the longer of its FLOPs at the peak times
the large-product efficiency and its bytes at the memory bandwidth, so small or skinny products are priced by
the bytes they move; any other kernel takes its bytes at the memory bandwidth. No kernel is shorter than the
machine's kernel floor (launch). Where the host runs in series with the kernels (a CPU), each operator also
costs the host's time per operator. An operator timed on the machine itself (machine=local times every
operator of the traced step, optimus.perf.op_timing) takes its measured time instead, host time included.

A collective: the algorithm the vendor libraries use at large sizes, on the slowest link class its group
spans. Rings for all-reduce, all-gather and reduce-scatter move (n - 1) / n of the buffer per rank (twice for
all-reduce); an all-to-all sends every peer its rows at once; a send is one message. A group that spans nodes
shares the node's NICs with the other groups of the node doing the same collective at the same time (every
data-parallel group of a step reduces at once), so it gets `nics x nic bandwidth x (its members on the node) /
(ranks on the node)`. Latency: the ring's steps for all-gather and reduce-scatter, a tree's for all-reduce
(2 log2 n: the libraries switch to trees where latency dominates), one message for the rest.
"""

from __future__ import annotations

import math
from collections import Counter

from optimus.perf.machine import Link, MachineModel


def op_time(
    machine: MachineModel, kind: str, flops: int, moved: int, fp32: bool, signature: str | None = None
) -> float:
    """Seconds of one operator (kind, FLOPs, bytes and signature as optimus.perf.step_trace records them): its
    time measured on the machine where there is one (machine=local), the roofline otherwise."""
    if kind == "view":
        return machine.host_view
    if signature in machine.op_seconds:
        return machine.op_seconds[signature]
    work = moved / machine.bandwidth_at(moved)
    if kind in ("mm", "attn"):
        peak = machine.peak_flops_fp32 if fp32 else machine.peak_flops
        efficiency = machine.gemm_efficiency if kind == "mm" else machine.attention_efficiency
        work = max(work, flops / (peak * efficiency))
    return max(work, machine.kernel_floor) + machine.host_op


def ops_time(machine: MachineModel, ops: list[list]) -> float:
    """Seconds of a run of operators: [[kind, flops, bytes, fp32, signature, count], ...]."""
    return sum(count * op_time(machine, kind, flops, moved, fp32, sig) for kind, flops, moved, fp32, sig, count in ops)


def _link_between(machine: MachineModel, a: int, b: int) -> str:
    per_node = machine.ranks_per_node
    if a // per_node != b // per_node:
        return "network"
    per_package = machine.devices_per_package
    return "package" if (a % per_node) // per_package == (b % per_node) // per_package else "node"


_ORDER = {"package": 0, "node": 1, "network": 2}


def group_link(machine: MachineModel, ranks: list[int]) -> str:
    """The slowest link class a group's members span."""
    return max((_link_between(machine, ranks[0], r) for r in ranks[1:]), key=_ORDER.__getitem__, default="package")


def effective_link(machine: MachineModel, ranks: list[int]) -> Link:
    """The bandwidth a group's collective gets per rank, and its latency per step."""
    link = group_link(machine, ranks)
    if link != "network":
        return machine.package if link == "package" else machine.node
    per_node = Counter(r // machine.ranks_per_node for r in ranks)
    members_here = max(per_node.values())
    share = machine.nics_per_node * machine.network.bandwidth * members_here / machine.ranks_per_node
    if members_here > 1:  # a ring also crosses the node's own links between its members there
        share = min(share, machine.node.bandwidth)
    return Link(bandwidth=share, latency=machine.network.latency)


def _all_to_all_time(machine: MachineModel, call: dict, rank: int) -> float:
    ranks, send = call["ranks"], call["splits"]["send"]
    rows = sum(send)
    if not rows:
        return 0.0
    row_bytes = call["bytes"] / rows
    by_class = Counter()
    for peer, n in zip(ranks, send):
        if peer != rank:
            by_class[_link_between(machine, rank, peer)] += n * row_bytes
    times = [by_class["package"] / machine.package.bandwidth, by_class["node"] / machine.node.bandwidth]
    if by_class["network"]:
        # Every rank of the node sends its off-node rows through the node's NICs at once.
        node_nics = machine.nics_per_node * machine.network.bandwidth
        times.append(by_class["network"] * machine.ranks_per_node / node_nics)
    latency = effective_link(machine, ranks).latency
    return max(times) + latency


def collective_time(machine: MachineModel, call: dict, rank: int) -> float:
    """Seconds of one collective that `rank` issues (optimus.parallel.collective_trace's record) on `machine`."""
    op, ranks, size = call["op"], call["ranks"], call["bytes"]
    n = len(ranks)
    if n <= 1:
        return 0.0
    if op == "all_to_all":
        return _all_to_all_time(machine, call, rank)
    link = effective_link(machine, ranks)
    bw, lat = link.bandwidth, link.latency
    if op == "all_reduce":
        return 2 * (n - 1) / n * size / bw + 2 * math.ceil(math.log2(n)) * lat
    if op in ("all_gather", "gather"):  # the record's bytes are this rank's shard
        return (n - 1) * size / bw + (n - 1) * lat
    if op in ("reduce_scatter", "scatter"):  # ... the whole buffer
        return (n - 1) / n * size / bw + (n - 1) * lat
    if op in ("send", "recv"):
        return size / bw + lat
    if op in ("broadcast", "reduce"):
        return size / bw + math.ceil(math.log2(n)) * lat
    if op == "barrier":
        return 2 * math.ceil(math.log2(n)) * lat
    raise ValueError(f"no cost model for collective {op!r}")
