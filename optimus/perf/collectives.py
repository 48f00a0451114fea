"""How the vendor libraries run all-reduce, all-gather and reduce-scatter, and what each algorithm costs.

A collective library picks an algorithm per call from the message size and where the group's ranks sit:

- NCCL (`nccl`, NVIDIA): ring or tree for all-reduce, ring or PAT for all-gather and reduce-scatter; PAT
  (NCCL 2.23 and later) only where the group has one rank per node. NCCL prices every enabled algorithm with
  its own model (src/graph/tuning.cc: a latency plus the bytes over a bandwidth) and runs the cheapest; the
  latencies and bandwidth factors below are that model's.
- RCCL (`rccl`, ROCm): NCCL's algorithms and model, PAT off unless NCCL_PAT_ENABLE=1 (ROCm/rccl#1756).
- oneCCL (`oneccl`, Intel GPUs): a hierarchical algorithm for device buffers (its documentation, "Collective
  Algorithms Selection"): a scale-up phase among the ranks of a node, then a scale-out phase across nodes,
  a ring here (oneCCL's scale-out default is MPI's choice, which is not documented; a ring is the best on
  bandwidth, so another choice could only be faster on latency).
- `ring` (gloo, and any machine whose library is not one of these): a flat ring for every call.

An all-to-all is a point-to-point message to each peer (its rows for that peer, the per-destination message).
Every library orders the peers the same way, round i sending to rank + i and receiving from rank - i, and
differs in how many rounds run at once: NCCL and RCCL run a group's sends and receives in batches of eight
rounds (NCCL_MAX_DEV_WORK_P2P_PER_BATCH, src/enqueue.cc; RCCL keeps the constant), one batch after the other;
gloo posts every send and receive before it waits on any (gloo/alltoallv.cc); oneCCL is taken to do the same
(its `naive` algorithm, the one its documentation describes for scale-out, posts every peer; ASSUMED). A
batch of rounds takes, on each link class it uses, that class's latency plus its bytes over the class's
bandwidth (both directions at once, so the larger of what it sends and receives), the classes at once:
optimus.perf.costs prices the placement.

Costs, per rank, for n ranks on m nodes with k of them on the busiest node, S the buffer (all-gather: n
shards of s), B the bandwidth a flat algorithm gets per rank (optimus.perf.costs.effective_link: the slowest
link the group spans, a node's NICs shared by its ranks), l_in the latency of a step inside a node and l_net
across nodes, log2 rounded down as NCCL's log2i does:

    ring   all-reduce 2 (n-1)/n S / B, all-gather (n-1) s / B, reduce-scatter (n-1)/n S / B; a latency per
           step, each step inside a node at l_in and those that cross nodes at l_net: 2 (n-1) steps of which
           2 (m-1) cross for all-reduce, n-1 of which m-1 cross for the others
    tree   all-reduce only: 2 S / B (NCCL halves a tree's bus bandwidth), latency 2 ((k-1) l_in + log2(m) l_net)
    PAT    all-gather and reduce-scatter at one rank per node: the whole buffer (n s, or S) at 0.75 B, as NCCL
           prices it, latency log2(m) l_net / 3.5 + n x 2.8 us (NCCL's model, linear part included)
    hierarchical  all-reduce: a reduce-scatter inside the node, an all-reduce of S / k across the nodes
           (every rank of the node at once, each with its share of the NICs), an all-gather inside the node;
           all-gather: across the nodes among the ranks of one place in their node ((m-1) s), then inside the
           node (k-1) m s; reduce-scatter: inside the node, then S / k across. Each phase a ring of its own. A
           group spread unevenly over its nodes is priced as a flat ring.
"""

from __future__ import annotations

from dataclasses import dataclass

# Per library, the algorithms it may choose from for each operation (PAT only at one rank per node).
ALGORITHMS = {
    "nccl": {"all_reduce": ("ring", "tree"), "all_gather": ("ring", "pat"), "reduce_scatter": ("ring", "pat")},
    "rccl": {"all_reduce": ("ring", "tree"), "all_gather": ("ring",), "reduce_scatter": ("ring",)},
    "oneccl": {"all_reduce": ("hierarchical",), "all_gather": ("hierarchical",), "reduce_scatter": ("hierarchical",)},
    "ring": {"all_reduce": ("ring",), "all_gather": ("ring",), "reduce_scatter": ("ring",)},
}
# Per library, the rounds of an all-to-all it runs at once (None: every round).
ROUNDS_AT_ONCE = {"nccl": 8, "rccl": 8, "oneccl": None, "ring": None}
PAT_BANDWIDTH_SHARE = 0.75  # NCCL's model: PAT's bus bandwidth is 0.75 of the ring's
PAT_LATENCY_PER_RANK = 2.8e-6  # NCCL's model: seconds per rank, PAT's "still a linear part"
PAT_LOG_LATENCY_SHARE = 1 / 3.5  # NCCL's model: PAT's network latency per log2 step


