"""Every private torch API Optimus uses, in one place; `tests/test_torch_private.py` checks each against torch.

torch moves and renames its private names (a leading underscore, `_internal`, `_tools`, `_subclasses`,
undocumented methods) in any release, without a deprecation. Optimus imports each one here and nowhere else,
beside what it is for, where Optimus uses it, the public alternative (or that there is none) and what Optimus
does when it is missing. A missing name does not break `import optimus`: it becomes None or a stand-in that
raises `PrivateTorchMissing`, naming it, when used; so the feature that needs it fails with one sentence
instead of an AttributeError deep in torch, and the test fails by name on the torch that moved it.

`PRIVATE_API` lists them all (the test walks it); the names a package imports are module attributes, loaded
on first use where only a diagnostic tool needs them (`MemTracker`, `_TOTAL_KEY`, `FakeStore`, `ModTracker`).
It lives in `kernels`, which imports only torch (and triton), so every package of Optimus may import it.
"""

from __future__ import annotations

import functools
import importlib
import importlib.util
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

# The newest torch these notes were checked against (2.13 is the oldest Optimus allows).
CHECKED_TORCH = "2.14"


@dataclass(frozen=True)
class PrivateName:
    """One private torch name: `torch_name` (where torch keeps it), what Optimus uses it for and where
    (`used_by`), `public` (the public alternative, or why there is none) and `when_missing`."""

    torch_name: str
    used_by: str
    public: str
    when_missing: str

    def moved(self) -> str:
        """The sentence a missing name raises and the test fails with."""
        return (
            f"torch {torch.__version__} lacks or changed {self.torch_name} (private torch API, moved or renamed "
            "without notice). "
            f"Optimus uses it in {self.used_by}. Without it: {self.when_missing} Public alternative: {self.public}. "
            "Update optimus/kernels/torch_private.py."
        )


class PrivateTorchMissing(RuntimeError):
    """A private torch name Optimus needs for the feature at hand is missing from this torch."""


