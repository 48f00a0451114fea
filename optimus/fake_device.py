"""A stand-in accelerator: the step a GPU runs, traced on fake tensors on a machine without one.

`optimus plan --dry-run --device cuda|rocm|xpu` runs the real training step on fake tensors (FakeTensorMode:
shapes, dtypes and devices, no data). Fake tensors of torch's own `cuda` or `xpu` type would take every
device-dependent branch of the GPU's step, but a CPU-only torch cannot run their backward: the autograd engine
asks the device's guard for its current stream, and a CPU-only build has no CUDA or XPU guard (pytorch#92627).
So the step's tensors live on a device of torch's PrivateUse1 type, registered here as a Python backend
(`torch.utils.backend_registration._setup_privateuseone_for_python_backend`) under the name `standin`. torch
gives it a device guard whose streams do nothing, which is all the engine needs; FakeTensorMode runs every
operator's meta implementation on it, so no kernel ever runs and no memory is allocated.

What a stand-in tensor is for Optimus: a tensor that is not on a CPU, so every choice that asks "is this a CPU"
takes the accelerator's branch (grouped GEMMs instead of per-expert loops, the native reduce-scatter, no host
read of row bounds). Which accelerator it stands for - `cuda`, `rocm` or `xpu` - is the platform's
(optimus.platform.Platform.path), the one place that decides the device path.

Two things a registered backend gets from torch's C++ and a Python one must be given:

- a device module (`torch.standin`): what Optimus calls on a GPU's module (set_device, synchronize, the memory
  statistics), answering as an idle device with nothing allocated; autocast asks it which dtypes it supports;
- autocast: torch registers no autocast kernels for PrivateUse1. The stand-in's autocast applies the policy of
  the device it stands for, read from torch's own kernels for that device (AutocastCUDA, AutocastXPU): for an
  operator that has one, that kernel runs once on fake tensors of that device with the same dtypes, the casts
  it makes are recorded, and the stand-in makes the same casts. So the trace holds the casts a GPU's step
  makes, at the places it makes them, without a list of operators kept here.

Constants a step makes from host data (`torch.tensor(data, device=...)`) cannot be made on the stand-in (it
has no memory to copy into): Optimus's step makes them on the device with `new_full` / `torch.full`, as a GPU's
step should anyway (a host-to-device copy waits for the queue).
"""

from __future__ import annotations

import functools
from contextlib import contextmanager

import torch

from optimus.kernels import torch_private as tp
from optimus.kernels.torch_private import TorchDispatchMode

STAND_IN = "standin"  # the PrivateUse1 backend's name: tensors on it have device.type == "standin"

# The torch device type whose autocast policy the stand-in applies, by device path.
AUTOCAST_OF = {"cuda": "cuda", "rocm": "cuda", "xpu": "xpu"}

_path: list[str] = ["cuda"]  # the device path the stand-in stands for now (stand_in(path))


class _StandInModule:
    """torch.standin: the device module of an idle device with nothing allocated."""

    @staticmethod
    def is_available() -> bool:
        return False  # so that nothing looking for this machine's accelerator (torch's DCP, for one) takes it

    @staticmethod
    def is_initialized() -> bool:
        return True

    @staticmethod
    def _is_in_bad_fork() -> bool:
        return False

    @staticmethod
    def device_count() -> int:
        return 1

    @staticmethod
    def current_device() -> int:
        return 0

    @staticmethod
    def set_device(device) -> None:
        """One device: it is always the current one."""

    @staticmethod
    def synchronize(device=None) -> None:
        """No kernel ever runs on it: there is nothing to wait for."""

    @staticmethod
    def manual_seed_all(seed: int) -> None:
        """Fake tensors draw no random numbers: there is no generator to seed."""

    @staticmethod
    def get_rng_state(device=None) -> torch.Tensor:
        return torch.zeros(16, dtype=torch.uint8)  # a generator's state, which nothing draws from here

    @staticmethod
    def set_rng_state(state, device=None) -> None:
        """No generator (manual_seed_all): the state is not kept."""

    @staticmethod
    def get_amp_supported_dtype() -> list[torch.dtype]:
        return [torch.bfloat16, torch.float16]

    @staticmethod
    def empty_cache() -> None:
        """It holds no memory (fake tensors): there is no cache to empty."""

    @staticmethod
    def reset_peak_memory_stats(device=None) -> None:
        """It holds no memory: its peak is always 0 (a dry run measures memory with torch's MemTracker)."""

    @staticmethod
    def memory_allocated(device=None) -> int:
        return 0

    @staticmethod
    def max_memory_allocated(device=None) -> int:
        return 0


