"""Count the host synchronisations of a step, by the line of Optimus that causes each.

On a GPU, reading a tensor's value on the host (`.item()`, `.tolist()`, `bool(t)`, `int(t)`) or running an
op whose output shape depends on values (`nonzero`, `bincount`, boolean indexing, `repeat_interleave`
without an output size) waits for every kernel queued before it: the launch queue drains and the GPU idles
until the host catches up. The design needs one such wait per MoE layer and micro-batch (the all-to-all's
split sizes, which the backward reuses); each other one is a stall.

`HostSyncCounter` is a TorchDispatchMode that sees those ops as they run (on any device, so a CPU run
counts the GPU path's syncs wherever the two share code) and `Tensor.tolist`, which reads memory without
dispatching an op and is therefore wrapped while the counter is active. Each is attributed to the
innermost frame of the optimus package on the stack.
"""

from __future__ import annotations

import traceback
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import torch
from torch.distributed.tensor import DTensor

import optimus
from optimus.kernels.torch_private import LOCAL_SCALAR_DENSE, FakeTensor, TorchDispatchMode

# Ops whose result the host must wait for: a value read, or an output shape that depends on values.
_SYNCING_OPS = {
    "_local_scalar_dense",  # .item(), bool(t), int(t), float(t)
    "nonzero",
    "masked_select",
    "bincount",  # its length is max(value) + 1 unless minlength covers it: the kernel reads the max first
    "_unique2",
    "unique_dim",
    "unique_consecutive",
    "is_nonzero",
    "equal",
}
_PACKAGE_ROOT = Path(optimus.__file__).resolve().parent.parent
# The reads of these files are their callers': this one, and the seams a dry run answers.
_HERE = Path(__file__).resolve().parent
_NOT_CALLERS = {_HERE / "host_syncs.py", _HERE / "load_model.py", _HERE / "kernels" / "host_reads.py"}


def _caller() -> str:
    """`optimus/path.py:line function` of the innermost optimus frame on the stack (not this file's, not a
    seam's of optimus.load_model)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path not in _NOT_CALLERS and path.is_relative_to(_PACKAGE_ROOT / "optimus"):
            return f"{path.relative_to(_PACKAGE_ROOT)}:{frame.lineno} {frame.name}"
    return "outside optimus"


def _syncs(func, args: tuple, kwargs: dict) -> bool:
    name = func.overloadpacket.__name__
    if name == "repeat_interleave":  # its output length is a sum of values unless output_size is given
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if name == "index":  # a boolean mask index is a nonzero
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
    return name in _SYNCING_OPS


class HostSyncCounter(TorchDispatchMode):
    """While active (`with counter:`), counts host synchronisations by source line into `.counts`.

    `answer_reads` is for fake tensors (a dry run), which hold no values: a function that gives the value of
    each read (`.item()`, element of `.tolist()`) from the tensor, instead of failing. The values a dry run
    needs to be meaningful (the expert exchange's rows) come from optimus.load_model, whose reads count here
    through `note_read()`. Ops whose output shape depends on values still fail: a dry run names them.
    """

    _active: list[HostSyncCounter] = []  # the counters in effect, innermost last

    def __init__(self, answer_reads: Callable[[torch.Tensor], bool | float | int] | None = None):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self.answer_reads = answer_reads
        self._tolists: dict[type, Callable] = {}  # the classes' own tolist, while they are wrapped
        self._in_tolist = False

    def __enter__(self):
        # A fake tensor has its own tolist, which reads element by element: one read, counted once here.
        for cls in (torch.Tensor, FakeTensor):
            self._tolists[cls] = cls.__dict__.get("tolist")  # None: inherited (torch.Tensor's, from C)
            cls.tolist = self._counted(cls.tolist)
        HostSyncCounter._active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        HostSyncCounter._active.remove(self)
        for cls, tolist in self._tolists.items():
            if tolist is None:
                del cls.tolist
            else:
                cls.tolist = tolist
        return super().__exit__(*exc)

    def _counted(self, tolist: Callable) -> Callable:
        def counted_tolist(tensor):
            if not self._in_tolist:
                self.counts[_caller()] += 1
            self._in_tolist, outer = True, self._in_tolist
            try:
                return tolist(tensor)
            finally:
                self._in_tolist = outer

        return counted_tolist

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor turns the op into local ops first; they come back here
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            if not self._in_tolist:
                self.counts[_caller()] += 1
            if self.answer_reads is not None and func is LOCAL_SCALAR_DENSE:
                return self.answer_reads(args[0])
        return func(*args, **kwargs)

    def as_list(self) -> list[dict]:
        """[{"where", "count"}], the most frequent first (ties by place)."""
        return [{"where": w, "count": n} for w, n in sorted(self.counts.items(), key=lambda item: (-item[1], item[0]))]


def note_read() -> None:
    """Count a value read that a dry run answered without a tensor's values (optimus.load_model's seams)."""
    for counter in HostSyncCounter._active:
        counter.counts[_caller()] += 1