PRIVATE_API: dict[str, PrivateName] = {
    "grouped_mm": PrivateName(
        "torch._grouped_mm",
        "optimus/kernels/torch_backend.py (every expert's GEMM in one call, weight gradients included)",
        "torch.nn.functional.grouped_mm (a documented wrapper of torch._grouped_mm, present in torch 2.13 and "
        "2.14): Optimus calls it where it exists and torch._grouped_mm only where it does not",
        "the expert GEMMs run as a per-expert torch.mm loop (the CPU's 16-bit path always does).",
    ),
    "fused_adamw_": PrivateName(
        "torch._fused_adamw_",
        "optimus/optim/adamw.py (AdamW on flat fp32 shards, a chunk at a time)",
        "torch.optim.adamw.adamw(..., fused=True), the functional form, takes the same lists and calls this "
        "kernel (it checks its inputs on every call, and its grad_scale divides where Optimus multiplies)",
        "AdamW runs torch.optim.AdamW's single-tensor arithmetic (equal within 1e-6, slower).",
    ),
    "_get_fused_kernels_supported_devices": PrivateName(
        "torch.utils._foreach_utils._get_fused_kernels_supported_devices",
        "optimus/optim/adamw.py (the device types that have the fused AdamW kernel, as torch.optim.AdamW checks)",
        f"none in torch {CHECKED_TORCH} (torch.optim.AdamW(fused=True) raises on other devices)",
        "no device counts as having the fused kernel: the single-tensor arithmetic everywhere.",
    ),
    "FakeTensor": PrivateName(
        "torch._subclasses.fake_tensor.FakeTensor",
        "optimus/kernels (fake tensors take their shape-only paths) and optimus/host_syncs.py",
        f"none in torch {CHECKED_TORCH} (meta tensors are public, but have no fake device and run no "
        "device's kernel selection)",
        "no tensor counts as fake (a stand-in class nothing is an instance of).",
    ),
    "FakeTensorMode": PrivateName(
        "torch._subclasses.fake_tensor.FakeTensorMode",
        "optimus/dry_run.py (optimus plan --dry-run: one training step on fake tensors)",
        f"none in torch {CHECKED_TORCH}",
        "optimus plan --dry-run stops with this sentence.",
    ),
    "FakeStore": PrivateName(
        "torch.testing._internal.distributed.fake_pg.FakeStore",
        "optimus/dry_run.py (the store of the 'fake' process group; importing its module registers the backend)",
        f"none in torch {CHECKED_TORCH}: torch.distributed.HashStore could replace the store, but only "
        "importing this module registers the 'fake' backend",
        "optimus plan --dry-run stops with this sentence.",
    ),
    "TorchDispatchMode": PrivateName(
        "torch.utils._python_dispatch.TorchDispatchMode",
        "optimus/host_syncs.py (profile.host_syncs, dry runs) and optimus/parallel/collective_trace.py "
        "(profile.collectives, dry runs): they see every aten/c10d operator as it runs",
        f"none in torch {CHECKED_TORCH} (documented in the 'Extending PyTorch' notes, in a private module; "
        "torch.overrides.TorchFunctionMode is public but sees torch functions, not the aten ops under them)",
        "counting host syncs and tracing collectives stop with this sentence when switched on.",
    ),
    "ModTracker": PrivateName(
        "torch.distributed._tools.mod_tracker.ModTracker",
        "optimus/parallel/collective_trace.py (which module, forward or backward, issued each collective)",
        f"none in torch {CHECKED_TORCH} (global module hooks and autograd hooks could rebuild it)",
        "tracing collectives stops with this sentence when switched on.",
    ),
    "ModTracker._fw_pre_hook": PrivateName(
        "torch.distributed._tools.mod_tracker.ModTracker._fw_pre_hook (the global forward pre-hook that hooks a "
        "module's inputs for the end of its backward)",
        "optimus/kernels/torch_private.py leaf_safe_mod_tracker (collective traces and step memory under a "
        "zero-bubble pipeline schedule, whose input pass is an autograd.grad over the stage's leaf inputs)",
        f"none in torch {CHECKED_TORCH}",
        "tracing collectives and a step's memory stop with this sentence when switched on.",
    ),
    "MemTracker": PrivateName(
        "torch.distributed._tools.mem_tracker.MemTracker (and its methods _track, _update_peak_stats, "
        "_pre_fw_hook, attributes _curr_mem_snap, _peak_mem, _peak_mem_snap, _mod_tracker, which Optimus overrides)",
        "optimus/train/step_memory.py (profile.memory and dry runs: a step's memory by category)",
        f"none in torch {CHECKED_TORCH} (torch.profiler's profile_memory counts allocations per op, not by category)",
        "profile.memory and optimus plan --dry-run stop with this sentence.",
    ),
    "_TOTAL_KEY": PrivateName(
        "torch.distributed._tools.mem_tracker._TOTAL_KEY",
        "optimus/train/step_memory.py (the key of a MemTracker snapshot's total)",
        f"none in torch {CHECKED_TORCH}",
        "None (MemTracker is missing with it).",
    ),
    "current_graph_task_id": PrivateName(
        "torch._C._current_graph_task_id",
        "optimus/parallel/collective_trace.py (a collective issued inside the autograd engine is a backward's)",
        f"none in torch {CHECKED_TORCH} (torch.autograd.graph has hooks but no 'is a backward running')",
        "-1 (no backward running): a gradient hook's collectives outside module hooks count as the step's.",
    ),
    "resolve_process_group": PrivateName(
        "torch.distributed.distributed_c10d._resolve_process_group",
        "optimus/parallel/collective_trace.py (a functional collective carries its group's name, not the group)",
        f"none in torch {CHECKED_TORCH}",
        "tracing a functional collective (DTensor's) stops with this sentence.",
    ),
    "LOCAL_SCALAR_DENSE": PrivateName(
        "torch.ops.aten._local_scalar_dense.default",
        "optimus/host_syncs.py (the op behind .item(), bool(t), int(t): a dry run answers it from shapes)",
        f"none in torch {CHECKED_TORCH}: a dispatch mode sees only this op for a value read",
        "None: a dry run cannot answer value reads (it stops at the first one).",
    ),
    "will_engine_execute_node": PrivateName(
        "torch._C._will_engine_execute_node",
        "optimus/kernels/torch_private.py needed_input_grads (the custom Functions of the expert path and the LM "
        "head's loss compute, in a zero-bubble schedule's input and weight passes, only that pass's gradients)",
        f"none in torch {CHECKED_TORCH} (ctx.needs_input_grad is fixed at the forward; torch.autograd.graph's "
        "register_multi_grad_hook calls this name itself)",
        "each pass computes every gradient the forward's inputs need (correct, slower under zero bubble).",
    ),
    "zero_bubble_order": PrivateName(
        "torch.distributed.pipelining.schedules.ScheduleInterleavedZeroBubble._calculate_single_rank_operations "
        "(and the attributes pp_group_size, n_local_stages, _n_microbatches, number_of_rounds, "
        "microbatches_per_round it reads)",
        "optimus/parallel/pipeline.py (optimus plan: the activations a zero-bubble rank holds until each "
        "micro-batch's weight pass, from torch's own order of its actions)",
        f"none in torch {CHECKED_TORCH}: a schedule's public pipeline_order needs its stages and process group",
        "optimus plan stops with this sentence for parallel.pp_schedule=interleaved_zb.",
    ),
    "is_view": PrivateName(
        "torch.Tensor._is_view",
        "optimus/hf/convert.py (an imported checkpoint's per-expert views are copied one by one)",
        f"none in torch {CHECKED_TORCH}; comparing t.untyped_storage().nbytes() with t.nbytes says whether a "
        "tensor holds a larger storage, which is what matters there",
        "that storage comparison.",
    ),
    "process_context": PrivateName(
        "torch.distributed.elastic.multiprocessing.api.MultiprocessContext._pc",
        "optimus/local_launcher.py (each local rank's exit code, to name the rank that failed first)",
        f"none in torch {CHECKED_TORCH} (PContext.wait() reports failures only once torch has reaped them all)",
        "no rank is seen failing before torch's own poll: the launcher names the failure torch reports.",
    ),
    "DTENSOR_COLLECTIVE_LOGGER": PrivateName(
        "the logger of torch.distributed.tensor._collective_utils",
        "optimus/platform.py (drops DTensor's gloo all-to-all fallback message, once per call)",
        f"none in torch {CHECKED_TORCH}",
        "the message shows again (nothing else changes).",
    ),
    "OpOverload._schema": PrivateName(
        "torch._ops.OpOverload._schema and ._overloadpacket",
        "optimus/parallel/collective_trace.py (a c10d operator's arguments by name) and optimus/host_syncs.py",
        f"OpOverload.overloadpacket (public property) for the name; none for the schema in torch {CHECKED_TORCH}",
        "tracing collectives stops with an AttributeError.",
    ),
    "python_backend": PrivateName(
        "torch.utils.backend_registration._setup_privateuseone_for_python_backend, torch._C._acc.PrivateUse1Hooks "
        "and torch._C._get_privateuse1_backend_name",
        "optimus/fake_device.py (the dry run's stand-in device: torch's PrivateUse1 device type as a Python backend, "
        "with the device guard the autograd engine asks for)",
        f"none in torch {CHECKED_TORCH}: torch.utils.rename_privateuse1_backend is public, but without a C++ "
        "extension a backend has no device guard",
        "a dry run of a GPU's path stops with this sentence (--device cpu still runs).",
    ),
    "dispatcher": PrivateName(
        "torch._C.DispatchKey, torch._C.DispatchKeySet, torch._C._ExcludeDispatchKeyGuard, "
        "torch._C._dispatch_has_kernel_for_dispatch_key and torch._C._dispatch_get_registrations_for_dispatch_key",
        "optimus/fake_device.py (the stand-in's autocast: which operators torch's AutocastCUDA / AutocastXPU "
        "kernels cover, and the call below the stand-in's own autocast)",
        f"none in torch {CHECKED_TORCH}: torch.library.register_autocast registers a custom operator's autocast, "
        "not an aten operator's for another device",
        "a dry run of a GPU's path stops with this sentence (--device cpu still runs).",
    ),
    "dispatch_modes": PrivateName(
        "torch.utils._python_dispatch._disable_current_modes and _get_current_dispatch_mode_stack",
        "optimus/fake_device.py (the autocast probe runs outside the step's modes; the stand-in's allocations "
        "belong to the active fake mode)",
        f"none in torch {CHECKED_TORCH}",
        "a dry run of a GPU's path stops with this sentence (--device cpu still runs).",
    ),
    "fused_attention": PrivateName(
        "torch.ops.aten._scaled_dot_product_flash_attention and _scaled_dot_product_fused_attention_overrideable",
        "optimus/fake_device.py (the fused attention kernel a GPU's SDPA picks, run on the stand-in)",
        "torch.nn.functional.scaled_dot_product_attention, which picks a kernel per device in C++ and on the "
        "stand-in would take the math path",
        "a dry run of a GPU's path stops with this sentence (--device cpu still runs).",
    ),
    "storage_id": PrivateName(
        "torch.UntypedStorage._cdata",
        "optimus/parallel/flat_buffer.py (whether two tensors share a storage, on fake tensors too)",
        "untyped_storage().data_ptr(), which a fake tensor's storage does not have (a warning, then an error)",
        "tensors never count as sharing a storage: the optimizer copies parameters it could have adopted.",
    ),
    "pipeline_recv_buffers": PrivateName(
        "torch.distributed.pipelining.stage._RecvInfo (.buffer, .is_root_arg) and PipelineStage's args_recv_info, "
        "grad_recv_info and the methods Optimus's stage overrides (PIPELINE_STAGE_METHODS)",
        "optimus/parallel/pipeline_stage.py (a stage's receive buffers held only while their micro-batch needs "
        "them, not one per micro-batch of the step for the whole run)",
        f"none in torch {CHECKED_TORCH}: PipelineStage allocates its buffers itself and exposes no hook for it",
        "the stages keep torch's buffers (one per micro-batch and received tensor, for the whole run) and the "
        "memory plan counts them.",
    ),
    "sharding_metadata": PrivateName(
        "torch.distributed.tensor._sharding_prop.ShardingPropagator._propagate_tensor_meta_non_cached",
        "optimus/dry_run.py (DTensor's output-shape propagation, which makes global-shape tensors in the fake "
        "mode it finds active, runs apart from the step's recorders, as in a real run's own fake mode)",
        f"none in torch {CHECKED_TORCH}",
        "a dry run counts each tensor-parallel operator's global-shape metadata tensors as memory (a few GiB "
        "too high on a wide tensor-parallel model).",
    ),
    "default_backend": PrivateName(
        "torch.distributed.ProcessGroup._set_default_backend and ProcessGroup.BackendType.CUSTOM",
        "optimus/dry_run.py (a device path's dry run joins a group of one plugin backend for two device types, "
        "'cpu:fake,xpu:fake', where init_process_group sets no default backend, the plugin being registered as "
        "'FAKE' and named 'fake': destroying the group then logs 'No backend of type 0 found')",
        f"none in torch {CHECKED_TORCH}",
        "a device path's dry run prints torch's warning line when it ends.",
    ),
    "Module._modules": PrivateName(
        "torch.nn.Module._modules",
        "optimus/parallel/pipeline.py (a cut stage lists its modules in the whole model's order, the order of "
        "the optimizer's flat buffers)",
        "delattr then add_module, one name at a time, in the order wanted",
        "cutting stages fails (no torch release has changed it).",
    ),
}


