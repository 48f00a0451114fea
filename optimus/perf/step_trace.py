"""Everything one rank does in a training step, in order: the input of the performance model.

`StepTrace` is the collective trace (optimus.parallel.collective_trace: its `.calls` and `phase(...)` work as
there) that also records every other operator the step dispatches, so a dry run on fake tensors describes the
step the code will run - its recomputation, its optimizer, its loss - rather than a formula's idea of it.
`.events` holds, in issue order:

    {"e": "ops", "where": "layers.3", "bw": false, "ops": [[kind, flops, bytes, fp32, signature, count], ...]}
        a run of operators in one place (`layers.N`, `embed`, `head` or a phase label such as `optimizer`) and
        direction (`bw`: inside the autograd engine, recomputation included); kind `mm` (a matrix product,
        with its FLOPs), `attn` (an attention kernel, FLOPs of the work it does: half the scores when causal),
        `mem` (any other kernel: bytes read and written) or `view` (no kernel: views, allocations);
        `signature` the call's operator, shapes, strides and dtypes (optimus.perf.op_timing, which can run it
        again on a CPU) when the trace records them (`StepTrace(signatures=True)`, for machine=local), null
        otherwise and for a view or a call it cannot describe
    {"e": "comm", "id": 7, "async": true, "call": {...}, "as": "reduce_scatter"}
        a collective, `call` as collective_trace records it; `async` when the code does not wait for it where it
        is issued (async_op=True, isend/irecv, functional collectives); `as` (where present) the collective it
        stands for (optimus.parallel.collectives.reduce_scatter_sum issues gloo's reduce-scatter as an
        all-to-all of the blocks; on a GPU the library's reduce-scatter runs, and is priced)
    {"e": "wait", "id": 7}
        the first operator that reads what async collective 7 wrote (or a functional collective's wait)
    {"e": "action", "type": "F" | "B" | "I" | "W", "stage": 2, "mb": 5} ... {"e": "end"}
        one action of a pipeline schedule (forward, full backward, input backward, weight backward of
        micro-batch `mb` on stage `stage`), when `mark_actions` wraps the rank's pipeline stages
    {"e": "carry", "waits": [[12, ["embed", "layers.0"]], [13, ["layers.1"]], ...]}
        at the end, where the step leaves async collectives in flight that the next step's forward waits for
        (the parameter all-gathers of optim.overlap_param_gather: `carry_to_next_forward`): each one's id and
        the model parts whose parameters it writes
"""

from __future__ import annotations

import re
import sys
from collections import Counter, defaultdict
from contextlib import contextmanager

import torch
from torch.multiprocessing.reductions import StorageWeakRef

from optimus.kernels.torch_private import current_graph_task_id
from optimus.operators import launches_kernel, op_cost, op_signature
from optimus.parallel.collective_trace import (
    _NAMESPACES,
    _NOT_COLLECTIVES,
    _OP_NAMES,
    CollectiveTrace,
    _named_arguments,
    _record,
    _tensors,
)
from optimus.parallel.tensor_parallel import local_tensor

# The version of `.events`' layout, for caches of traces: 2 since each run of operators carries signatures, 3 since
# a step that leaves its parameter gathers to the next forward says so (a `carry` event), 4 since a bf16 attention's
# backward is no fp32 product (optimus.operators.op_cost), 5 since an argument an operator writes in place is
# counted as read and written and does not make its products fp32 ones, and expert weight gradients may be added
# into the optimizer's fp32 buffer by their kernel (optimus.kernels.grad_sink), 6 since RMSNorm runs as the kernel
# backend's operators (optimus.kernels.rms_norm: Triton's on the device path) and ZeRO-2's sums of a step's
# micro-batches are gradient sinks too, 7 since `_unsafe_view` is a view and a `new_zeros` or `ones_like` reads
# nothing of its tensor argument.
FORMAT = 7

_LAYER = re.compile(r"(?:^|\.)layers\.(\d+)")
# Python functions of torch.distributed that issue a collective without waiting for it.
_ASYNC_CALLERS = {"isend", "irecv", "batch_isend_irecv"}
# Optimus's functions that issue one collective as another on a CPU (gloo), and what a GPU's library runs.
_STANDS_FOR = {"reduce_scatter_sum": "reduce_scatter"}


