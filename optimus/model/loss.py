"""Cross-entropy fused with the LM head: the [tokens, vocab] logits are never materialised in fp32.

The plain path, `F.cross_entropy((h @ W.T).float(), targets)`, writes the logits in the compute
dtype, copies them to fp32, keeps the fp32 log-softmax for the backward and makes two more [T, V]
fp32 tensors there; with an 8192-token vocabulary that elementwise work took 0.8x the time of the LM
head's three GEMMs on one EPYC core. Here the rows go through in chunks small enough to stay in
cache: each chunk's logits are made, reduced to their log-sum-exp and turned at once into the
gradient of the loss with respect to them, softmax - one_hot, stored in the compute dtype (the plain
path also casts that gradient to the compute dtype before its GEMMs). The backward is then two GEMMs
over that stored gradient, scaled by the incoming per-token gradient.

Values are those of the plain path: fp32 log-sum-exp of the compute-dtype logits; gradients
that differ only by the order in which the same fp32 terms are rounded.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor

from optimus.kernels.torch_private import needed_input_grads

# Rows per chunk: a chunk's fp32 logits (rows x vocab x 4 bytes) stay in the last-level cache, and
# the chunk's GEMM has enough rows to run near the rate of the whole one: 256 rows of an 8192-word
# vocabulary (8 MiB). Measured steps of the default run, one EPYC core: 256 rows 1.5% faster than
# 64 (2 MiB, a core's L2), 3% faster than 1024. Larger vocabularies get fewer rows.
CHUNK_BYTES = 8 * 2**20
MIN_CHUNK_ROWS = 16


def chunk_rows(vocab_size: int) -> int:
    return max(MIN_CHUNK_ROWS, CHUNK_BYTES // (4 * vocab_size))


class _LinearCrossEntropy(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx, h_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor, grad_enabled: bool
    ) -> torch.Tensor:
        T, V = h_TD.shape[0], weight_VD.shape[0]
        # needs_input_grad says only whether the inputs require grad, also under no_grad (an evaluation):
        # the caller's grad mode decides whether the [T, V] gradient is worth making.
        needs_grad = grad_enabled and (ctx.needs_input_grad[0] or ctx.needs_input_grad[1])
        loss_T = torch.empty(T, dtype=torch.float32, device=h_TD.device)
        # d loss_t / d logits_t for a unit incoming gradient, in the compute dtype
        grad_TV = torch.empty(T, V, dtype=h_TD.dtype, device=h_TD.device) if needs_grad else None
        rows = chunk_rows(V)
        weight_DV = weight_VD.t()
        for start in range(0, T, rows):
            end = min(start + rows, T)
            logits_CV = torch.mm(h_TD[start:end], weight_DV).float()  # [C, V]; a copy, free to overwrite
            targets_C1 = targets_T[start:end, None]
            max_C1 = logits_CV.amax(dim=-1, keepdim=True)
            shifted_CV = logits_CV.sub_(max_C1)  # exp of the shifted logits cannot overflow
            target_C = shifted_CV.gather(1, targets_C1).squeeze(1)
            exp_CV = shifted_CV.exp_()
            sum_C1 = exp_CV.sum(dim=-1, keepdim=True)
            loss_T[start:end] = sum_C1.log().squeeze(1) - target_C  # log-sum-exp minus the target's logit
            if grad_TV is not None:
                probs_CV = exp_CV.div_(sum_C1)
                probs_CV.scatter_add_(1, targets_C1, probs_CV.new_full((end - start, 1), -1.0))
                grad_TV[start:end] = probs_CV
                del probs_CV
            del logits_CV, shifted_CV, exp_CV  # free this chunk before the next one's GEMM: one alive, not two
        if grad_TV is not None:
            ctx.save_for_backward(h_TD, weight_VD, grad_TV)
        return loss_T

    @staticmethod
    def backward(ctx, grad_loss_T: torch.Tensor):
        h_TD, weight_VD, grad_TV = ctx.saved_tensors
        scale_T1 = grad_loss_T.float()[:, None]
        grad_h = grad_weight = None
        needs_h, needs_weight = needed_input_grads(ctx)[:2]  # under zero bubble, one each pass
        if needs_h:
            grad_h = (torch.mm(grad_TV, weight_VD).float() * scale_T1).to(h_TD.dtype)  # [T, D]
        if needs_weight:
            scaled_h_TD = (h_TD.float() * scale_T1).to(h_TD.dtype)
            grad_weight = torch.mm(grad_TV.t(), scaled_h_TD).to(weight_VD.dtype)  # [V, D]
        return grad_h, grad_weight, None, None


def linear_cross_entropy(h_TD: torch.Tensor, weight_VD: torch.Tensor, targets_T: torch.Tensor) -> torch.Tensor:
    """Per-token cross-entropy [T] (fp32) of the logits `h_TD @ weight_VD.T` against `targets_T`.

    Computes the logits in autocast's dtype when autocast is on (as `F.linear` would), else in
    the inputs' dtype. Reduce the result as needed (`.mean()`, weighted sums); padding rows are
    dropped by zero weights there.
    """
    device_type = h_TD.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else h_TD.dtype
    with torch.autocast(device_type, enabled=False):
        return _LinearCrossEntropy.apply(h_TD.to(dtype), weight_VD.to(dtype), targets_T, torch.is_grad_enabled())


class _VocabParallelCrossEntropy(torch.autograd.Function):
    """Per-token cross-entropy of logits split over the vocabulary, each rank holding columns
    [first_id, first_id + v) of every token's row: two all-reduces in the forward (the row maxima; the sums of
    exponentials with the target logits), none in the backward, whose gradient softmax - one_hot is local."""

    @staticmethod
    def forward(ctx, logits_Tv: torch.Tensor, targets_T: torch.Tensor, first_id: int, group) -> torch.Tensor:
        v = logits_Tv.shape[1]
        max_T1 = logits_Tv.detach().amax(dim=1, keepdim=True).float()
        dist.all_reduce(max_T1, op=dist.ReduceOp.MAX, group=group)
        shifted_Tv = logits_Tv.detach().to(torch.float32, copy=True).sub_(max_T1)  # one fp32 copy, worked in place
        local_T = targets_T - first_id
        here_T = (local_T >= 0) & (local_T < v)  # the target is one of this rank's columns
        column_T1 = local_T.clamp(0, v - 1)[:, None]
        target_T = shifted_Tv.gather(1, column_T1).squeeze(1) * here_T  # 0 on the ranks that do not hold it
        probs_Tv = shifted_Tv.exp_()
        sums_T2 = torch.stack([probs_Tv.sum(dim=1), target_T], dim=1)
        dist.all_reduce(sums_T2, group=group)
        loss_T = sums_T2[:, 0].log() - sums_T2[:, 1]
        probs_Tv.div_(sums_T2[:, :1])
        ctx.logits_dtype = logits_Tv.dtype
        ctx.save_for_backward(probs_Tv, column_T1, here_T)
        return loss_T

    @staticmethod
    def backward(ctx, grad_loss_T: torch.Tensor):
        probs_Tv, column_T1, here_T = ctx.saved_tensors
        # softmax - one_hot over this rank's columns, in place: the saved probabilities are not read again
        grad_Tv = probs_Tv.scatter_add_(1, column_T1, -here_T[:, None].to(probs_Tv.dtype))
        grad_Tv.mul_(grad_loss_T.float()[:, None])
        return grad_Tv.to(ctx.logits_dtype), None, None, None


def vocab_parallel_cross_entropy(logits_Tv: torch.Tensor, targets_T: torch.Tensor, mesh) -> torch.Tensor:
    """Per-token cross-entropy [T] (fp32, the same on every rank) of logits split over the vocabulary:
    this rank's columns [T, V / tp] of the LM head over the tensor-parallel `mesh`. The ranks reduce the
    row maxima, the sums of exponentials and the target logits; the [T, V] logits are never gathered, in the
    forward or the backward (DTensor's loss_parallel gathers them in the backward outside its context, as a
    training loop's backward call is)."""
    first_id = mesh.get_local_rank() * logits_Tv.shape[1]
    return _VocabParallelCrossEntropy.apply(logits_Tv, targets_T, first_id, mesh.get_group())


def mask_padded_logits(logits_Xv: torch.Tensor, vocab_size: int, first_id: int = 0) -> torch.Tensor:
    """`logits_Xv`, the logits of token ids first_id.. (its last dimension), with those of ids >= `vocab_size`
    (the padding rows of the LM head) set to -inf: they get no probability, and no gradient."""
    n_real = vocab_size - first_id
    if n_real >= logits_Xv.shape[-1]:
        return logits_Xv
    padding_v = torch.arange(logits_Xv.shape[-1], device=logits_Xv.device) >= n_real
    # Not in place: under tensor parallelism the logits are a view made by DTensor's to_local.
    return logits_Xv.masked_fill(padding_v, float("-inf"))


def head_logits(head: torch.nn.Linear, h_BSD: torch.Tensor, vocab_size: int) -> torch.Tensor:
    """The LM head's logits [B, S, V] of `h_BSD`, -inf past `vocab_size`; under tensor parallelism (the head's
    weight a DTensor split into equal row blocks) this rank's columns [B, S, V / tp]."""
    logits_BSv = head(h_BSD)
    first_id = 0
    if isinstance(head.weight, DTensor):
        first_id = head.weight.device_mesh.get_local_rank() * logits_BSv.shape[-1]
    return mask_padded_logits(logits_BSv, vocab_size, first_id)


def head_cross_entropy(
    head: torch.nn.Linear, h_BSD: torch.Tensor, targets_BS: torch.Tensor, vocab_size: int
) -> torch.Tensor:
    """Per-token cross-entropy [B, S] over the first `vocab_size` logits of the LM head `head` applied to
    `h_BSD`: fused (linear_cross_entropy, over the head's first `vocab_size` rows), or vocab-parallel when
    tensor parallelism split the head (its weight is a DTensor; see head_logits)."""
    if isinstance(head.weight, DTensor):
        logits_Tv = head_logits(head, h_BSD, vocab_size).flatten(0, 1)
        loss_T = vocab_parallel_cross_entropy(logits_Tv, targets_BS.reshape(-1), head.weight.device_mesh)
    else:
        weight_VD = head.weight if head.weight.shape[0] == vocab_size else head.weight[:vocab_size]
        loss_T = linear_cross_entropy(h_BSD.flatten(0, 1), weight_VD, targets_BS.reshape(-1))
    return loss_T.view_as(targets_BS)