def _stand_in(name: str) -> type:
    """A class for a missing private class: subclassing it works, instantiating it raises, nothing is an instance."""

    def refuse(self, *args, **kwargs):
        raise PrivateTorchMissing(PRIVATE_API[name].moved())

    doc = f"Missing from this torch: {PRIVATE_API[name].torch_name}"
    return type(name, (), {"__init__": refuse, "__doc__": doc, "optimus_stand_in": True})


def _attribute(module: str, attr: str) -> Any:
    """`module.attr`, or None where this torch lacks either."""
    try:
        return getattr(importlib.import_module(module), attr)
    except (ImportError, AttributeError):
        return None


def _class(module: str, attr: str, name: str) -> type:
    return _attribute(module, attr) or _stand_in(name)


# ---- kernels

# `torch.nn.functional.grouped_mm` is torch._grouped_mm behind a documented name; the private op is the fallback.
# [A, K] x [E, K, N] -> [A, N] (rows grouped by `offs`, each group's end row), or [K, A] x [A, N] -> [E, K, N].
grouped_mm: Callable[..., torch.Tensor] | None = getattr(torch.nn.functional, "grouped_mm", None)
if grouped_mm is None and hasattr(torch, "_grouped_mm"):

    def grouped_mm(mat_a: torch.Tensor, mat_b: torch.Tensor, *, offs: torch.Tensor | None = None) -> torch.Tensor:
        return torch._grouped_mm(mat_a, mat_b, offs)


