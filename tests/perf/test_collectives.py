"""The vendor libraries' collective algorithms (optimus.perf.collectives) against costs worked by hand: NCCL's
tree and ring all-reduce and the size where it switches, PAT at one rank per node (NCCL's, not RCCL's default),
oneCCL's hierarchical all-reduce, an all-to-all's rounds and per-destination messages, and which library each
machine recipe's ranks use."""

import pytest

from optimus.perf.collectives import all_to_all_rounds, library_of
from optimus.perf.costs import collective_cost
from optimus.perf.machine import Link, MachineModel, machine_model
from optimus.recipes import load_config

GB, US = 1e9, 1e-6


def machine(library: str, node_gbs: float = 10) -> MachineModel:
    """4 devices per node, 2 per package; packages 100 GB/s and 1 us, the node 10 GB/s and 5 us, 2 NICs of 25 GB/s
    and 10 us per network step."""
    return MachineModel(
        name="hand", peak_flops=1e12, peak_flops_fp32=0.5e12, gemm_efficiency=1.0, attention_efficiency=1.0,
        memory_bandwidth=100 * GB, kernel_floor=0.0, ranks_per_node=4, devices_per_package=2,
        package=Link(100 * GB, 1 * US), node=Link(node_gbs * GB, 5 * US), network=Link(25 * GB, 10 * US),
        nics_per_node=2, library=library,
    )  # fmt: skip


def cost(library: str, op: str, ranks: list[int], size: float, node_gbs: float = 10) -> tuple[str, float]:
    call = {"op": op, "ranks": ranks, "bytes": size}
    algorithm, seconds = collective_cost(machine(library, node_gbs), call, ranks[0])
    return algorithm, pytest.approx(seconds, rel=1e-9)


def test_nccl_all_reduce_takes_the_tree_for_small_buffers_and_the_ring_for_large():
    # 64 nodes x 4 ranks. A flat algorithm's bandwidth: the group's NIC share (2 x 25 GB/s x 4 / 4) capped by the
    # node link it also crosses, 10 GB/s. Ring: 2 x 255 steps, 2 x 63 of them across nodes.
    ranks = list(range(256))
    ring_latency = (510 - 126) * 5 * US + 126 * 10 * US
    tree_latency = 2 * (3 * 5 * US + 6 * 10 * US)  # a chain of 4 inside the node, log2(64) levels across
    small, large = 1e6, 1e10
    assert cost("nccl", "all_reduce", ranks, small) == ("tree", pytest.approx(2 * small / (10 * GB) + tree_latency))
    assert cost("nccl", "all_reduce", ranks, large) == (
        "ring",
        pytest.approx(2 * 255 / 256 * large / (10 * GB) + ring_latency),
    )
    assert cost("ring", "all_reduce", ranks, small)[0] == "ring"  # gloo has no tree


def test_pat_at_one_rank_per_node():
    # 64 ranks, one per node: each gets 2 x 25 GB/s / 4 of its node's NICs; every ring step crosses nodes.
    ranks = list(range(0, 256, 4))
    share = 2 * 25 * GB / 4
    shard = 1e3  # an all-gather's record is this rank's shard
    ring = 63 * shard / share + 63 * 10 * US
    pat = 64 * shard / (0.75 * share) + 6 * 10 * US / 3.5 + 64 * 2.8 * US  # NCCL: the whole buffer, 64 shards
    assert cost("nccl", "all_gather", ranks, shard) == ("pat", pytest.approx(pat))
    assert cost("rccl", "all_gather", ranks, shard) == ("ring", pytest.approx(ring))  # RCCL: PAT off by default
    big = 1e6  # bandwidth-bound: PAT's 0.75 of the ring's bandwidth loses
    assert cost("nccl", "all_gather", ranks, big)[0] == "ring"
    two_per_node = [r for node in range(0, 256, 4) for r in (node, node + 1)]
    assert cost("nccl", "reduce_scatter", two_per_node, shard)[0] == "ring"  # PAT needs one rank per node
    # 48 nodes: log2 rounded down, as NCCL's log2i does (5 levels, not 6).
    ranks_48 = list(range(0, 192, 4))
    pat_48 = 48 * shard / (0.75 * share) + 5 * 10 * US / 3.5 + 48 * 2.8 * US
    assert cost("nccl", "all_gather", ranks_48, shard) == ("pat", pytest.approx(pat_48))
    tree_48 = 2 * 1e3 / (10 * GB) + 2 * (3 * 5 * US + 5 * 10 * US)
    assert cost("nccl", "all_reduce", list(range(192)), 1e3) == ("tree", pytest.approx(tree_48))


