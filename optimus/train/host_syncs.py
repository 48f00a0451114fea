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
from pathlib import Path

import torch
from torch.utils._python_dispatch import TorchDispatchMode

import optimus

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
_THIS_FILE = Path(__file__).resolve()


def _caller() -> str:
    """`optimus/path.py:line function` of the innermost optimus frame on the stack (not this file)."""
    for frame in reversed(traceback.extract_stack()):
        path = Path(frame.filename).resolve()
        if path != _THIS_FILE and path.is_relative_to(_PACKAGE_ROOT / "optimus"):
            return f"{path.relative_to(_PACKAGE_ROOT)}:{frame.lineno} {frame.name}"
    return "outside optimus"


def _syncs(func, args: tuple, kwargs: dict) -> bool:
    name = func._overloadpacket.__name__
    if name == "repeat_interleave":  # its output length is a sum of values unless output_size is given
        return kwargs.get("output_size") is None and (len(args) < 4 or args[3] is None)
    if name == "index":  # a boolean mask index is a nonzero
        return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in (args[1] or []))
    return name in _SYNCING_OPS


class HostSyncCounter(TorchDispatchMode):
    """While active (`with counter:`), counts host synchronisations by source line into `.counts`."""

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        self._tolist = None

    def __enter__(self):
        self._tolist = torch.Tensor.tolist
        counts, tolist = self.counts, self._tolist

        def counted_tolist(tensor):
            counts[_caller()] += 1
            return tolist(tensor)

        torch.Tensor.tolist = counted_tolist
        return super().__enter__()

    def __exit__(self, *exc):
        torch.Tensor.tolist = self._tolist
        return super().__exit__(*exc)

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if _syncs(func, args, kwargs):
            self.counts[_caller()] += 1
        return func(*args, **kwargs)

    def as_list(self) -> list[dict]:
        """[{"where", "count"}], the most frequent first (ties by place)."""
        return [{"where": w, "count": n} for w, n in sorted(self.counts.items(), key=lambda item: (-item[1], item[0]))]