FakeTensor: type = _class("torch._subclasses.fake_tensor", "FakeTensor", "FakeTensor")
FakeTensorMode: type = _class("torch._subclasses.fake_tensor", "FakeTensorMode", "FakeTensorMode")

# ---- the stand-in device (optimus/fake_device.py)

setup_python_backend: Callable | None = _attribute(
    "torch.utils.backend_registration", "_setup_privateuseone_for_python_backend"
)
PrivateUse1Hooks: type = getattr(getattr(torch._C, "_acc", None), "PrivateUse1Hooks", None) or _stand_in(
    "python_backend"
)
DispatchKey = getattr(torch._C, "DispatchKey", None)
DispatchKeySet = getattr(torch._C, "DispatchKeySet", None)
ExcludeDispatchKeyGuard = getattr(torch._C, "_ExcludeDispatchKeyGuard", None)
dispatch_has_kernel: Callable[[str, str], bool] | None = getattr(
    torch._C, "_dispatch_has_kernel_for_dispatch_key", None
)
dispatch_registrations: Callable[[str], list[str]] | None = getattr(
    torch._C, "_dispatch_get_registrations_for_dispatch_key", None
)
disable_current_modes: Callable | None = _attribute("torch.utils._python_dispatch", "_disable_current_modes")
current_dispatch_modes: Callable | None = _attribute("torch.utils._python_dispatch", "_get_current_dispatch_mode_stack")
SDPA_FLASH = getattr(torch.ops.aten, "_scaled_dot_product_flash_attention", None)
SDPA_FUSED_OVERRIDEABLE = getattr(torch.ops.aten, "_scaled_dot_product_fused_attention_overrideable", None)
TO_COPY = torch.ops.aten._to_copy.default  # (what every dtype conversion dispatches to; in every torch)