def _stands_for() -> str | None:
    """The collective an emulation issues this one for (gloo's reduce-scatter as an all-to-all), if any."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _STANDS_FOR:
            return _STANDS_FOR[frame.f_code.co_name]
        frame = frame.f_back
    return None


def _issued_async() -> bool:
    """Whether the torch.distributed call that issued this collective returns without waiting for it."""
    frame = sys._getframe(2)
    while frame is not None:
        if frame.f_code.co_name in _ASYNC_CALLERS:
            return True
        if "async_op" in frame.f_locals and frame.f_code.co_filename.endswith("distributed_c10d.py"):
            return bool(frame.f_locals["async_op"])
        frame = frame.f_back
    return False


# Where a c10d operator's schema keeps the tensors it writes (in place for all_reduce, broadcast and recv).
_OUTPUT_NAMES = ("output", "output_tensor", "outputs", "output_tensors", "tensors")


def _written(func, args: tuple, kwargs: dict, out) -> list[torch.Tensor]:
    """The tensors a collective writes: its output arguments (c10d), or what it returns (functional)."""
    if func.namespace == "_c10d_functional":
        return _tensors([out])
    if func._overloadpacket.__name__ == "send":
        return []
    named = _named_arguments(func, args, kwargs)
    return _tensors([named[key] for key in _OUTPUT_NAMES if key in named])


def _byte_range(t: torch.Tensor) -> tuple[int, int]:
    """The bytes of its storage a tensor spans: [offset, offset + extent) (strides taken as they are)."""
    start = t.storage_offset() * t.element_size()
    if t.numel() == 0:
        return start, start
    extent = 1 + sum((size - 1) * abs(stride) for size, stride in zip(t.shape, t.stride()))
    return start, start + extent * t.element_size()


def phase_module(phase: str) -> tuple[str | None, str]:
    """A trace's phase as (direction, module): ("forward", "layers.1.ffn"), ("backward", "") for the autograd
    engine outside any module, or (None, label) for a label the trainer opened ("step", "optimizer")."""
    direction, _, module = phase.partition(" ")
    return (direction, module) if direction in ("forward", "backward") else (None, phase)


def place_of_phase(phase: str) -> str:
    """The model part a trace's phase ran in: place_of its module, `other` outside any module in a forward or
    backward, or the trainer's label."""
    direction, module = phase_module(phase)
    if direction is None:
        return module
    return place_of(module) if module else "other"


def place_of(module: str) -> str:
    """The model part a module belongs to: `layers.N`, `embed`, `head` (final norm, LM head), or its name."""
    layer = _LAYER.search(module)
    if layer:
        return f"layers.{layer.group(1)}"
    if module.endswith("embed"):
        return "embed"
    if module.endswith(("lm_head", "norm")):
        return "head"
    return module


