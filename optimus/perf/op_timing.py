"""Operators of a traced step timed on a device: the table of measured kernels that replaces the roofline.

A CPU's rates differ ten-fold between operators of the same bytes (a strided copy, a cast, a reduction, a
small matrix product), and a GPU's expert GEMMs and fused optimizer run far from the rates of one large product
(benchmarks/gpu/priced_kinds.py), so one roofline cannot price a step. `machine=local` (on this CPU, at
prediction time) and `optimus plan --calibrate` (on a node's devices, into the calibration) instead run each
distinct operator of the traced step once more, for real, at its traced shapes, strides and dtypes, and keep
the median of a few samples, one per round through the whole list: a measured table of exactly the kernels the
step launches.

A signature names one operator call: `[op, args, kwargs]` as JSON, each tensor as `{"t": [shape, stride,
dtype]}` on the host or `{"a": [shape, stride, dtype]}` on the step's accelerator (a GPU, or the dry run's
stand-in for one), which replays on the device being timed. Replayed, floating-point tensors hold normal noise
and integer or boolean tensors zeros (a valid index for every indexing operator), except the arguments whose
values decide the work (`_spread_values`): group offsets split the rows evenly, and the indices of a gather or
scatter spread over the indexed dimension, as a balanced routing would. An operator that cannot be encoded (a
generator, a symbolic size, a sparse tensor) or replayed (its arguments only valid with the real data) has no
signature or no time, and the roofline prices it. A signature keeps neither a tensor's storage offset (its
alignment) nor which arguments share memory: each replayed tensor has a storage of its own, starting aligned.
"""

from __future__ import annotations

import importlib
import json
import statistics
import time

import torch

_CPU = torch.device("cpu")
_MAX_REPLAY_BYTES = 1 << 30  # tensors of one call; larger calls are priced by the roofline
_ROUNDS = 5  # samples of each operator, one per round through the list
_DEVICE_CALLS = 5  # calls per sample on an accelerator, between two synchronizations: the wait is not timed
# Namespaces of operators that a module registers on import (their custom ops); torch's own are always there.
_REGISTERED_BY = {"optimus": "optimus.kernels.triton_backend"}
# Integer arguments, by name, whose values are the cumulative ends of groups of the rows of the call's first
# tensor (the experts' offsets of a grouped GEMM, the tokens' segments of a segment sum).
_GROUP_ENDS = ("offs", "offsets_E", "seg_end_T", "offsets2_E")
_SECOND_PART_ROWS = {"offsets2_E": "x2_AM"}  # group ends of a second batch of rows: they split that batch's rows


def _span(shape: list[int], stride: list[int]) -> int:
    """Elements of storage a tensor of that shape and stride reaches."""
    return 1 + sum((size - 1) * step for size, step in zip(shape, stride)) if all(shape) else 0


def _tensor(shape: list[int], stride: list[int], dtype: torch.dtype, device: torch.device) -> torch.Tensor:
    """A tensor of that shape and stride over a storage of just the elements it spans."""
    storage = torch.zeros(_span(shape, stride), dtype=dtype, device=device)
    if dtype.is_floating_point:
        storage.normal_()
    return storage.as_strided(shape, stride)


def _decode(x, device: torch.device = _CPU):
    """The arguments a signature describes, made afresh: host tensors on the CPU, the accelerator's on `device`."""
    if isinstance(x, dict):
        for where, on in (("t", _CPU), ("a", device)):
            if where in x:
                shape, stride, dtype = x[where]
                return _tensor(shape, stride, getattr(torch, dtype), on)
        if "torch" in x:
            return getattr(torch, x["torch"])
        return _CPU if x["device"] == "cpu" else device
    if isinstance(x, list):
        return [_decode(item, device) for item in x]
    return x


def _replay_bytes(x) -> int:
    if isinstance(x, dict) and ("t" in x or "a" in x):
        shape, stride, dtype = x.get("t") or x["a"]
        return _span(shape, stride) * getattr(torch, dtype).itemsize
    if isinstance(x, list):
        return sum(_replay_bytes(item) for item in x)
    return 0


def _operator(name: str):
    namespace, op, overload = name.split(".")
    if namespace in _REGISTERED_BY:
        importlib.import_module(_REGISTERED_BY[namespace])
    return getattr(getattr(getattr(torch.ops, namespace), op), overload)


