"""Expert-path, RMSNorm and RoPE kernels behind one interface, chosen by the `kernels` config key.

A backend provides three differentiable operations (see `reference.py` for the
shapes and the exact meaning of each):

    permute(x_TD, token_idx_A) -> x_AD
    expert_swiglu_mlp(x_AD, w13_EDF2, w2_EFD, offsets_E) -> y_AD
    combine(y_AD, token_idx_A, weight_A, n_tokens) -> out_TD

and `grouped_mm(x_AK, w_EKN, offsets_E) -> y_AN`, the plain grouped GEMM; beside them, the arithmetic of
every RMSNorm of the model (`rms_norm`: see `rms_norm.py`) and the rotation of its RoPE (`rope`: see `rope.py`),
which are memory-bound as the expert path's permutations are.

Backends: `torch` (plain PyTorch, fastest on CPUs), `triton` (portable Triton kernels,
optional: imported only when chosen), `auto` (triton on a GPU where it compiles, else torch).
Triton is never imported by `import optimus.kernels`.
"""

from __future__ import annotations

import functools
import importlib.util
import os
from collections.abc import Callable
from dataclasses import dataclass

import torch

from optimus.kernels.rms_norm import TORCH_NORM, NormArithmetic
from optimus.kernels.rope import Rotate, torch_rotate

BACKENDS = ("auto", "torch", "triton")

# F-wide rows (F = expert_dim) the expert MLP keeps per routed row for its backward, in the compute dtype: the
# torch backend keeps h13 = x @ w13 (2F), silu(gate) and h; Triton's keeps h13 and h (optimus.plan counts them).
SAVED_FFN_WIDTHS = {"torch": 4, "triton": 3}


class KernelUnavailable(ValueError):
    """The `kernels` backend asked for cannot run here; the message says what to change.

    A ValueError of its own, not optimus.config.ConfigError: kernels imports nothing of optimus
    outside itself, and the model translates it where a config's `kernels` key arrives.
    """


@dataclass(frozen=True)
class KernelBackend:
    name: str
    permute: Callable
    expert_swiglu_mlp: Callable
    combine: Callable
    grouped_mm: Callable
    rms_norm: NormArithmetic
    rope: Rotate


def triton_importable() -> bool:
    """Whether `import triton` works (without importing it when it is not installed)."""
    try:
        if importlib.util.find_spec("triton") is None:
            return False
        import triton  # noqa: F401
    except Exception:  # a broken install (e.g. missing driver libraries) counts as absent
        return False
    return True


def gpu_present() -> bool:
    """A CUDA/ROCm or Intel XPU device is visible to torch."""
    xpu = getattr(torch, "xpu", None)
    return torch.cuda.is_available() or (xpu is not None and xpu.is_available())


@functools.cache
def triton_compiles() -> bool:
    """Whether Triton compiles and runs a small kernel on this machine's GPU (checked once)."""
    try:
        from optimus.kernels import triton_backend

        return triton_backend.smoke_test()
    except Exception:
        return False


def _torch_backend(reads=None) -> KernelBackend:
    """`reads` (a dry run's optimus.kernels.host_reads.RowReads) answers the per-expert loops' row bounds."""
    from optimus.kernels import torch_backend as tb

    if reads is None:
        return KernelBackend(
            "torch", tb.permute, tb.expert_swiglu_mlp, tb.combine, tb.grouped_mm_op, TORCH_NORM, torch_rotate
        )
    mlp, grouped_mm = (
        functools.partial(tb.expert_swiglu_mlp, reads=reads),
        functools.partial(tb.grouped_mm_op, reads=reads),
    )
    return KernelBackend("torch", tb.permute, mlp, tb.combine, grouped_mm, TORCH_NORM, torch_rotate)


def _triton_backend() -> KernelBackend:
    from optimus.kernels import triton_backend as tb

    return KernelBackend(
        "triton", tb.permute, tb.expert_swiglu_mlp, tb.combine, tb.grouped_mm, tb.RMS_NORM, tb.rope_rotate
    )


def resolve_name(name: str = "auto", device_type: str | None = None, traced: bool = False) -> str:
    """The backend (`torch` or `triton`) that `kernels=<name>` means on a device of `device_type` (the type of the
    expert path's tensors; None: this machine's GPU where it has one, else `cpu`).

    `auto` is torch on a CPU and triton on an accelerator where Triton compiles. `traced`: no kernel runs (a dry
    run on fake tensors, or a plan): Triton's operators need no GPU there (their fake implementations run), and
    whether it compiles on the device cannot be known here, so `auto` takes it wherever it imports, as on a GPU
    where it compiles. Refuses, in one sentence, a name that is no backend or a backend that cannot run here.
    """
    if name not in BACKENDS:
        raise KernelUnavailable(f"kernels={name!r} is not a kernel backend; use one of {', '.join(BACKENDS)}.")
    if device_type is None:
        device_type = "cpu" if not gpu_present() else ("xpu" if not torch.cuda.is_available() else "cuda")
    if name == "triton":
        if not triton_importable():
            raise KernelUnavailable(
                "kernels=triton needs the triton package, which cannot be imported here: "
                "install it with `pip install triton` (or set kernels=torch)."
            )
        if device_type == "cpu" and not traced and os.environ.get("TRITON_INTERPRET") != "1":
            raise KernelUnavailable(
                "kernels=triton needs a GPU and none is visible: set kernels=torch on CPUs "
                "(or TRITON_INTERPRET=1 to run the kernels in Triton's slow interpreter)."
            )
        return "triton"
    if name == "auto" and device_type != "cpu" and triton_importable() and (traced or triton_compiles()):
        return "triton"
    return "torch"


def get_backend(name: str = "auto", device_type: str | None = None, traced: bool = False, reads=None) -> KernelBackend:
    """The backend for `kernels=<name>` on a device of `device_type` (resolve_name); `reads`: a dry run's answers
    to the torch backend's reads of row bounds (optimus.kernels.host_reads.RowReads; Triton's kernels read
    none)."""
    return _triton_backend() if resolve_name(name, device_type, traced) == "triton" else _torch_backend(reads)