class StepTrace(CollectiveTrace):
    """Records a step's operators and collectives into `.events` (and its collectives into `.calls`)."""

    def __init__(self, signatures: bool = False):
        super().__init__()
        self.signatures = signatures  # record each kernel's signature (for machine=local to time it)
        self.events: list[dict] = []
        # What each async collective in flight writes: (storage, first byte, end byte) -> its id.
        self._pending: dict[tuple[StorageWeakRef, int, int], int] = {}
        self._ops: Counter | None = None
        self._ops_key: tuple | None = None

    def _close_ops(self) -> None:
        if self._ops:
            where, bw = self._ops_key
            self.events.append({"e": "ops", "where": where, "bw": bw, "ops": [[*k, n] for k, n in self._ops.items()]})
        self._ops, self._ops_key = None, None

    def _emit(self, event: dict) -> None:
        self._close_ops()
        self.events.append(event)

    def _place(self) -> tuple[str, bool]:
        where = self._where()  # "forward layers.1.ffn", "backward ...", "backward", or a phase label
        bw = current_graph_task_id() != -1 or phase_module(where)[0] == "backward"
        return place_of_phase(where), bw

    def _wait_for_inputs(self, tensors: list[torch.Tensor]) -> None:
        """A wait for each async collective in flight that wrote bytes one of `tensors` reads (the slices of
        one flat buffer that different collectives fill do not wait for each other)."""
        for t in tensors:
            storage, (start, end) = StorageWeakRef(t.untyped_storage()), _byte_range(t)
            for key in [k for k in self._pending if k[0] == storage and k[1] < end and start < k[2]]:
                self._emit({"e": "wait", "id": self._pending.pop(key)})

    def _collective(self, func, args: tuple, kwargs: dict):
        name = func._overloadpacket.__name__
        named = _named_arguments(func, args, kwargs)
        call = _record(_OP_NAMES.get(name, name), named, self._where())
        self.calls.append(call)
        is_async = func.namespace == "_c10d_functional" or _issued_async()
        self._wait_for_inputs([t for t in _tensors(list(args)) if t.numel()])  # a collective reads its inputs too
        cid = len(self.calls) - 1
        event = {"e": "comm", "id": cid, "async": is_async, "call": call}
        stands_for = _stands_for()
        if stands_for:
            event["as"] = stands_for
        self._emit(event)
        out = func(*args, **kwargs)
        if is_async:
            for t in _written(func, args, kwargs, out):
                self._pending[(StorageWeakRef(t.untyped_storage()), *_byte_range(t))] = cid
        return out

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        from torch.distributed.tensor import DTensor

        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented
        kwargs = kwargs or {}
        name = func._overloadpacket.__name__
        if func.namespace in _NAMESPACES:
            if name == "wait_tensor":
                self._wait_for_inputs(_tensors(list(args)))
                return func(*args, **kwargs)
            if name not in _NOT_COLLECTIVES:
                return self._collective(func, args, kwargs)
            return func(*args, **kwargs)
        kernel = launches_kernel(func)  # a view reads nothing yet
        if self._pending and kernel:
            self._wait_for_inputs(_tensors(list(args) + list(kwargs.values())))
        # Before the call: an in-place operator may change its arguments' shapes (squeeze_, a resized out=).
        signature = op_signature(func, args, kwargs) if kernel and self.signatures else None
        out = func(*args, **kwargs)
        kind, flops, moved, fp32 = op_cost(func, args, kwargs, out)
        key = self._place()
        if key != self._ops_key:
            self._close_ops()
            self._ops, self._ops_key = Counter(), key
        self._ops[(kind, flops, moved, fp32, signature)] += 1
        return out

    def carry_to_next_forward(self, named_parameters) -> None:
        """Record which async collectives still in flight write which parameters (`named_parameters`: (whole-model
        name, parameter) pairs), as one `carry` event: the collectives the next step's forward waits for, part by
        part, where the step leaves them in flight (optim.overlap_param_gather). Nothing where none is."""
        waits: dict[int, set[str]] = defaultdict(set)
        for name, param in named_parameters:
            held = local_tensor(param)  # under tensor parallelism, the shard in the flat buffer
            storage, (start, end) = StorageWeakRef(held.untyped_storage()), _byte_range(held)
            for (written, first, last), cid in self._pending.items():
                if written == storage and first < end and start < last:
                    waits[cid].add(place_of(name.rpartition(".")[0]))
        if waits:
            self._emit({"e": "carry", "waits": [[cid, sorted(places)] for cid, places in sorted(waits.items())]})

    def finish(self) -> list[dict]:
        """The events, with the last run of operators closed."""
        self._close_ops()
        return self.events

    @contextmanager
    def mark_actions(self, stages):
        """Mark each forward and backward torch's pipeline stages run (`stages`: PipelineStage objects), by
        wrapping their methods on the instances for the duration."""
        kinds = {
            "forward_one_chunk": lambda full: "F",
            "backward_one_chunk": lambda full: "B" if full else "I",
            "backward_weight_one_chunk": lambda full: "W",
        }
        wrapped = []
        try:
            for stage in stages:
                for method, kind in kinds.items():
                    setattr(stage, method, self._marked(stage, getattr(stage, method), kind))
                    wrapped.append((stage, method))
            yield
        finally:
            for stage, method in wrapped:
                del stage.__dict__[method]  # the class's method shows through again

    def _marked(self, stage, original, kind):
        def marked(chunk_id, *args, **kwargs):
            full = kwargs.get("full_backward", args[1] if len(args) > 1 else True)
            self._emit({"e": "action", "type": kind(full), "stage": stage.stage_index, "mb": chunk_id})
            try:
                return original(chunk_id, *args, **kwargs)
            finally:
                self._emit({"e": "end"})

        return marked
