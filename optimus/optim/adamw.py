"""AdamW on flat fp32 shards: torch's fused AdamW kernel where the device has one, else step for step the
arithmetic of torch.optim.AdamW's single-tensor path (the two agree within 1e-6; tests/optim/test_adamw.py)."""

from __future__ import annotations

import functools
from dataclasses import dataclass

import torch

from optimus.kernels.torch_private import _get_fused_kernels_supported_devices, fused_adamw_
from optimus.parallel.flat_buffer import Segment

# Elements updated at a time: a chunk's fp32 temporaries (4 MiB each) stay in cache between the passes over it.
# The fused kernel on 11.3M elements (the default model) with bf16 gradients, 2 EPYC cores: 8.8 ms in chunks
# of 2^20, 10.4 at 2^18, 18.0 at 2^22, 23.9 whole; the single-tensor arithmetic in chunks of 2^20: 23.2 ms.
UPDATE_CHUNK = 2**20


@dataclass
class AdamWHyper:
    beta1: float
    beta2: float
    eps: float
    weight_decay: float


def fused_kernel_available(device: torch.device) -> bool:
    """Whether torch has a fused AdamW kernel for `device`."""
    return fused_adamw_ is not None and device.type in _get_fused_kernels_supported_devices()


@torch.no_grad()
def adamw_update(
    segments: list[Segment],
    param_N: torch.Tensor,  # fp32 slice being updated (master copy, or the fp32 parameters themselves)
    grad_N: torch.Tensor,  # summed gradient shard, in the parameter dtype
    exp_avg_N: torch.Tensor,
    exp_avg_sq_N: torch.Tensor,
    lr: float,
    step: int,
    h: AdamWHyper,
    grad_scale: float,  # 1 / world x clip factor, applied in fp32
    fused: bool | None = None,  # None: the fused kernel where the device has one
) -> None:
    """One decoupled-weight-decay Adam step on each segment (decay only where the segment says so).

    The gradient is scaled in fp32 (in place when it is fp32: it is used once).
    """
    if fused is None:
        fused = fused_kernel_available(param_N.device)
    if fused:  # the kernel reads the step count from a tensor on the device: one for every chunk of the call,
        # filled there (torch.tensor(step, device=...) would be a blocking copy from the host, which waits for
        # the whole queue on a GPU)
        step_fn = functools.partial(_fused_chunk, step=torch.full((), float(step), device=param_N.device))
    else:
        step_fn = functools.partial(_single_tensor_chunk, step=step)
    # In chunks: a 16-bit gradient's fp32 copy (and the fallback's sqrt and denominator) would otherwise be as
    # large as a segment, which can hold all of a rank's expert weights; a chunk also stays in cache.
    chunks = (
        (lo, min(lo + UPDATE_CHUNK, seg.hi), seg) for seg in segments for lo in range(seg.lo, seg.hi, UPDATE_CHUNK)
    )
    for lo, hi, seg in chunks:
        weight_decay = h.weight_decay if seg.weight_decay else 0.0
        chunk = (param_N[lo:hi], grad_N[lo:hi].float(), exp_avg_N[lo:hi], exp_avg_sq_N[lo:hi])
        step_fn(*chunk, lr=lr, h=h, weight_decay=weight_decay, grad_scale=grad_scale)


def _fused_chunk(p, g, m, v, *, lr, step: torch.Tensor, h: AdamWHyper, weight_decay: float, grad_scale: float):
    """torch's fused kernel on the chunk (`step`: the step count as a tensor on the device). The gradient is
    scaled first, by a multiplication as the single-tensor path does (the kernel's own `grad_scale` divides,
    which a zero factor, from an infinite norm, cannot)."""
    if grad_scale != 1.0:
        g.mul_(grad_scale)
    fused_adamw_(
        [p], [g], [m], [v], [], [step],
        lr=lr, beta1=h.beta1, beta2=h.beta2, weight_decay=weight_decay, eps=h.eps,
        amsgrad=False, maximize=False, grad_scale=None, found_inf=None,
    )  # fmt: skip


def _single_tensor_chunk(p, g, m, v, *, lr: float, step: int, h: AdamWHyper, weight_decay: float, grad_scale: float):
    """torch.optim.AdamW's single-tensor arithmetic, one op per pass."""
    g.mul_(grad_scale)
    p.mul_(1 - lr * weight_decay)
    m.lerp_(g, 1 - h.beta1)
    v.mul_(h.beta2).addcmul_(g, g, value=1 - h.beta2)
    denom = (v.sqrt() / (1 - h.beta2**step) ** 0.5).add_(h.eps)
    p.addcdiv_(m, denom, value=-lr / (1 - h.beta1**step))


class AdamW:
    """The AdamW update rule on the fp32 slices a sharder owns: two fp32 moments per owned element, in one
    flat tensor per parameter group, indexed like the group's shard (optimus.optim.shard_group.OwnedSlice.lo)."""

    name = "adamw"  # optim.update
    state_kinds = ("exp_avg", "exp_avg_sq")
    state_bytes_per_element = 8  # two fp32 moments

    def __init__(self, hyper: AdamWHyper, shard_numels: dict[str, tuple[int, torch.device]]):
        """`shard_numels`: {group: (elements of this rank's shard, device)}."""
        self.hyper = hyper
        self.state = {
            group: {kind: torch.zeros(numel, dtype=torch.float32, device=device) for kind in self.state_kinds}
            for group, (numel, device) in shard_numels.items()
        }

    def step(self, sharder, lr: float, step: int, grad_scale: float) -> None:
        """One step on every slice `sharder` (an optimus.optim.sharder.GradSharder) says this rank owns."""
        for owned in sharder.owned_slices():
            self.update(owned, lr, step, grad_scale)

    def step_bytes(self, sharder) -> tuple[int, int]:
        """(working bytes, bytes received by its own collectives) of one step: AdamW works in place, alone."""
        return 0, 0

    def update(self, owned, lr: float, step: int, grad_scale: float) -> None:
        """One step on `owned` (an OwnedSlice): its gradient times `grad_scale` (1 / replicas x clip factor)."""
        n = owned.param.numel()
        m, v = (self.state[owned.group][kind][owned.lo : owned.lo + n] for kind in self.state_kinds)
        adamw_update(owned.segments, owned.param, owned.grad, m, v, lr, step, self.hyper, grad_scale)

    def tensors(self) -> list[torch.Tensor]:
        return [t for group in self.state.values() for t in group.values()]
