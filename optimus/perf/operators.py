"""Which kernels a step contains: every operator it dispatches that runs a kernel, counted by name.

A dry run's rank file holds this summary under `operators` (optimus.dry_run), so that a reader, and a test, can
see the step the traced device runs: `aten._grouped_mm` or `optimus.triton_swiglu_mlp` for the experts, the
device's fused attention, `c10d.reduce_scatter_tensor_` for the sharded optimizer - and none of a CPU's schedules
(which show as their own operators: per-expert `aten.mm` loops, `aten._sparse_mm` for the CSR combine,
`aten.bmm` over padded experts, `c10d.alltoall_base_` for gloo's reduce-scatter).
"""

from __future__ import annotations

from optimus.kernels.torch_private import TorchDispatchMode
from optimus.perf.step_trace import launches_kernel, op_cost


def operator_name(func) -> str:
    """`namespace.name` of an operator, overload dropped: `aten.mm`, `optimus.triton_swiglu_mlp`, `c10d.send`."""
    return f"{func.namespace}.{func._overloadpacket.__name__}"


class OperatorCounter(TorchDispatchMode):
    """While active: per operator that runs a kernel, its calls, FLOPs (matrix products and attention) and bytes
    read and written (optimus.perf.step_trace.op_cost, the performance model's own pricing)."""

    def __init__(self):
        super().__init__()
        self.operators: dict[str, dict[str, int]] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if launches_kernel(func):
            _, flops, moved, _ = op_cost(func, args, kwargs, out)
            row = self.operators.setdefault(operator_name(func), {"calls": 0, "flops": 0, "bytes": 0})
            row["calls"] += 1
            row["flops"] += flops
            row["bytes"] += moved
        return out

    def summary(self) -> dict[str, dict[str, int]]:
        """The operators by name, most bytes first."""
        return dict(sorted(self.operators.items(), key=lambda item: (-item[1]["bytes"], item[0])))
