"""What a step's operators cost, and which kernels a step contains.

`op_cost` prices one operator call as the performance model does (optimus.perf.step_trace records it for
every operator of a traced step): its kind (a matrix product with its FLOPs, an attention kernel, any other
kernel with the bytes it reads and writes, or no kernel) and whether it multiplies in fp32.

`OperatorCounter` sums them by operator name over a step: a dry run's rank file holds the summary under
`operators` (optimus.dry_run), so that a reader, and a test, can see the step the traced device runs:
`aten._grouped_mm` or `optimus.triton_swiglu_mlp` for the experts, the device's fused attention,
`c10d._reduce_scatter_base_` for the sharded optimizer - and none of a CPU's schedules (which show as their own
operators: the CPU's attention kernel, `aten._sparse_mm` for the CSR combine, `aten.bmm` over padded experts,
`c10d.alltoall_base_` for gloo's reduce-scatter).

`op_signature` writes one call down so that it can be run again (optimus.perf.op_timing replays it; the
step's own timing, optimus.train.operator_times, keys its times by it): the operator, and each argument as JSON,
a tensor as its shape, strides and dtype, on the host (`t`) or on the step's accelerator (`a`).

Apart from the performance model (optimus.perf), which imports it, so that a dry run imports no part of it.
"""

from __future__ import annotations

import functools
import json
import re

import torch
from torch.utils.flop_counter import flop_registry

from optimus.kernels.torch_private import TorchDispatchMode
from optimus.parallel.collective_trace import _named_arguments, _tensors

# Operators that launch no kernel: views and metadata, and allocations whose contents nobody computes.
# `_unsafe_view` is a view whose schema does not say so (reshape's result after a copy; autograd's views).
_NO_KERNEL = {
    "detach", "alias", "lift_fresh", "empty", "empty_strided", "new_empty", "new_empty_strided", "empty_like",
    "_local_scalar_dense", "set_", "resize_", "sym_size", "sym_stride", "sym_numel", "_unsafe_view",
}  # fmt: skip
# Operators that fill a new tensor and read only their tensor argument's shape, dtype and device: they write.
_FILLS_FROM_METADATA = {
    "new_zeros", "new_ones", "new_full", "zeros_like", "ones_like", "full_like", "rand_like", "randn_like",
    "randint_like",
}  # fmt: skip
_ATTENTION = re.compile(r"^_scaled_dot_product_\w*attention")  # q, k, v as [B, H, S, D]


def _nbytes(tensors: list[torch.Tensor]) -> int:
    return sum(t.numel() * t.element_size() for t in tensors)


def attention_flops(q: torch.Tensor, k: torch.Tensor, causal: bool, backward: bool) -> int:
    """FLOPs an attention kernel does for q [B, H, Sq, D] and k [B, Hk, Sk, D]: two products of Sq x Sk x D per
    head forward (scores, then values), five backward (the scores again, and the gradients of q, k, v and the
    probabilities); a causal kernel skips the masked half."""
    b, h, sq, d = q.shape
    sk = k.shape[-2]
    flops = 2 * 2 * b * h * sq * sk * d
    if backward:
        flops = flops * 5 // 2
    return flops // 2 if causal else flops


def _attention_args(func, args: tuple, kwargs: dict) -> tuple[torch.Tensor, torch.Tensor, bool]:
    """(query, key, causal) of an attention kernel or its backward, by the schema's argument names."""
    named = _named_arguments(func, args, kwargs)
    return named["query"], named["key"], bool(named.get("is_causal", False))


def launches_kernel(func) -> bool:
    """Whether an operator runs a kernel: not a view, a metadata query (prim: a tensor's device), a profiler
    range (torch.profiler.record_function's enter and exit) or an allocation whose contents nobody computes."""
    no_kernel = func._overloadpacket.__name__ in _NO_KERNEL or func.namespace in ("prim", "profiler")
    return not (func.is_view or no_kernel)