class _Unavailable(tp.PrivateUse1Hooks):
    """torch's C++ view of the stand-in: built, but never this machine's accelerator (torch.accelerator)."""

    def is_available(self) -> bool:
        return False

    def has_primary_context(self, dev_id) -> bool:
        return True

    def is_built(self) -> bool:
        return True


@functools.cache
def _register() -> None:
    """Register the stand-in once per process (torch's PrivateUse1 backend can be named only once)."""
    missing = tp.stand_in_api_missing()
    if missing:
        raise tp.PrivateTorchMissing(missing[0])
    if tp.privateuse1_backend_name() != "privateuseone":
        raise RuntimeError(
            f"torch's PrivateUse1 backend is already registered as {tp.privateuse1_backend_name()!r}: a dry run of a "
            "GPU's step needs it for its stand-in device; run it in a process without that backend."
        )
    tp.setup_python_backend(STAND_IN, backend_module=_StandInModule(), hook=_Unavailable())
    # Every operator passes through the stand-in's autocast untouched, but for those the targets' autocast has
    # a kernel for, which get `_autocast_like_target`.
    passing = torch.library.Library("_", "IMPL")
    passing.fallback(torch.library.fallthrough_kernel, "AutocastPrivateUse1")
    casting = {}
    for target in set(AUTOCAST_OF.values()):
        for name in tp.dispatch_registrations(_autocast_key(target)):
            namespace, op = name.split("::")
            casting.setdefault(namespace, set()).add(op)
    for namespace, ops in casting.items():
        library = torch.library.Library(namespace, "IMPL")
        for op in sorted(ops):
            overload = _overload(namespace, op)
            library.impl(op, functools.partial(_autocast_like_target, overload), "AutocastPrivateUse1")
        _LIBRARIES.append(library)
    _LIBRARIES.append(passing)  # a Library deregisters its kernels when collected
    aten = torch.library.Library("aten", "IMPL")
    aten.impl("scaled_dot_product_attention", _fused_attention, "AutogradPrivateUse1")
    aten.impl("empty_strided", _empty_strided, "PrivateUse1")
    aten.impl("empty.memory_format", _empty, "PrivateUse1")
    aten.impl("copy_", _copy_nothing, "PrivateUse1")
    _LIBRARIES.append(aten)


_LIBRARIES: list[torch.library.Library] = []


def stand_in(path: str) -> torch.device:
    """The stand-in device for a GPU of device path `path` (cuda | rocm | xpu): registered on first use, with the
    autocast policy of that path's device.

    Register it before the process's first backward (as `optimus plan`, which runs in its own process, does): the
    autograd engine sizes its per-device queues once, at the first backward, and a device registered later has no
    queue (a backward on it then fails inside the engine; `engine_error_explained` says so in one sentence)."""
    if path not in AUTOCAST_OF:
        raise ValueError(f"no stand-in for device path {path!r}: one of {', '.join(AUTOCAST_OF)}")
    _register()
    _path[0] = path
    return torch.device(STAND_IN, 0)


def registered() -> bool:
    """Whether this process has registered the stand-in device. Then torch takes it for the process's accelerator,
    and the autograd engine asks it for the streams of a real GPU's backward (an internal assertion in torch's
    engine): a real GPU's step and a dry run of one never share a process (the Trainer refuses it)."""
    return bool(_LIBRARIES)


