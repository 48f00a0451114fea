"""Record every collective a rank issues, in order, and check that the members of each group agree.

Every torch.distributed call, whatever wraps it (the dispatchers, the sharded optimizer, DTensor's
functional collectives, torch's pipeline schedules and their send/recv), reaches the dispatcher as a
`c10d` (or `_c10d_functional`) operator. `CollectiveTrace` is a TorchDispatchMode that sees those operators
as they are issued and writes one record per call:

    {"op": "all_to_all", "group": "3", "ranks": [0, 1], "dtype": "bfloat16", "bytes": 65536,
     "phase": "forward layers.1.ffn", "splits": {"send": [161, 95], "recv": [161, 169]}}

`group` is the process group's name (every rank names a group alike: groups are made in one order on all
ranks); `ranks` are the global ranks of the group (for `send` and `recv`: this rank and its peer, in that order);
`bytes` is the size of this rank's own input (a reduce-scatter's whole buffer, an all-gather's shard);
`splits` (all-to-all with split sizes only) lists the rows sent to and received from each member.
`phase` says where the call was issued: `forward`/`backward` and the innermost module (by its name in the
model) from torch's ModTracker, `backward` in the autograd engine outside any module's hooks (a gradient
hook that fires after its module's backward has ended), or the label of the `phase(...)` block the trainer
opened (`step`, `optimizer`).

The same recorder runs in a real training run (`profile.collectives=true`) and on fake tensors, so two runs
of one layout can be compared call by call. `mismatches(traces)` takes the traces of several ranks and
returns, for each group, the first call on which its members disagree (op, dtype or size): the condition
for a collective to hang or corrupt data at scale.
"""

from __future__ import annotations

import json
from collections import defaultdict
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optimus.kernels.torch_private import (
    TorchDispatchMode,
    current_graph_task_id,
    leaf_safe_mod_tracker,
    resolve_process_group,
)

# c10d operator name -> the name a trace records (the torch.distributed function a reader knows).
_OP_NAMES = {
    "allreduce_": "all_reduce",
    "allreduce_coalesced_": "all_reduce",
    "all_reduce": "all_reduce",
    "all_reduce_coalesced": "all_reduce",
    "_allgather_base_": "all_gather",
    "allgather_": "all_gather",
    "allgather_into_tensor_coalesced_": "all_gather",
    "all_gather_into_tensor": "all_gather",
    "all_gather_into_tensor_coalesced": "all_gather",
    "_reduce_scatter_base_": "reduce_scatter",
    "reduce_scatter_": "reduce_scatter",
    "reduce_scatter_tensor_coalesced_": "reduce_scatter",
    "reduce_scatter_tensor": "reduce_scatter",
    "reduce_scatter_tensor_coalesced": "reduce_scatter",
    "alltoall_base_": "all_to_all",
    "alltoall_": "all_to_all",
    "all_to_all_single": "all_to_all",
    "broadcast_": "broadcast",
    "broadcast": "broadcast",
    "barrier": "barrier",
    "send": "send",
    "recv_": "recv",
    "gather_": "gather",
    "scatter_": "scatter",
    "reduce_": "reduce",
}
# Operators of the functional-collective namespace that move no data of their own.
_NOT_COLLECTIVES = {"wait_tensor", "_wrap_tensor_autograd"}
_NAMESPACES = ("c10d", "_c10d_functional")


def _tensors(value: Any) -> list[torch.Tensor]:
    if isinstance(value, torch.Tensor):
        return [value]
    if isinstance(value, (list, tuple)):
        return [t for item in value for t in _tensors(item)]
    return []


def _named_arguments(func, args: tuple, kwargs: dict) -> dict[str, Any]:
    """The operator's arguments by their schema names (c10d and functional schemas name them differently)."""
    named = {arg.name: value for arg, value in zip(func._schema.arguments, args)}
    named.update(kwargs)
    return named


def _process_group(named: dict[str, Any]) -> dist.ProcessGroup:
    """A c10d operator carries its ProcessGroup boxed; a functional collective carries the group's name."""
    if "process_group" in named:
        return dist.ProcessGroup.unbox(named["process_group"])
    return resolve_process_group(named["group_name"])


# Where each schema keeps this rank's own data (the output of a reduce-scatter or all-gather is derived).
_INPUT_NAMES = ("input", "input_tensor", "inputs", "input_tensors", "tensors", "tensor")


def _record(op: str, named: dict[str, Any], phase: str) -> dict:
    group = _process_group(named)
    members = dist.get_process_group_ranks(group)
    tensors = _tensors(next((named[key] for key in _INPUT_NAMES if key in named), []))
    if op in ("send", "recv"):  # the peer is a group rank; the record names (sender, receiver) globally
        peer = dist.get_global_rank(group, int(named["dst" if op == "send" else "src"]))
        members = [dist.get_rank(), peer] if op == "send" else [peer, dist.get_rank()]
    record = {
        "op": op,
        "group": group.group_name,  # two groups may hold the same ranks (world and EP when dp = 1)
        "ranks": members,
        "dtype": str(tensors[0].dtype).removeprefix("torch.") if tensors else "none",
        "bytes": sum(t.numel() * t.element_size() for t in tensors),
        "phase": phase,
    }
    if op == "all_to_all":
        record["splits"] = _all_to_all_splits(named, tensors[0], len(members))
    return record