def test_oneccl_all_reduce_is_hierarchical():
    # 4 nodes x 4 ranks, 1 GB: a reduce-scatter over the node link, an all-reduce of a quarter across the nodes
    # at each rank's share of the NICs (2 x 25 / 4 GB/s), an all-gather of that quarter over the node link.
    ranks, size = list(range(16)), 1e9
    inside = 3 / 4 * size / (10 * GB) + 3 * 5 * US
    across = 2 * 3 / 4 * (size / 4) / (12.5 * GB) + 2 * 3 * 10 * US
    gather = 3 * (size / 4) / (10 * GB) + 3 * 5 * US
    assert cost("oneccl", "all_reduce", ranks, size) == ("hierarchical", pytest.approx(inside + across + gather))
    flat = 2 * 15 / 16 * size / (10 * GB) + (30 - 6) * 5 * US + 6 * 10 * US
    assert cost("ring", "all_reduce", ranks, size) == ("ring", pytest.approx(flat))
    # All-gather of a 1 MB shard: across the nodes among the ranks of one place (3 shards at 12.5 GB/s), then
    # inside the node the 4 nodes' shards of the 3 others (3 x 4 MB at 10 GB/s).
    shard = 1e6
    across_ag = 3 * shard / (12.5 * GB) + 3 * 10 * US
    inside_ag = 3 * 4 * shard / (10 * GB) + 3 * 5 * US
    assert cost("oneccl", "all_gather", ranks, shard) == ("hierarchical", pytest.approx(across_ag + inside_ag))
    # Reduce-scatter of 1 GB: inside the node to a quarter each, then that quarter across the nodes.
    across_rs = 3 / 4 * (size / 4) / (12.5 * GB) + 3 * 10 * US
    assert cost("oneccl", "reduce_scatter", ranks, size) == ("hierarchical", pytest.approx(inside + across_rs))
    # Inside one node there is no scale-out phase: the hierarchy is one ring.
    assert cost("oneccl", "all_reduce", [0, 1, 2, 3], size)[1] == cost("ring", "all_reduce", [0, 1, 2, 3], size)[1]


@pytest.mark.parametrize(
    "overrides, library",
    [(["machine=aurora"], "oneccl"), (["machine=frontier"], "rccl"), (["machine=nvidia"], "nccl"),
     (["machine=nvidia", "machine.backend=gloo"], "ring"), ([], "ring")],
)  # fmt: skip
def test_each_machine_uses_its_library(overrides, library):
    cfg = load_config(overrides).machine
    assert library_of(cfg.device, cfg.backend) == library
    if cfg.name != "local":
        assert machine_model(load_config([*overrides, "machine.peak_flops=1e15"]).machine).library == library


def test_a_group_spread_unevenly_over_its_nodes():
    # Ranks 0, 1, 2 on node 0 and rank 4 alone on node 1, with a 100 GB/s node link: the lone rank's share of its
    # node's NICs (2 x 25 / 4 = 12.5 GB/s, not node 0's 37.5) paces a flat ring, and oneCCL's hierarchy, whose
    # phases assume as many ranks on every node, is priced as that ring. Its 3 steps as NCCL counts them: m - 1 = 1
    # across nodes, 2 inside.
    ranks, size = [0, 1, 2, 4], 1e9
    flat = 3 / 4 * size / (12.5 * GB) + 2 * 5 * US + 1 * 10 * US
    assert cost("ring", "reduce_scatter", ranks, size, node_gbs=100) == ("ring", pytest.approx(flat))
    assert cost("oneccl", "reduce_scatter", ranks, size, node_gbs=100)[1] == pytest.approx(flat)