def _spread_values(func, args: list, kwargs: dict) -> None:
    """Give the integer arguments whose values decide an operator's work those of a balanced routing, in place:
    zeros would leave every group of a grouped GEMM empty but the last, and send every row of a scatter to one
    place. Group ends (_GROUP_ENDS) split the grouped rows evenly (a second batch's ends, its own rows); the index
    of a gather, scatter or index_* operator (arguments `self`, `dim`, `index`), the indices of `index` and
    `index_put`, and the expert path's token indices spread over what they index; its orders (`order_A`) are the
    identity."""
    named = dict(zip((a.name for a in func._schema.arguments), args)) | kwargs
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    first = tensors[0].shape[0] if tensors and tensors[0].dim() else 0
    # A grouped product of two matrices groups their shared dimension: the second's rows (x^T @ dy by expert).
    both_matrices = len(tensors) > 1 and tensors[0].dim() == tensors[1].dim() == 2
    for name in _GROUP_ENDS:
        ends = named.get(name)
        if isinstance(ends, torch.Tensor) and not ends.is_floating_point() and ends.dim() == 1:
            rows, groups = (tensors[1].shape[0] if both_matrices else first), ends.numel()
            if name in _SECOND_PART_ROWS:
                rows = named[_SECOND_PART_ROWS[name]].shape[0]
            ends.copy_(torch.arange(1, groups + 1, device=ends.device) * rows // max(groups, 1))
    target, index, indices = named.get("self"), named.get("index"), named.get("indices")
    if isinstance(target, torch.Tensor) and isinstance(index, torch.Tensor) and isinstance(named.get("dim"), int):
        _spread(index, target.shape[named["dim"]] if target.dim() else 1)
    if isinstance(target, torch.Tensor) and isinstance(indices, list):  # one index per leading dimension
        for dim, each in enumerate(indices[: target.dim()]):
            if isinstance(each, torch.Tensor):
                _spread(each, target.shape[dim])
    lookup = named.get("weight") if isinstance(named.get("weight"), torch.Tensor) else None
    if isinstance(indices, torch.Tensor) and (lookup is not None or isinstance(named.get("num_weights"), int)):
        _spread(indices, named.get("num_weights") or lookup.shape[0])  # an embedding's lookups and their gradient
    if isinstance(named.get("token_idx_A"), torch.Tensor):
        _spread(named["token_idx_A"], named.get("n_tokens") or first)
    if isinstance(named.get("order_A"), torch.Tensor):
        _spread(named["order_A"], named["order_A"].numel())


def _spread(index: torch.Tensor, size: int) -> None:
    """Fill an integer index with 0, 1, ..., size - 1, 0, 1, ... in its element order (booleans stay False, and
    an expanded index, whose elements share memory, stays zeros)."""
    if index.dtype in (torch.int32, torch.int64) and size > 0 and 0 not in index.stride():
        index.copy_((torch.arange(index.numel(), device=index.device) % size).reshape(index.shape))


def _made_call(func, encoded_args: list, encoded_kwargs: dict, device: torch.device) -> tuple[list, dict]:
    args, kwargs = _decode(encoded_args, device), {key: _decode(value, device) for key, value in encoded_kwargs.items()}
    _spread_values(func, args, kwargs)
    return args, kwargs


def _time_call(func, encoded_args: list, encoded_kwargs: dict, device: torch.device) -> float:
    """Seconds of one call on freshly made inputs. On a CPU one call, as a step's operator reads what the
    operators before it just wrote (and an in-place one does not compound its own results: `exp_` of its own
    output overflows); on an accelerator the mean of a few calls queued back to back between two
    synchronizations, as a step queues them, so that neither the synchronization nor the host's wait is counted
    where the device is busier than the host."""
    args, kwargs = _made_call(func, encoded_args, encoded_kwargs, device)
    if device.type == "cpu":
        start = time.perf_counter()
        func(*args, **kwargs)
        return time.perf_counter() - start
    module = torch.get_device_module(device.type)
    module.synchronize(device)
    start = time.perf_counter()
    for _ in range(_DEVICE_CALLS):
        func(*args, **kwargs)
    module.synchronize(device)
    return (time.perf_counter() - start) / _DEVICE_CALLS


def time_signature(signature: str, device: torch.device = _CPU) -> float | None:
    """Seconds of one call of the signature on `device` (after one untimed call, which also compiles a Triton
    kernel), or None when it cannot run on made-up data."""
    name, encoded_args, encoded_kwargs = json.loads(signature)
    if _replay_bytes(encoded_args) + _replay_bytes(list(encoded_kwargs.values())) > _MAX_REPLAY_BYTES:
        return None
    try:
        func = _operator(name)
        _time_call(func, encoded_args, encoded_kwargs, device)
        return _time_call(func, encoded_args, encoded_kwargs, device)
    except Exception as err:  # an operator not registered here, a dtype without noise, arguments valid only with
        if _device_broken(err):  # the real data (offsets, sizes read from values); but not a failed device
            raise
        return None


def _device_broken(err: Exception) -> bool:
    """Whether an error leaves the device unusable for every later call (a device-side assert, a bad access), so
    that timing must stop rather than price the rest by the roofline."""
    text = str(err)
    return "device-side assert" in text or "illegal memory access" in text


def time_signatures(signatures: list[str], device: torch.device = _CPU, rounds: int = _ROUNDS) -> dict[str, float]:
    """Median seconds of each signature that replays on `device`, over `rounds` rounds through the whole list (so
    that a moment's load on a shared machine reaches one sample of each, not every sample of one). On a CPU, run
    it with the threads a rank has and glibc keeping freed memory as a training run does (cpu_times)."""
    with torch.no_grad():
        samples = {sig: [seconds] for sig in signatures if (seconds := time_signature(sig, device)) is not None}
        for _ in range(rounds - 1):
            for sig in list(samples):
                name, encoded_args, encoded_kwargs = json.loads(sig)
                try:
                    samples[sig].append(_time_call(_operator(name), encoded_args, encoded_kwargs, device))
                except Exception as err:  # made-up inputs that happen to be invalid this time: the roofline
                    if _device_broken(err):
                        raise
                    del samples[sig]
    return {sig: statistics.median(times) for sig, times in samples.items()}


def cpu_times(signatures: list[str], threads: int) -> dict[str, float]:
    """time_signatures on this CPU with `threads` threads and glibc keeping freed memory as a training run does
    (run it in a fresh process: both settings stay there)."""
    from optimus.cpu_runtime import keep_cpu_allocations

    keep_cpu_allocations()
    torch.set_num_threads(threads)
    return time_signatures(signatures)


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


# ---- the file `optimus plan --calibrate` writes (machine.perf.operator_times)

OPERATOR_TIMES_FORMAT = "optimus-operator-times-v1"


def operator_times_json(seconds: dict[str, float], measured: dict, spread: float) -> str:
    """operators.json: each signature's seconds, `measured` (where, when, on what, the step they are of), and the
    times' range as a fraction either side (`spread`), which a prediction's interval takes."""
    content = {"format": OPERATOR_TIMES_FORMAT, "measured": measured, "spread": spread, "seconds": seconds}
    return json.dumps(content, indent=1) + "\n"


def read_operator_times(path: str) -> tuple[dict[str, float], dict, float]:
    """(seconds by signature, what they were measured on, their spread) of an operators.json; a ConfigError
    naming the file and what to do where it is missing or not one."""
    from pathlib import Path

    from optimus.config import ConfigError

    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(
            f"machine.perf.operator_times={path} is not a file: run `optimus plan --calibrate --out DIR` again, or "
            "set machine.perf.operator_times=null to price every operator by the roofline."
        )
    try:
        content = json.loads(file.read_text())
        if content.get("format") != OPERATOR_TIMES_FORMAT or not isinstance(content.get("measured", {}), dict):
            raise ValueError
        seconds = {str(sig): float(s) for sig, s in content["seconds"].items()}
        return seconds, content.get("measured", {}), float(content.get("spread", 0.0))
    except (ValueError, TypeError, AttributeError, KeyError):
        raise ConfigError(
            f"machine.perf.operator_times={path} is not an operators.json of `optimus plan --calibrate`: run it "
            "again, or set machine.perf.operator_times=null."
        ) from None
