"""Whether a step's gradient buckets are large enough for the machine's links, and the size that would be.

Under ZeRO-2 the backward reduces the gradients in buckets of `optim.bucket_mb` of parameters. Each bucket's
reduce-scatter costs a fixed part (every step of its algorithm pays the link's latency, and a rank that blocks
pays its wake-up) and a part that grows with its bytes. Where the fixed part is a large share of the time, the
reductions are latency-bound: fewer, larger buckets move the same bytes in less time, at the cost of the memory
of the buckets in flight (which `optimus plan` counts).

The share is taken against the same bytes at the rate very large messages reach on the same group (its
placement, the library's choice of algorithm; the slope between two of them): `1 - (bytes / that rate) / time`.
`bucket_advice` reads it off the traced step's own reduce-scatters, the largest of each group (a full bucket),
and names the smallest power of two MiB at which every group's share is at most LATENCY_SHARE_MAX or its
gradients reduce in one bucket: a larger bucket does not change a group's one reduction (so a group that reduces
in one bucket already is left out). `optim.max_collective_numel` caps a bucket's elements whatever
`optim.bucket_mb` says (optimus.optim.memory.bucket_numel), so the advice weighs a size at its capped bytes and
names none above the cap: it says to raise the cap instead.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from optimus.perf.costs import collective_time
from optimus.perf.machine import MachineModel

LATENCY_SHARE_MAX = 0.10  # at most a tenth of a bucket's reduction spent on its fixed part
_RATE_BYTES = 1 << 40  # messages large enough that the library runs its large-message algorithm on them
BUCKET_SIZES_MB = tuple(2**k for k in range(13))  # 1 MiB ... 4 GiB, the sizes the advice names


def latency_share(machine: MachineModel, call: dict, rank: int) -> float:
    """The fraction of one collective's time that is not moving its bytes at the group's large-message rate."""
    seconds = collective_time(machine, call, rank)
    if seconds <= 0.0:
        return 0.0
    large, larger = (collective_time(machine, {**call, "bytes": n}, rank) for n in (_RATE_BYTES, 2 * _RATE_BYTES))
    rate = _RATE_BYTES / (larger - large)  # the slope between two large messages: the fixed part cancels
    return max(0.0, 1.0 - call["bytes"] / rate / seconds)


@dataclass
class BucketAdvice:
    bucket_mb: float  # the layout's optim.bucket_mb
    group_size: int  # ranks of the group with the largest latency share at that size
    latency_share: float  # that group's share at bucket_mb
    # The smallest of BUCKET_SIZES_MB at which every group's share is at most LATENCY_SHARE_MAX or its gradients
    # reduce in one bucket (a larger one changes nothing); None where no size up to the largest gets there
    advised_mb: int | None
    advised_share: float | None  # the largest group share at advised_mb
    cap_mb: float | None = None  # the MiB that optim.max_collective_numel allows a bucket, where that is below the
    # largest of BUCKET_SIZES_MB

    def as_dict(self) -> dict:
        return asdict(self)


@dataclass
class _Group:
    call: dict  # its largest reduce-scatter: a full bucket
    rank: int  # the traced rank that issues it
    total: int  # bytes of all its reduce-scatters: its gradients


def _bucketed_groups(traces: dict[int, dict]) -> list[_Group]:
    """Each group that reduces its gradients in more than one bucket in the traced ranks' backwards."""
    by_group: dict[tuple, list[tuple[dict, int]]] = {}
    for trace in traces.values():
        for e in trace["events"]:
            if e["e"] != "comm" or not e["async"]:
                continue
            call = {**e["call"], "op": e["as"]} if "as" in e else e["call"]
            if call["op"] == "reduce_scatter" and call["phase"].startswith("backward") and len(call["ranks"]) > 1:
                by_group.setdefault((trace["rank"], tuple(call["ranks"])), []).append((call, trace["rank"]))
    return [
        _Group(*max(calls, key=lambda c: c[0]["bytes"]), total=sum(c[0]["bytes"] for c in calls))
        for calls in by_group.values()
        if len(calls) > 1
    ]


def bucket_advice(
    bucket_mb: float, machine: MachineModel, traces: dict[int, dict], cap_mb: float = float("inf")
) -> BucketAdvice | None:
    """The traced step's gradient buckets against the machine's links (module docstring); None where the step
    reduces no gradients in buckets (ZeRO-1, which reduces in the optimizer step, or one bucket per group).
    `cap_mb`: the MiB of parameters that optim.max_collective_numel allows one bucket."""
    groups = _bucketed_groups(traces)
    if not groups:
        return None

    def bucket_bytes(g: _Group, mb: float) -> int:  # the traced bucket was min(bucket_mb, cap_mb) MiB
        return min(int(g.call["bytes"] * min(mb, cap_mb) / min(bucket_mb, cap_mb)), g.total)

    def share(g: _Group, mb: float) -> float:
        return latency_share(machine, {**g.call, "bytes": bucket_bytes(g, mb)}, g.rank)

    def enough(mb: float) -> bool:
        return all(share(g, mb) <= LATENCY_SHARE_MAX or bucket_bytes(g, mb) == g.total for g in groups)

    worst = max(groups, key=lambda g: share(g, bucket_mb))
    advised = next((mb for mb in BUCKET_SIZES_MB if mb <= cap_mb and enough(mb)), None)
    return BucketAdvice(
        bucket_mb=bucket_mb,
        group_size=len(worst.call["ranks"]),
        latency_share=share(worst, bucket_mb),
        advised_mb=advised,
        advised_share=None if advised is None else max(share(g, advised) for g in groups),
        cap_mb=cap_mb if cap_mb < BUCKET_SIZES_MB[-1] else None,
    )


def advice_line(advice: BucketAdvice) -> str:
    """One line for `optimus plan --predict`: the buckets' latency share, and what to set where it is too large."""
    now = (
        f"gradient buckets: optim.bucket_mb={advice.bucket_mb:g}, whose reduce-scatter over {advice.group_size} "
        f"ranks spends {100 * advice.latency_share:.0f}% of its time on the links' fixed costs"
    )
    if advice.latency_share <= LATENCY_SHARE_MAX:
        return f"{now} (bandwidth-bound)"
    if advice.advised_mb is None and advice.cap_mb is not None:
        return (
            f"{now}; optim.max_collective_numel caps a bucket at {advice.cap_mb:g} MiB, and no bucket up to that "
            f"brings it under {LATENCY_SHARE_MAX:.0%}: raise optim.max_collective_numel with optim.bucket_mb"
        )
    if advice.advised_mb is None:
        return f"{now}; no bucket up to {BUCKET_SIZES_MB[-1]} MiB brings that under {LATENCY_SHARE_MAX:.0%}"
    return (
        f"{now}; optim.bucket_mb={advice.advised_mb} would take it to {100 * advice.advised_share:.0f}% "
        f"(each group under {LATENCY_SHARE_MAX:.0%} or in one bucket; check the memory with optimus plan)"
    )