def privateuse1_backend_name() -> str:
    """The name torch's PrivateUse1 device type answers to (`privateuseone` until a backend renames it)."""
    get = getattr(torch._C, "_get_privateuse1_backend_name", None)
    if get is None:
        raise PrivateTorchMissing(PRIVATE_API["python_backend"].moved())
    return get()


def stand_in_api_missing() -> list[str]:
    """The sentences of the private names the stand-in device needs that this torch lacks."""
    return [PRIVATE_API[name].moved() for name in ("python_backend", "dispatcher", "dispatch_modes",
                                                   "fused_attention") if not found(name)]  # fmt: skip


def storage_id(t: torch.Tensor) -> int | None:
    """An identity of `t`'s storage, equal for tensors that share it (None where this torch hides it)."""
    return getattr(t.untyped_storage(), "_cdata", None)


# ---- optimizer

fused_adamw_: Callable | None = getattr(torch, "_fused_adamw_", None)
_get_fused_kernels_supported_devices: Callable[[], list[str]] = _attribute(
    "torch.utils._foreach_utils", "_get_fused_kernels_supported_devices"
) or (lambda: [])

# ---- diagnostics: host syncs, collectives, memory, dry runs

TorchDispatchMode: type = _class("torch.utils._python_dispatch", "TorchDispatchMode", "TorchDispatchMode")
LOCAL_SCALAR_DENSE = getattr(getattr(torch.ops.aten, "_local_scalar_dense", None), "default", None)
DTENSOR_COLLECTIVE_LOGGER = "torch.distributed.tensor._collective_utils"


def current_graph_task_id() -> int:
    """The autograd engine's running graph task on this thread, -1 outside a backward."""
    get = getattr(torch._C, "_current_graph_task_id", None)
    return -1 if get is None else get()