def all_to_all(library: str, send: list[int], recv: list[int], row_bytes: float = 1e6) -> float:
    """Rank 0's all-to-all over ranks 0-15 (4 nodes of 4) sending and receiving these rows per peer."""
    call = {"op": "all_to_all", "ranks": list(range(16)), "bytes": sum(send) * row_bytes,
            "splits": {"send": send, "recv": recv}}  # fmt: skip
    algorithm, seconds = collective_cost(machine(library), call, 0)
    assert algorithm == "direct"
    return seconds


def test_all_to_all_rounds_by_library():
    assert all_to_all_rounds("nccl", 20) == [list(range(1, 9)), list(range(9, 17)), [17, 18, 19]]
    assert all_to_all_rounds("rccl", 9) == [list(range(1, 9))]
    assert all_to_all_rounds("ring", 5) == all_to_all_rounds("oneccl", 5) == [[1, 2, 3, 4]]
    assert all_to_all_rounds("nccl", 1) == []


def test_all_to_all_in_nccl_batches_of_eight_rounds():
    # One row of 1 MB to and from every peer. Round i sends to rank i and receives from rank 16 - i. Off the node
    # a rank gets its share of the NICs, 2 x 25 GB/s / 4 = 12.5 GB/s.
    m, ones = 1e6, [1] * 16
    package, node = 1 * US + m / (100 * GB), 5 * US + 2 * m / (10 * GB)
    # Rounds 1-8: sends to 1 (package), 2-3 (node), 4-8 (network); receives from 15-8, all off the node.
    first = max(package, node, 10 * US + 8 * m / (12.5 * GB))
    # Rounds 9-15: sends to 9-15 (network); receives from 7-4 (network), 3-2 (node) and 1 (package).
    second = max(package, node, 10 * US + 7 * m / (12.5 * GB))
    assert all_to_all("nccl", ones, ones) == pytest.approx(first + second)
    assert all_to_all("rccl", ones, ones) == pytest.approx(first + second)
    # gloo (and oneCCL) post every round at once: one latency, 12 messages each way off the node.
    at_once = max(package, node, 10 * US + 12 * m / (12.5 * GB))
    assert all_to_all("ring", ones, ones) == all_to_all("oneccl", ones, ones) == pytest.approx(at_once)


def test_all_to_all_per_destination_messages():
    # Small messages are latency-bound: 1 byte to every peer costs NCCL a network latency per batch of rounds
    # (the batches' bytes off the node: 8 received in the first, 7 sent in the second).
    ones = [1] * 16
    assert all_to_all("nccl", ones, ones, row_bytes=1) == pytest.approx(2 * 10 * US + 15 / (12.5 * GB))
    # A rank that receives more than it sends (a busy expert's) is paced by what it receives: 10 rows from rank
    # 15 in round 1, nothing sent off the node in that batch.
    send = [0, 1, 1, 1] + [0] * 12
    recv = [0] * 15 + [10]
    expected = max(1 * US + 1e6 / (100 * GB), 5 * US + 2e6 / (10 * GB), 10 * US + 10e6 / (12.5 * GB))
    assert all_to_all("nccl", send, recv) == pytest.approx(expected)
    # Messages of no rows are not sent: nothing leaves the node, so no network latency. The sends to ranks 1-3
    # are rounds 1-3 (the first batch), the receives from them rounds 13-15 (the second).
    inside = [0, 1, 1, 1] + [0] * 12
    assert all_to_all("nccl", inside, inside) == pytest.approx(2 * (5 * US + 2e6 / (10 * GB)))
    assert all_to_all("ring", inside, inside) == pytest.approx(5 * US + 2e6 / (10 * GB))
