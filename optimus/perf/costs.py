"""The time of one operator and of one collective on a machine model.

An operator: a roofline. A matrix product or attention kernel takes the longer of its FLOPs at the peak times
the large-product efficiency and its bytes at the memory bandwidth, so small or skinny products are priced by
the bytes they move; any other kernel takes its bytes at the memory bandwidth. No kernel is shorter than the
machine's kernel floor (launch). Where the host runs in series with the kernels (a CPU), each operator also
costs the host's time per operator. An operator timed on the machine itself (machine=local times every
operator of the traced step, optimus.perf.op_timing) takes its measured time instead, host time included.

A collective: all-reduce, all-gather and reduce-scatter as the machine's library runs them
(optimus.perf.collectives: NCCL's and RCCL's ring, tree and PAT, oneCCL's hierarchical phases, gloo's
ring), on the links the group's placement gives. A group that spans nodes shares the node's NICs with the
other groups of the node doing the same collective at the same time (every data-parallel group of a step
reduces at once), so it gets `nics x nic bandwidth x (its members on the node) / (ranks on the node)`. An
all-to-all: a message to and from each peer, as many at once as the library runs (collectives.all_to_all_rounds),
each link class at its latency and bandwidth.
"""

from __future__ import annotations

import math
from collections import Counter, defaultdict

from optimus.perf.collectives import Placement, all_to_all_rounds, chosen, ring
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


def _members_by_node(machine: MachineModel, ranks: list[int]) -> list[list[int]]:
    """A group's ranks, by the node they sit on."""
    members = defaultdict(list)
    for r in ranks:
        members[r // machine.ranks_per_node].append(r)
    return list(members.values())


def _flat_link(machine: MachineModel, by_node: list[list[int]]) -> Link:
    """The bandwidth per rank and the latency per step of a flat algorithm over a group (by node)."""
    if len(by_node) == 1:
        return getattr(machine, group_link(machine, by_node[0]))
    # The node with the fewest members paces the ring: its share of the NICs is the smallest.
    fewest = min(len(here) for here in by_node)
    share = machine.nics_per_node * machine.network.bandwidth * fewest / machine.ranks_per_node
    busiest = max(by_node, key=len)
    if len(busiest) > 1:  # a ring also crosses the links between its members inside a node
        share = min(share, getattr(machine, group_link(machine, busiest)).bandwidth)
    return Link(bandwidth=share, latency=machine.network.latency)


def effective_link(machine: MachineModel, ranks: list[int]) -> Link:
    """The bandwidth a group's collective gets per rank, and its latency per step."""
    return _flat_link(machine, _members_by_node(machine, ranks))


def _all_to_all_time(machine: MachineModel, call: dict, rank: int) -> float:
    """A rank's all-to-all: its messages to and from each peer, in the rounds and batches its library runs
    (optimus.perf.collectives.all_to_all_rounds); each batch as long as its slowest link class, each class its
    latency plus the larger of the bytes it sends and receives over its bandwidth; a message of no rows is not
    sent (torch's NCCL path skips them). Off the node, every rank of the node sends through the node's NICs at
    once, so a rank gets its share of them."""
    ranks, splits = call["ranks"], call["splits"]
    rows = sum(splits["send"])
    row_bytes = call["bytes"] / rows if rows else 0.0
    n, me = len(ranks), ranks.index(rank)
    nic_share = machine.nics_per_node * machine.network.bandwidth / machine.ranks_per_node
    bandwidth = {"package": machine.package.bandwidth, "node": machine.node.bandwidth, "network": nic_share}
    total = 0.0
    for batch in all_to_all_rounds(machine.library, n):
        sent, received = Counter(), Counter()
        for offset in batch:
            to, source = (me + offset) % n, (me - offset) % n
            sent[_link_between(machine, rank, ranks[to])] += splits["send"][to] * row_bytes
            received[_link_between(machine, rank, ranks[source])] += splits["recv"][source] * row_bytes
        classes = {link for link in set(sent) | set(received) if sent[link] or received[link]}  # no empty messages
        total += max(
            (getattr(machine, link).latency + max(sent[link], received[link]) / bandwidth[link] for link in classes),
            default=0.0,
        )
    return total


def placement(machine: MachineModel, ranks: list[int]) -> Placement:
    """Where a group's ranks sit (nodes, members on the busiest node) and the links its algorithms run on."""
    by_node = _members_by_node(machine, ranks)
    inner = getattr(machine, max((group_link(machine, here) for here in by_node), key=_ORDER.__getitem__))
    flat = _flat_link(machine, by_node)
    counts = {len(here) for here in by_node}
    return Placement(
        ranks=len(ranks), nodes=len(by_node), per_node=max(counts), even=len(counts) == 1,
        bandwidth=flat.bandwidth, inner_bandwidth=inner.bandwidth, inner_latency=inner.latency,
        network_latency=machine.network.latency if len(by_node) > 1 else flat.latency,
        nic_share=machine.nics_per_node * machine.network.bandwidth / machine.ranks_per_node,
    )  # fmt: skip


def collective_time(machine: MachineModel, call: dict, rank: int) -> float:
    """Seconds of one collective that `rank` issues (optimus.parallel.collective_trace's record) on `machine`."""
    return collective_cost(machine, call, rank)[1]


def collective_cost(machine: MachineModel, call: dict, rank: int) -> tuple[str, float]:
    """(algorithm, seconds) of one collective: for all-reduce, all-gather and reduce-scatter the one the machine's
    library chooses (optimus.perf.collectives), for the rest their one way; on a machine whose ranks wake each
    other on the cores they compute on, each also its wake-up (sync_cost, optimus.perf.rank_sync)."""
    if len(call["ranks"]) <= 1:
        return "none", 0.0
    algorithm, seconds = _transfer(machine, call, rank)
    return algorithm, seconds + machine.sync_cost


def _transfer(machine: MachineModel, call: dict, rank: int) -> tuple[str, float]:
    op, ranks, size = call["op"], call["ranks"], call["bytes"]
    n = len(ranks)
    if op == "all_to_all":
        return "direct", _all_to_all_time(machine, call, rank)
    if op in ("all_reduce", "all_gather", "reduce_scatter"):  # all-gather's bytes are this rank's shard
        return chosen(machine.library, op, size, placement(machine, ranks))
    if op in ("gather", "scatter"):
        return "ring", ring("all_gather" if op == "gather" else "reduce_scatter", size, placement(machine, ranks))
    link = effective_link(machine, ranks)
    bw, lat = link.bandwidth, link.latency
    if op in ("send", "recv"):
        return "direct", size / bw + lat
    if op in ("broadcast", "reduce"):
        return "tree", size / bw + math.ceil(math.log2(n)) * lat
    if op == "barrier":
        return "tree", 2 * math.ceil(math.log2(n)) * lat
    raise ValueError(f"no cost model for collective {op!r}")