def resolve_process_group(group_name: str):
    """The ProcessGroup of `group_name` (the name a functional collective carries)."""
    import torch.distributed as dist

    resolve = getattr(dist.distributed_c10d, "_resolve_process_group", None)
    if resolve is None:
        raise PrivateTorchMissing(PRIVATE_API["resolve_process_group"].moved())
    return resolve(group_name)


def needed_input_grads(ctx) -> tuple[bool, ...]:
    """For each input of the custom autograd Function whose backward is running (`ctx`), whether this backward
    needs its gradient: `ctx.needs_input_grad` (fixed when the forward ran) narrowed by the engine's plan for the
    running backward. Zero bubble's input pass (`autograd.grad` towards the stage's inputs) plans no weight's
    accumulator, and its weight pass (towards the weights) no input's path, so each pass computes its own half;
    torch's own operators already skip the other half, a custom Function learns it here. Where torch lacks the
    engine query, everything `needs_input_grad` says (correct, with each half computed in both passes)."""
    will_execute = getattr(torch._C, "_will_engine_execute_node", None)
    if will_execute is None:
        return tuple(ctx.needs_input_grad)
    return tuple(
        need and _engine_runs(will_execute, node) for need, (node, _) in zip(ctx.needs_input_grad, ctx.next_functions)
    )


def _engine_runs(will_execute, node) -> bool:
    if node is None:
        return False
    try:
        return bool(will_execute(node))
    except RuntimeError:  # the engine refuses to answer for a leaf that the running autograd.grad returns:
        return True  # such a leaf's gradient is what it computes


