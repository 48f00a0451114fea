"""Operators of a traced step timed on this machine: the `local` machine model's table of measured kernels.

A CPU's rates differ ten-fold between operators of the same bytes (a strided copy, a cast, a reduction, a
small matrix product), so one roofline cannot price a CPU step. `machine=local` instead runs each distinct
operator of the traced step once more, for real, at its traced shapes, strides and dtypes, and keeps the
median of a few calls, one per round through the whole list: a measured table of exactly the kernels the
step launches.

A signature names one operator call: `[op, args, kwargs]` as JSON, with each tensor as `{"t": [shape, stride,
dtype]}`. Replayed, floating-point tensors hold normal noise and integer or boolean tensors zeros (a valid
index for every indexing operator; data-dependent sizes then come out as for a token routed to one place).
An operator that cannot be encoded (a generator, a symbolic size, a tensor off the CPU) or replayed (its
arguments only valid with the real data) has no signature or no time, and the roofline prices it. A
signature keeps neither a tensor's storage offset (its alignment) nor which arguments share memory: each
replayed tensor has a storage of its own, starting aligned.
"""

from __future__ import annotations

import json
import statistics
import time

import torch

_MAX_REPLAY_BYTES = 1 << 30  # tensors of one call; larger calls are priced by the roofline
_ROUNDS = 5  # samples of each operator, one per round through the list


class _NotReplayable(Exception):
    """An argument a signature cannot describe (see the module's docstring)."""


def _encode(x):
    if isinstance(x, torch.Tensor):
        if x.device.type != "cpu" or x.layout != torch.strided:
            raise _NotReplayable
        return {"t": [list(x.shape), list(x.stride()), str(x.dtype).removeprefix("torch.")]}
    if isinstance(x, (torch.dtype, torch.memory_format, torch.layout)):
        return {"torch": str(x).removeprefix("torch.")}
    if isinstance(x, torch.device):
        if x.type != "cpu":
            raise _NotReplayable
        return {"device": "cpu"}
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


def _span(shape: list[int], stride: list[int]) -> int:
    """Elements of storage a tensor of that shape and stride reaches."""
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0


def _tensor(shape: list[int], stride: list[int], dtype: torch.dtype) -> torch.Tensor:
    """A tensor of that shape and stride over a storage of just the elements it spans."""
    storage = torch.zeros(_span(shape, stride), dtype=dtype)
    if dtype.is_floating_point:
        storage.normal_()
    return storage.as_strided(shape, stride)


def _decode(x):
    if isinstance(x, dict):
        if "t" in x:
            shape, stride, dtype = x["t"]
            return _tensor(shape, stride, getattr(torch, dtype))
        if "torch" in x:
            return getattr(torch, x["torch"])
        return torch.device(x["device"])
    if isinstance(x, list):
        return [_decode(item) for item in x]
    return x


def _replay_bytes(x) -> int:
    if isinstance(x, dict) and "t" in x:
        shape, stride, dtype = x["t"]
        return _span(shape, stride) * getattr(torch, dtype).itemsize
    if isinstance(x, list):
        return sum(_replay_bytes(item) for item in x)
    return 0


def _operator(name: str):
    namespace, op, overload = name.split(".")
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _time_call(func, encoded_args: list, encoded_kwargs: dict) -> float:
    """Seconds of one call on freshly made inputs, as a step's operator reads what the operators before it
    just wrote (and an in-place one does not compound its own results: `exp_` of its own output overflows)."""
    args, kwargs = _decode(encoded_args), {key: _decode(value) for key, value in encoded_kwargs.items()}
    start = time.perf_counter()
    func(*args, **kwargs)
    return time.perf_counter() - start


def time_signature(signature: str) -> float | None:
    """Seconds of one call of the signature (after one untimed call), or None when it cannot run on made-up
    data."""
    name, encoded_args, encoded_kwargs = json.loads(signature)
    if _replay_bytes(encoded_args) + _replay_bytes(list(encoded_kwargs.values())) > _MAX_REPLAY_BYTES:
        return None
    try:
        func = _operator(name)
        _time_call(func, encoded_args, encoded_kwargs)
        return _time_call(func, encoded_args, encoded_kwargs)
    except Exception:  # an operator not registered here, a dtype without noise, arguments valid only with the
        return None  # real data (offsets, sizes read from values)


def time_signatures(signatures: list[str], threads: int, rounds: int = _ROUNDS) -> dict[str, float]:
    """Median seconds of each signature that replays, over `rounds` rounds through the whole list (so that a
    moment's load on a shared machine reaches one sample of each, not every sample of one), with `threads`
    threads and glibc keeping freed memory as a training run does (run it in a fresh process: both settings
    stay there)."""
    from optimus.cpu_runtime import keep_cpu_allocations

    keep_cpu_allocations()
    torch.set_num_threads(threads)
    with torch.no_grad():
        samples = {sig: [seconds] for sig in signatures if (seconds := time_signature(sig)) is not None}
        for _ in range(rounds - 1):
            for sig in list(samples):
                name, encoded_args, encoded_kwargs = json.loads(sig)
                try:
                    samples[sig].append(_time_call(_operator(name), encoded_args, encoded_kwargs))
                except Exception:  # made-up inputs that happen to be invalid this time: no time, the roofline
                    del samples[sig]
    return {sig: statistics.median(times) for sig, times in samples.items()}


def traced_signatures(traces: dict[int, dict]) -> list[str]:
    """The distinct signatures of the traces' operators, in first-seen order."""
    seen = {}
    for trace in traces.values():
        for event in trace["events"]:
            if event["e"] == "ops":
                for op in event["ops"]:
                    if op[4] is not None:
                        seen.setdefault(op[4], None)
    return list(seen)