@contextmanager
def engine_error_explained():
    """The autograd engine's failure on a stand-in registered after the process's first backward, as one sentence
    (stand_in)."""
    try:
        yield
    except RuntimeError as err:
        if "device_ready_queues_" not in str(err):
            raise
        raise RuntimeError(
            f"this process ran a backward before the {STAND_IN} device was registered, so torch's autograd engine has "
            "no queue for it: trace a GPU's step in a fresh process (optimus plan does), or call "
            "optimus.fake_device.stand_in() before the first backward."
        ) from None


# ---------------------------------------------------------------------------------------------
# Memory: none. torch.tensor(data, device=...) allocates on the device and copies the data below every mode (a
# fake mode included); on the stand-in that allocation is a fake tensor of the active fake mode, and the copy
# does nothing (a dry run answers the reads of such values: optimus.dry_run.answer_read).


def _active_fake_mode():
    modes = [m for m in tp.current_dispatch_modes() if isinstance(m, tp.FakeTensorMode)]
    if not modes:
        raise RuntimeError(
            f"the {STAND_IN} device holds no memory: make its tensors under a FakeTensorMode (a dry run does)."
        )
    return modes[-1]


def _empty_strided(size, stride, dtype=None, layout=None, device=None, pin_memory=None):
    meta = torch.empty_strided(size, stride, dtype=dtype, device="meta")
    return tp.FakeTensor(_active_fake_mode(), meta, torch.device(STAND_IN, 0))


def _empty(size, dtype=None, layout=None, device=None, pin_memory=None, memory_format=None):
    meta = torch.empty(size, dtype=dtype, device="meta", memory_format=memory_format)
    return tp.FakeTensor(_active_fake_mode(), meta, torch.device(STAND_IN, 0))


def _copy_nothing(self, src, non_blocking=False):
    return self


# ---------------------------------------------------------------------------------------------
# Attention