@functools.cache
def zero_bubble_order(pp: int, pp_virtual: int, n_micro_batches: int, rank: int) -> tuple[tuple[str, int], ...]:
    """Pipeline rank `rank`'s computations in the order torch's ScheduleInterleavedZeroBubble runs them, as
    (type "F", "I" or "W", stage index; "B", a full backward, should a later torch mix one in), computed as its
    __init__ does from four numbers, without stages or a process group; once per four numbers, as the planner
    walks it for every stage's memory."""
    from torch.distributed.pipelining.schedules import ScheduleInterleavedZeroBubble

    schedule = ScheduleInterleavedZeroBubble.__new__(ScheduleInterleavedZeroBubble)
    rounds = max(1, n_micro_batches // pp)
    schedule.pp_group_size, schedule.n_local_stages, schedule._n_microbatches = pp, pp_virtual, n_micro_batches
    schedule.number_of_rounds, schedule.microbatches_per_round = rounds, n_micro_batches // rounds
    calculate = getattr(schedule, "_calculate_single_rank_operations", None)
    if calculate is None:
        raise PrivateTorchMissing(PRIVATE_API["zero_bubble_order"].moved())
    return tuple((_ACTION_LETTERS[a.computation_type.name], a.stage_index) for a in calculate(rank) if a is not None)


_ACTION_LETTERS = {"FORWARD": "F", "FULL_BACKWARD": "B", "BACKWARD_INPUT": "I", "BACKWARD_WEIGHT": "W"}


def is_view(t: torch.Tensor) -> bool:
    """Whether `t` is a view of another tensor's storage."""
    view = getattr(t, "_is_view", None)
    return view() if view is not None else t.untyped_storage().nbytes() > t.nbytes


def process_context_processes(context) -> list:
    """The multiprocessing.Process of each local rank of torch.distributed.elastic's `start_processes`, or []."""
    processes = getattr(getattr(context, "_pc", None), "processes", None)
    return list(processes) if processes is not None else []


def set_custom_default_backend(pg) -> None:
    """Make `pg`'s plugin backend its default (see PRIVATE_API["default_backend"]); nothing where torch lacks it."""
    set_default = getattr(pg, "_set_default_backend", None)
    custom = getattr(getattr(type(pg), "BackendType", None), "CUSTOM", None)
    if set_default is not None and custom is not None:
        set_default(custom)


def leaf_safe_mod_tracker():
    """A new ModTracker whose backward bookkeeping survives a pipeline's input pass (see
    PRIVATE_API["ModTracker._fw_pre_hook"]).

    ModTracker learns that a module's backward has ended from a gradient hook on the module's inputs, which asks
    the autograd engine whether it will run each input's node; for a leaf (a pipeline stage's received
    activations) the engine refuses to say inside `autograd.grad`, which zero bubble's input pass is. Here a
    module's leaf inputs are not hooked: a module whose only inputs needing gradients are leaves (a stage's
    root) is closed when its backward has run, by the tracker's end-of-backward callback, as it closes a module
    with no input needing one."""
    return _leaf_safe_mod_tracker_class()()


@functools.cache
def _leaf_safe_mod_tracker_class() -> type:
    """The ModTracker subclass, built once: torch's class is looked up only when a trace first needs it."""
    tracker = __getattr__("ModTracker")
    if not hasattr(tracker, "_fw_pre_hook"):
        raise PrivateTorchMissing(PRIVATE_API["ModTracker._fw_pre_hook"].moved())

    class LeafSafeModTracker(tracker):
        def _fw_pre_hook(self, mod, input):
            hooked = torch.utils._pytree.tree_map_only(torch.Tensor, _unless_leaf_needing_grad, input)
            return super()._fw_pre_hook(mod, hooked)

    return LeafSafeModTracker


def _unless_leaf_needing_grad(t: torch.Tensor) -> torch.Tensor | None:
    return None if t.is_leaf and t.requires_grad else t


# Loaded on first use: only diagnostic tools need them, and their modules import more of torch.distributed.
_LAZY = {
    "ModTracker": ("torch.distributed._tools.mod_tracker", "ModTracker"),
    "MemTracker": ("torch.distributed._tools.mem_tracker", "MemTracker"),
    "_TOTAL_KEY": ("torch.distributed._tools.mem_tracker", "_TOTAL_KEY"),
    "FakeStore": ("torch.testing._internal.distributed.fake_pg", "FakeStore"),
    "ShardingPropagator": ("torch.distributed.tensor._sharding_prop", "ShardingPropagator"),
}


def __getattr__(name: str) -> Any:
    if name not in _LAZY:
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
    value = _attribute(*_LAZY[name])
    if value is None and name != "_TOTAL_KEY":
        value = _stand_in(name)
    globals()[name] = value
    return value


# ---- presence: whether this torch has each name where Optimus looks for it

# What Optimus overrides or reads on torch's MemTracker besides its public methods.
MEM_TRACKER_INTERNALS = ("_track", "_update_peak_stats", "_pre_fw_hook", "_curr_mem_snap", "_peak_mem",
                         "_peak_mem_snap", "_mod_tracker")  # fmt: skip
# What optimus.parallel.pipeline_stage.Stage overrides on torch's PipelineStage.
PIPELINE_STAGE_METHODS = ("_prepare_forward_infra", "_prepare_backward_infra", "get_fwd_recv_ops", "get_bwd_recv_ops",
                          "set_local_bwd_input", "forward_one_chunk", "backward_one_chunk",
                          "backward_weight_one_chunk")  # fmt: skip


def _has(module: str, *attrs: str) -> bool:
    obj = _attribute(module, attrs[0])
    return obj is not None and all(hasattr(obj, a) for a in attrs[1:])


def _source_has(module: str, attr: str, text: str) -> bool:
    import inspect

    obj = _attribute(module, attr)
    try:
        return obj is not None and text in inspect.getsource(obj)
    except (OSError, TypeError):
        return False


def _instance_has(where: tuple[str, str], attrs: tuple[str, ...]) -> bool:
    """Whether a new instance of the class at `where` (module, name) has every one of `attrs`."""
    cls = _attribute(*where)
    return cls is not None and all(hasattr(cls(), a) for a in attrs)


_PROBES: dict[str, Callable[[], bool]] = {
    "grouped_mm": lambda: grouped_mm is not None,
    "fused_adamw_": lambda: fused_adamw_ is not None,
    "_get_fused_kernels_supported_devices": lambda: _has(
        "torch.utils._foreach_utils", "_get_fused_kernels_supported_devices"
    ),
    "FakeTensor": lambda: _has("torch._subclasses.fake_tensor", "FakeTensor"),
    "FakeTensorMode": lambda: _has("torch._subclasses.fake_tensor", "FakeTensorMode"),
    "FakeStore": lambda: _has(*_LAZY["FakeStore"]),
    "TorchDispatchMode": lambda: _has("torch.utils._python_dispatch", "TorchDispatchMode"),
    "ModTracker": lambda: _instance_has(_LAZY["ModTracker"], ("parents", "is_bw", "get_known_fqn")),
    "ModTracker._fw_pre_hook": lambda: _has(*_LAZY["ModTracker"], "_fw_pre_hook"),
    "MemTracker": lambda: _instance_has(_LAZY["MemTracker"], MEM_TRACKER_INTERNALS),
    "_TOTAL_KEY": lambda: _has(*_LAZY["_TOTAL_KEY"]),
    "current_graph_task_id": lambda: hasattr(torch._C, "_current_graph_task_id"),
    "resolve_process_group": lambda: _has("torch.distributed.distributed_c10d", "_resolve_process_group"),
    "LOCAL_SCALAR_DENSE": lambda: LOCAL_SCALAR_DENSE is not None,
    "will_engine_execute_node": lambda: hasattr(torch._C, "_will_engine_execute_node"),
    "zero_bubble_order": lambda: _has(
        "torch.distributed.pipelining.schedules", "ScheduleInterleavedZeroBubble", "_calculate_single_rank_operations"
    ),
    "is_view": lambda: hasattr(torch.Tensor, "_is_view"),
    "process_context": lambda: _source_has(
        "torch.distributed.elastic.multiprocessing.api", "MultiprocessContext", "self._pc ="
    ),
    "DTENSOR_COLLECTIVE_LOGGER": lambda: importlib.util.find_spec(DTENSOR_COLLECTIVE_LOGGER) is not None,
    "OpOverload._schema": lambda: all(
        hasattr(torch.ops.aten.add.Tensor, a) for a in ("_schema", "_overloadpacket", "namespace")
    ),
    "pipeline_recv_buffers": lambda: (
        _source_has("torch.distributed.pipelining.stage", "_RecvInfo", "self.buffer = buffer")
        and _source_has("torch.distributed.pipelining.stage", "_RecvInfo", "self.is_root_arg")
        and all(
            _source_has("torch.distributed.pipelining.stage", "_PipelineStageBase", f"self.{slots}[")
            for slots in ("args_recv_info", "grad_recv_info")
        )
        and _has("torch.distributed.pipelining.stage", "PipelineStage", *PIPELINE_STAGE_METHODS)
    ),
    "sharding_metadata": lambda: _has(*_LAZY["ShardingPropagator"], "_propagate_tensor_meta_non_cached"),
    "default_backend": lambda: (
        _has("torch.distributed", "ProcessGroup", "_set_default_backend", "BackendType")
        and hasattr(_attribute("torch.distributed", "ProcessGroup").BackendType, "CUSTOM")
    ),
    "Module._modules": lambda: isinstance(getattr(torch.nn.Module(), "_modules", None), dict),
    "python_backend": lambda: (
        setup_python_backend is not None
        and hasattr(getattr(torch._C, "_acc", None), "PrivateUse1Hooks")
        and hasattr(torch._C, "_get_privateuse1_backend_name")
    ),
    "dispatcher": lambda: (
        None not in (DispatchKey, DispatchKeySet, ExcludeDispatchKeyGuard, dispatch_has_kernel)
        and dispatch_registrations is not None
        and hasattr(DispatchKey, "AutocastPrivateUse1")
    ),
    "dispatch_modes": lambda: disable_current_modes is not None and current_dispatch_modes is not None,
    "fused_attention": lambda: SDPA_FLASH is not None and SDPA_FUSED_OVERRIDEABLE is not None,
    "storage_id": lambda: isinstance(storage_id(torch.zeros(1)), int),
}


def found(name: str) -> bool:
    """Whether this torch has PRIVATE_API[name] where Optimus looks for it."""
    return _PROBES[name]()


def missing() -> list[str]:
    """The sentence of every name of PRIVATE_API this torch lacks (empty on the torch versions CI runs)."""
    return [PRIVATE_API[name].moved() for name in PRIVATE_API if not found(name)]