def op_cost(func, args: tuple, kwargs: dict, out) -> tuple[str, int, int, bool]:
    """(kind, FLOPs, bytes read and written, fp32 matrix product) of one operator call."""
    name = func._overloadpacket.__name__
    if not launches_kernel(func):
        return "view", 0, 0, False
    inputs = _tensors(list(args) + list(kwargs.values())) if name not in _FILLS_FROM_METADATA else []
    written, returned = _written(func, args, kwargs), _tensors([out])
    # An operator that writes an argument in place and returns nothing (a custom operator's mutated argument)
    # reads and writes it, as an in-place aten operator, which returns its `self`, is counted.
    moved = _nbytes(inputs) + _nbytes(returned if returned else written)
    # What an operator writes (an fp32 sum it adds a product into) does not make its products fp32 ones.
    fp32 = any(t.dtype == torch.float32 for t in inputs if not any(t is w for w in written))
    if _ATTENTION.search(name):
        # The query's dtype is the products'. A backward also reads the forward's logsumexp, which is fp32 for
        # bf16 attention too: it does not make the kernel an fp32 one.
        q, k, causal = _attention_args(func, args, kwargs)
        return "attn", attention_flops(q, k, causal, name.endswith("_backward")), moved, q.dtype == torch.float32
    packet = func._overloadpacket
    if packet in flop_registry:
        compute = _named_arguments(func, args, kwargs).get("dtype")  # an operator that casts to its compute dtype
        fp32 = compute == torch.float32 if isinstance(compute, torch.dtype) else fp32
        return "mm", int(flop_registry[packet](*args, **kwargs, out_val=out)), moved, fp32
    if name == "_grouped_mm":  # [M, K] x [G, K, N]: every row meets one group's matrix
        a, b = inputs[0], inputs[1]
        return "mm", 2 * a.shape[0] * a.shape[-1] * b.shape[-1], moved, fp32
    return "mem", 0, moved, False


def _written(func, args: tuple, kwargs: dict) -> list[torch.Tensor]:
    """The tensor arguments an operator writes in place (its schema marks them `Tensor(a!)`)."""
    marked = _written_names(func)
    if not marked:  # most operators: no need to name the arguments
        return []
    named = _named_arguments(func, args, kwargs)
    return _tensors([named.get(name) for name in marked])


@functools.cache
def _written_names(func) -> tuple[str, ...]:
    """The names of the arguments an operator's schema marks written (once per operator: op_cost runs per call)."""
    return tuple(a.name for a in func._schema.arguments if a.alias_info is not None and a.alias_info.is_write)


def operator_name(func) -> str:
    """`namespace.name` of an operator, overload dropped: `aten.mm`, `optimus.triton_swiglu_mlp`, `c10d.send`."""
    return f"{func.namespace}.{func._overloadpacket.__name__}"


class OperatorCounter(TorchDispatchMode):
    """While active: per operator that runs a kernel, its calls, FLOPs (matrix products and attention) and bytes
    read and written (op_cost, the performance model's own pricing)."""

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


# ---- a call written down to be replayed


class _NotReplayable(Exception):
    """An argument a signature cannot describe (see the module's docstring)."""


def _encode(x):
    if isinstance(x, torch.Tensor):
        if x.layout != torch.strided:
            raise _NotReplayable
        where = "t" if x.device.type == "cpu" else "a"
        return {where: [list(x.shape), list(x.stride()), str(x.dtype).removeprefix("torch.")]}
    if isinstance(x, (torch.dtype, torch.memory_format, torch.layout)):
        return {"torch": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        return {"device": "cpu" if x.type == "cpu" else "accelerator"}
    if x is None or isinstance(x, (bool, int, float, str)):
        return x
    if isinstance(x, (list, tuple)):
        return [_encode(item) for item in x]
    raise _NotReplayable  # a generator, a SymInt, an opaque object


def op_signature(func, args: tuple, kwargs: dict) -> str | None:
    """The call as a signature string, or None when it cannot be replayed from its description."""
    try:
        encoded_kwargs = {key: _encode(value) for key, value in kwargs.items()}
        return json.dumps([str(func), _encode(list(args)), encoded_kwargs], separators=(",", ":"))
    except (_NotReplayable, TypeError):  # TypeError: a symbolic size inside a tensor's shape
        return None