def _fused_attention(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """F.scaled_dot_product_attention on the stand-in: the fused kernel the device's SDPA picks for a causal bf16
    attention without a mask (torch picks one per device in C++, which a Python backend cannot join, and would
    otherwise run the math path, which keeps the [S, S] probabilities): flash attention on CUDA and ROCm, the
    fused (oneDNN) kernel on XPU. Both save the output and its log-sum-exp for the backward."""
    if attn_mask is not None:
        raise NotImplementedError("the stand-in device's attention takes no mask (Optimus's attention passes none)")
    if _path[0] == "xpu":
        return tp.SDPA_FUSED_OVERRIDEABLE(query, key, value, None, dropout_p, is_causal, False, scale=scale)[0]
    return tp.SDPA_FLASH(query, key, value, dropout_p, is_causal, False, scale=scale)[0]


# ---------------------------------------------------------------------------------------------
# Autocast

_STAND_IN_AUTOCAST = tp.DispatchKeySet(tp.DispatchKey.AutocastPrivateUse1) if tp.found("dispatcher") else None


def _autocast_like_target(op, *args, **kwargs):
    """AutocastPrivateUse1's kernel for every operator: the casts the target device's autocast makes, then the
    operator with the stand-in's autocast excluded (as torch's own autocast kernels call it)."""
    target = AUTOCAST_OF[_path[0]]
    with tp.ExcludeDispatchKeyGuard(_STAND_IN_AUTOCAST):
        if tp.dispatch_has_kernel(op.name(), _autocast_key(target)):  # (cuda's, xpu's)
            casts = _casts(op, target, torch.get_autocast_dtype(STAND_IN), args, kwargs)
            if casts:
                args, kwargs = _apply(casts, args, kwargs)
        return op(*args, **kwargs)


def _overload(namespace: str, name: str):
    """torch.ops' operator overload of a dispatcher name such as `linear` or `_convolution.deprecated`."""
    packet, _, overload = name.partition(".")
    return getattr(getattr(getattr(torch.ops, namespace), packet), overload or "default")


def _autocast_key(device_type: str) -> str:
    return {"cuda": "AutocastCUDA", "xpu": "AutocastXPU"}[device_type]


def _tensor_positions(args: tuple, kwargs: dict):
    """(place, tensor) for every tensor argument, in order; a place is ("a", i), ("a", i, j) inside a list, or
    ("k", name)."""
    for i, arg in enumerate(args):
        if isinstance(arg, torch.Tensor):
            yield ("a", i), arg
        elif isinstance(arg, (list, tuple)):
            for j, item in enumerate(arg):
                if isinstance(item, torch.Tensor):
                    yield ("a", i, j), item
    for name, arg in kwargs.items():
        if isinstance(arg, torch.Tensor):
            yield ("k", name), arg


def _call_key(op, target: str, autocast_dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple:
    """What decides a call's casts: the operator, the policy, its tensors' dtypes and its other arguments (a
    `dtype=` argument changes some policies)."""
    dtypes = tuple((place, t.dtype) for place, t in _tensor_positions(args, kwargs))
    others = repr(
        [a for a in args if not isinstance(a, (torch.Tensor, list, tuple))]
        + sorted((k, repr(v)) for k, v in kwargs.items() if not isinstance(v, torch.Tensor))
    )
    return op, target, autocast_dtype, dtypes, others


_CASTS: dict[tuple, tuple] = {}


def _casts(op, target: str, autocast_dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple:
    """((place, dtype), ...): the casts `target`'s autocast makes to this call's tensor arguments, found once
    per kind of call by running its autocast kernel on fake `target` tensors of the same shapes and dtypes and
    recording the copies it makes before anything else."""
    key = _call_key(op, target, autocast_dtype, args, kwargs)
    if key not in _CASTS:
        _CASTS[key] = _probe(op, target, autocast_dtype, args, kwargs)
    return _CASTS[key]


def _probe(op, target: str, autocast_dtype: torch.dtype, args: tuple, kwargs: dict) -> tuple:
    was_enabled, was_dtype = torch.is_autocast_enabled(target), torch.get_autocast_dtype(target)
    # Out of every mode of the step (its fake mode, its recorders): the probe is not part of the step.
    with tp.disable_current_modes(), tp.FakeTensorMode(allow_non_fake_inputs=True):
        args, kwargs = _apply((), args, kwargs, device=target)
        recorder = _FirstCasts({id(t): place for place, t in _tensor_positions(args, kwargs)})
        torch.set_autocast_enabled(target, True)
        torch.set_autocast_dtype(target, autocast_dtype)
        try:
            with recorder:
                op(*args, **kwargs)
        finally:
            torch.set_autocast_enabled(target, was_enabled)
            torch.set_autocast_dtype(target, was_dtype)
    return tuple(recorder.casts)


class _FirstCasts(TorchDispatchMode):
    """Records the dtype conversions (`_to_copy`) made of the given tensors before the first other kernel."""

    def __init__(self, places: dict):
        super().__init__()
        self.places, self.casts, self.done = places, [], False

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        out = func(*args, **kwargs)
        if self.done or func.namespace == "prim":
            return out
        if func is tp.TO_COPY and id(args[0]) in self.places and "dtype" in kwargs:
            self.casts.append((self.places[id(args[0])], kwargs["dtype"]))
        else:
            self.done = True
        return out


def _apply(casts: tuple, args: tuple, kwargs: dict, device: str | None = None):
    """args and kwargs with the tensor at each place cast to its dtype (None: kept); with `device`, every tensor
    replaced by an empty one of its shape, strides and dtype on that device."""
    want = dict(casts)
    args, kwargs = list(args), dict(kwargs)
    for place, t in list(_tensor_positions(tuple(args), kwargs)):
        new = t
        if device is not None:
            new = torch.empty_strided(t.shape, t.stride(), dtype=t.dtype, device=device)
        if want.get(place) is not None:
            new = new.to(want[place])
        if new is t:
            continue
        if place[0] == "k":
            kwargs[place[1]] = new
        elif len(place) == 2:
            args[place[1]] = new
        else:
            seq = list(args[place[1]])
            seq[place[2]] = new
            args[place[1]] = type(args[place[1]])(seq) if isinstance(args[place[1]], tuple) else seq
    return tuple(args), kwargs