def library_of(device: str | None, backend: str | None) -> str:
    """The collective library a machine's ranks use: from its device path, gloo wherever it is the backend."""
    if backend == "gloo" or device in (None, "auto", "cpu"):
        return "ring"
    return {"cuda": "nccl", "rocm": "rccl", "xpu": "oneccl"}[device]


@dataclass(frozen=True)
class Placement:
    """Where a group's ranks sit, and the links its algorithms run on."""

    ranks: int  # n
    nodes: int  # m
    per_node: int  # k, the members on the busiest node
    even: bool  # whether every node holds k of them (else oneCCL's hierarchy is priced as a flat ring)
    bandwidth: float  # B: bytes/s per rank of a flat algorithm over the whole group
    inner_bandwidth: float  # bytes/s between the group's members inside one node
    inner_latency: float  # l_in, seconds per step inside a node
    network_latency: float  # l_net, seconds per step across nodes
    nic_share: float  # bytes/s of the node's NICs per rank, every rank of the node sending at once


def all_to_all_rounds(library: str, n: int) -> list[list[int]]:
    """The rounds of an n-rank all-to-all (round i: the peers at offset i, 1 <= i < n) in the batches `library`
    runs one after the other."""
    offsets = list(range(1, n))
    at_once = ROUNDS_AT_ONCE[library] or max(len(offsets), 1)
    return [offsets[start : start + at_once] for start in range(0, len(offsets), at_once)]


def ring_steps(op: str, n: int) -> int:
    """The steps of a ring of n ranks, each a latency: 2 (n - 1) for an all-reduce, n - 1 for the others. (The
    selftest and machine=local fit a link's latency to a measured all-reduce with it.)"""
    return 2 * (n - 1) if op == "all_reduce" else n - 1


def ring(op: str, size: float, p: Placement) -> float:
    """A flat ring. `size`: the buffer (all-reduce, reduce-scatter) or this rank's shard (all-gather)."""
    n = p.ranks
    steps, crossing = ring_steps(op, n), ring_steps(op, p.nodes)  # the steps that cross nodes: as if one per node
    if op == "all_reduce":
        moved = 2 * (n - 1) / n * size
    elif op == "all_gather":
        moved = (n - 1) * size
    else:
        moved = (n - 1) / n * size
    return moved / p.bandwidth + (steps - crossing) * p.inner_latency + crossing * p.network_latency


def _log2_floor(m: int) -> int:
    return m.bit_length() - 1  # NCCL's log2i


def tree(op: str, size: float, p: Placement) -> float | None:
    """NCCL's double binary tree across nodes, a chain inside each: all-reduce only."""
    if op != "all_reduce":
        return None
    latency = 2 * ((p.per_node - 1) * p.inner_latency + _log2_floor(p.nodes) * p.network_latency)
    return 2 * size / p.bandwidth + latency


def pat(op: str, size: float, p: Placement) -> float | None:
    """NCCL's PAT: all-gather and reduce-scatter of a group with one rank per node, across nodes."""
    if op == "all_reduce" or p.per_node != 1 or p.nodes < 2:
        return None
    n = p.ranks
    whole = n * size if op == "all_gather" else size  # NCCL prices a non-ring algorithm on the whole buffer
    latency = _log2_floor(p.nodes) * p.network_latency * PAT_LOG_LATENCY_SHARE + n * PAT_LATENCY_PER_RANK
    return whole / (PAT_BANDWIDTH_SHARE * p.bandwidth) + latency


def hierarchical(op: str, size: float, p: Placement) -> float:
    """oneCCL's scale-up phase inside each node and scale-out phase across nodes, each a ring."""
    k, m = p.per_node, p.nodes
    if m == 1 or k == 1 or not p.even:
        return ring(op, size, p)
    inside = Placement(k, 1, k, True, p.inner_bandwidth, p.inner_bandwidth, p.inner_latency, p.network_latency, 0.0)
    across = Placement(m, m, 1, True, p.nic_share, p.nic_share, p.network_latency, p.network_latency, p.nic_share)
    if op == "all_reduce":  # reduce-scatter inside, all-reduce of the node's 1/k across, all-gather inside
        return (
            ring("reduce_scatter", size, inside)
            + ring("all_reduce", size / k, across)
            + ring("all_gather", size / k, inside)
        )
    if op == "all_gather":  # across: each rank gathers its peers' shards on other nodes; inside: m shards each
        return ring("all_gather", size, across) + ring("all_gather", m * size, inside)
    return ring("reduce_scatter", size, inside) + ring("reduce_scatter", size / k, across)


_COST = {"ring": ring, "tree": tree, "pat": pat, "hierarchical": hierarchical}


def chosen(library: str, op: str, size: float, p: Placement) -> tuple[str, float]:
    """(algorithm, seconds): the cheapest of those `library` may run for `op` that apply to this placement, as
    NCCL's and RCCL's tuners choose; oneCCL and a ring have one each."""
    times = {name: _COST[name](op, size, p) for name in ALGORITHMS[library][op]}
    return min(((name, t) for name, t in times.items() if t is not None), key=lambda item: item[1])