def _all_to_all_splits(named: dict[str, Any], input_: torch.Tensor, size: int) -> dict[str, list[int]]:
    """Rows sent to and received from each member ({"send": [...], "recv": [...]}); even splits when unset."""
    send = [int(s) for s in named.get("input_split_sizes") or []]
    recv = [int(s) for s in named.get("output_split_sizes") or []]
    rows = input_.shape[0] if input_.dim() else 0
    return {"send": send or [rows // size] * size, "recv": recv or [rows // size] * size}


class CollectiveTrace(TorchDispatchMode):
    """Records the collectives issued while it is active (`with trace:`), in issue order, into `.calls`."""

    def __init__(self):
        super().__init__()
        self.calls: list[dict] = []
        self._labels: list[str] = []
        self._modules = leaf_safe_mod_tracker()

    def __enter__(self):
        self._modules.__enter__()
        return super().__enter__()

    def __exit__(self, *exc):
        super().__exit__(*exc)
        self._modules.__exit__(*exc)

    @contextmanager
    def phase(self, label: str):
        """Calls issued inside (and outside any module) are recorded with this label."""
        self._labels.append(label)
        try:
            yield
        finally:
            self._labels.pop()

    def _where(self) -> str:
        modules = [name for name in self._modules.parents if name != "Global"]
        if modules:
            # In a backward several modules can be open at once: the deepest, ties broken by name (the tracker's
            # set has no order of its own, and string hashes differ between processes).
            innermost = max(modules, key=lambda name: (name.count("."), name))
            # The tracker names modules from the first root it saw (e.g. `Transformer.layers.1.moe`).
            return ("backward " if self._modules.is_bw else "forward ") + innermost.partition(".")[2]
        if current_graph_task_id() != -1:  # in the autograd engine, between two modules' backward hooks
            return "backward"
        return self._labels[-1] if self._labels else "step"

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            # A mode runs before tensor subclasses and is off while it runs the op: let DTensor turn the op into
            # local ops first, its collectives among them, which then come back here.
            return NotImplemented
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if func.namespace in _NAMESPACES and name not in _NOT_COLLECTIVES:
            named = _named_arguments(func, args, kwargs)
            self.calls.append(_record(_OP_NAMES.get(name, name), named, self._where()))
        return func(*args, **kwargs)


def write_trace(calls: list[dict], path: str | Path) -> None:
    """One JSON list, a call per line (a 12,288-rank group's member list stays on one line)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    body = ",\n".join(json.dumps(call, separators=(",", ":")) for call in calls)
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text("[\n" + body + "\n]\n")
    tmp.replace(path)


def _signature(call: dict) -> tuple:
    """What every member of the group must issue alike for this call."""
    op = call["op"]
    if op in ("send", "recv"):  # a pair's k-th send from A to B is B's k-th recv from A: same dtype and bytes
        return ("p2p", call["dtype"], call["bytes"])
    if op == "all_to_all":  # the sizes differ by rank; `_exchange_agrees` checks them against each other
        return (op, call["dtype"])
    return (op, call["dtype"], call["bytes"])


def _exchange_agrees(calls_by_rank: dict[int, dict], members: tuple[int, ...]) -> bool:
    """An all-to-all is consistent when rank i sends j as many rows as j expects from i, and every rank's
    buffer holds its rows at one row size (bytes / rows sent)."""
    for i, src in enumerate(members):
        for j, dst in enumerate(members):
            if calls_by_rank[src]["splits"]["send"][j] != calls_by_rank[dst]["splits"]["recv"][i]:
                return False
    row_bytes = set()
    for call in calls_by_rank.values():
        rows = sum(call["splits"]["send"])
        if rows == 0:
            if call["bytes"]:
                return False
            continue
        if call["bytes"] % rows:
            return False
        row_bytes.add(call["bytes"] // rows)
    return len(row_bytes) <= 1


def mismatches(traces: dict[int, list[dict]]) -> list[str]:
    """For each group whose members (all of them traced) do not issue the same sequence of collectives on it,
    one line naming the group, the ranks and the first call that differs; [] when every group agrees."""
    by_group: dict[tuple, dict[int, list[dict]]] = defaultdict(lambda: defaultdict(list))
    for rank, calls in traces.items():
        for call in calls:
            by_group[(call["group"], *call["ranks"])][rank].append(call)
    problems = []
    for (_, *members), calls_of in by_group.items():
        members = tuple(members)
        if not set(members) <= traces.keys():
            continue  # a member was not traced: nothing to compare against
        problem = _first_difference(members, {rank: calls_of.get(rank, []) for rank in members})
        if problem:
            problems.append(problem)
    return problems


def _first_difference(members: tuple[int, ...], calls: dict[int, list[dict]]) -> str | None:
    label = f"group {list(members)}" if len(members) <= 16 else f"group of {len(members)} ranks from {members[0]}"
    for index in range(max(len(c) for c in calls.values())):
        at = {rank: c[index] if index < len(c) else None for rank, c in calls.items()}
        missing = [rank for rank, call in at.items() if call is None]
        if missing:
            present = next(call for call in at.values() if call is not None)
            return f"{label}: call {index} ({present['op']} in {present['phase']}) is not issued by ranks {missing}"
        signatures = {rank: _signature(call) for rank, call in at.items()}
        if len(set(signatures.values())) > 1 or (
            at[members[0]]["op"] == "all_to_all" and not _exchange_agrees(at, members)
        ):
            seen = "; ".join(f"rank {r}: {c['op']} {c['dtype']} {c['bytes']} B in {c['phase']}" for r, c in at.items())
            return f"{label}: call {index} differs between ranks ({seen})"
    return None
