"""Tensor and sequence parallelism, applied to a model (or a pipeline stage) from outside with DTensor.

`apply_tensor_parallel` gives every block `parallelize_module` plans over the TP mesh
(a run of `tp` consecutive ranks that share one batch):

    module                 split over tp                          input -> output (sp on | sp off)
    embed                  vocabulary rows (each rank its own     tokens -> Shard(1) | Replicate
                           rows' lookups, summed)
    attn_norm, ffn_norm    - (each rank its rows, with sp)        Shard(1) -> Shard(1)
    attn                   heads: wq/wk/wv columns, wo rows       all-gathers the sequence with sp;
                                                                  wo reduce-scatters (sp) or all-reduces
    attn.q_norm/k_norm     weight split like q/k's columns        (QK-norm "full": over the whole projection)
                                                                  sums of squares all-reduced per token
    dense ffn (SwiGLU)     w1/w3 columns, w2 rows                 as attention
    MoE ffn                - (parallel folding: the experts are   routes this rank's 1/tp of the
                           spread over ep, tp ranks among them)   sequence; sp off: all-gathers after
    norm                   - (each rank its rows, with sp)
    lm_head                vocabulary rows (ColwiseParallel)      -> logits [B, S, V/tp] on each rank;
                                                                  optimus.model.loss takes the
                                                                  vocab-parallel cross-entropy

GQA keeps whole KV heads per rank (config_checks.validate_tensor_parallel refuses a tp that does not
divide n_kv_heads). The router, shared experts and routed experts are not split: under TP the
ranks of a TP group take part in expert parallelism (MoE layers see the stage's dp x tp ranks as
edp x ep; optimus.parallel.state), each routing a different 1/tp of the sequence, so every token
is routed exactly once.

Gradients: a split parameter's gradient is its slice's, complete; a replicated one (`tp_grad_roles`)
is either the same on every tp rank ("replicated": norms without sp) or this rank's share of a sum
over the tp ranks ("partial": norms under sp, whose rank saw 1/tp of the tokens; the router and
shared experts, which routed 1/tp of them; per-head QK-norms, which saw 1/tp of the heads). The
optimizer sums the partial ones over the TP group before it reduces over the data-parallel ranks,
and counts replicated elements once in the gradient norm.
"""

from __future__ import annotations

import torch
import torch.distributed as dist
import torch.nn as nn
import torch.nn.functional as F
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    RowwiseParallel,
    parallelize_module,
)

from optimus.model.attention import Attention
from optimus.model.mlp import SwiGLU
from optimus.model.moe.experts import expert_offsets
from optimus.model.moe.layer import MoE

SPLIT, PARTIAL, REPLICATED = "split", "partial", "replicated"  # tp_grad_roles' values


def local_tensor(t: torch.Tensor) -> torch.Tensor:
    """What this rank holds of `t`: its local shard (sharing storage) when `t` is a DTensor, else `t`."""
    if isinstance(t, DTensor):
        with torch.no_grad():
            return t.to_local()
    return t


def local_grad(param: torch.Tensor, grad: torch.Tensor | None = None) -> torch.Tensor | None:
    """This rank's part of `grad` (default `param.grad`), a gradient of `param`: a split parameter's slice (DTensor
    can produce the gradient of one in another layout, e.g. the embedding's as a partial sum, which is then
    reduce-scattered into slices), a replicated one's local value (for a partial role: this rank's share, summed
    by the optimizer)."""
    grad = param.grad if grad is None else grad
    if not isinstance(grad, DTensor):
        return grad
    if grad.placements != param.placements and any(p.is_shard() for p in param.placements):
        grad = grad.redistribute(placements=param.placements)
    return grad.to_local()


def like_parameter(param: torch.Tensor, local: torch.Tensor) -> nn.Parameter:
    """A parameter laid out as `param` (a DTensor's mesh, placements and global shape) whose storage is `local`."""
    if isinstance(param, DTensor):
        local = DTensor.from_local(
            local, param.device_mesh, param.placements, run_check=False, shape=param.shape, stride=param.stride()
        )
    return nn.Parameter(local, requires_grad=param.requires_grad)


class _SequenceShardedRMSNorm(ParallelStyle):
    """An RMSNorm on this rank's part of the sequence (sequence parallelism: the residual stream is split over the
    sequence between blocks). The weight is replicated; each rank normalises its own rows in the model's norm
    arithmetic (a Triton kernel on a GPU) on plain local tensors, and the weight's gradient is this rank's share
    of a sum over the tp ranks, which the optimizer completes (a PARTIAL role: tp_grad_roles). torch's
    SequenceParallel style would run the norm on DTensors, which the kernels do not take. Takes and returns
    this rank's rows as a plain tensor (the next module's input layout says Shard(1))."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight = distribute_tensor(module.weight, device_mesh, [Replicate()], src_data_rank=None)
        module.register_parameter("weight", nn.Parameter(weight, module.weight.requires_grad))

        def forward(x: torch.Tensor) -> torch.Tensor:  # [B, S / tp, D]
            if isinstance(x, DTensor):  # only this rank's rows: a whole sequence would be taken for its part
                if tuple(x.placements) != (Shard(1),):
                    raise ValueError(f"a sequence-parallel norm takes its rows as Shard(1), not {x.placements}")
                x = x.to_local()
            return module.norm(x, module.weight.to_local(grad_placements=[Partial()]))

        module.forward = forward
        return module


class _WidthShardedRMSNorm(ParallelStyle):
    """An RMSNorm over a width that tensor parallelism split (QK-norm "full": the whole q or k projection, whose
    columns are this rank's heads): the weight is split like the columns, each rank sums the squares of its
    columns, one all-reduce of a value per token completes the sum (and one more in the backward, of the rows'
    sums of g * w * x), and each rank normalises its columns, in the model's norm arithmetic. Takes the
    column-split DTensor the projection gives, returns this rank's columns as a plain tensor."""

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        weight = distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter("weight", nn.Parameter(weight, module.weight.requires_grad))
        width, group = module.normalized_shape[0], device_mesh.get_group()

        def sum_over_ranks(per_row: torch.Tensor) -> torch.Tensor:  # fp32 [N], in place
            dist.all_reduce(per_row, group=group)
            return per_row

        def forward(x: DTensor) -> torch.Tensor:  # [B, S, W] split over W
            return module.norm(x.to_local(), module.weight.to_local(), width, sum_over_ranks)

        module.forward = forward
        return module


class _VocabParallelEmbedding(ParallelStyle):
    """The embedding split over the vocabulary (its rows): each rank looks up the tokens in its own rows (zeros for
    the others'), and the ranks' parts are summed into the residual stream's layout (a reduce-scatter over the
    sequence with sp, an all-reduce without). Its backward is an embedding backward over this rank's [V/tp, D]
    rows only; DTensor's row-split embedding (RowwiseParallel) builds the whole [V, D] gradient and a copy of it
    on every rank (2 x 2.4 GiB at frontier-1t's D = 25,600). Takes the token ids whole on every rank; returns
    this rank's part of the residual stream as a plain tensor."""

    def __init__(self, output_layout):
        super().__init__()
        self.output_layout = output_layout

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        rows, tp = module.weight.shape[0], device_mesh.size()
        if rows % tp:
            raise ValueError(f"an embedding of {rows} rows does not split over {tp} tensor-parallel ranks")
        weight = distribute_tensor(module.weight, device_mesh, [Shard(0)], src_data_rank=None)
        module.register_parameter("weight", nn.Parameter(weight, module.weight.requires_grad))
        first = device_mesh.get_local_rank() * (rows // tp)  # this rank's first row
        layout = self.output_layout

        def forward(ids_BS: torch.Tensor) -> torch.Tensor:
            w_VD = module.weight.to_local()  # [V / tp, D]: this rank's rows
            local_BS = ids_BS - first
            outside_BS = (local_BS < 0) | (local_BS >= w_VD.shape[0])
            part_BSD = F.embedding(local_BS.masked_fill(outside_BS, 0), w_VD).masked_fill(outside_BS[..., None], 0)
            summed = DTensor.from_local(part_BSD, device_mesh, [Partial()], run_check=False)
            return summed.redistribute(device_mesh, [layout]).to_local()

        module.forward = forward
        return module


def _residual(sp: bool):
    """How the residual stream is laid out between blocks: 1/tp of the sequence (sp) or all of it."""
    return Shard(1) if sp else Replicate()


def _gather_sequence() -> PrepareModuleInput:
    """Sequence parallelism: attention and dense FFNs take the whole sequence (each rank its heads/columns)."""
    return PrepareModuleInput(input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True)


def _attention_plan(attn: Attention, sp: bool) -> dict[str, ParallelStyle | tuple[ParallelStyle, ...]]:
    full_qk_norm = attn.qk_norm == "full"
    plan: dict[str, ParallelStyle | tuple[ParallelStyle, ...]] = {
        # Full-width QK-norm takes q and k as DTensors (split over columns) to normalise them across ranks.
        "wq": ColwiseParallel(use_local_output=not full_qk_norm),
        "wk": ColwiseParallel(use_local_output=not full_qk_norm),
        "wv": ColwiseParallel(),
        "wo": RowwiseParallel(output_layouts=_residual(sp)),
    }
    if sp:
        plan[""] = _gather_sequence()
    if full_qk_norm:  # the norm is over the whole projection, which is split: see _WidthShardedRMSNorm
        plan["q_norm"], plan["k_norm"] = _WidthShardedRMSNorm(), _WidthShardedRMSNorm()
    return plan


def _ffn_plan(ffn: nn.Module, sp: bool) -> dict[str, ParallelStyle | tuple[ParallelStyle, ...]]:
    if isinstance(ffn, SwiGLU):
        plan: dict[str, ParallelStyle | tuple[ParallelStyle, ...]] = {
            "w1": ColwiseParallel(),
            "w3": ColwiseParallel(),
            "w2": RowwiseParallel(output_layouts=_residual(sp)),
        }
        if sp:
            plan[""] = _gather_sequence()
        return plan
    assert isinstance(ffn, MoE)
    # Each rank routes its 1/tp of the sequence: with sp that is what it holds, without it a slice of its copy.
    route_share = PrepareModuleInput(
        input_layouts=(_residual(sp),), desired_input_layouts=(Shard(1),), use_local_output=True
    )
    if sp:
        return {"": route_share}
    return {"": (route_share, PrepareModuleOutput(output_layouts=(Shard(1),), desired_output_layouts=(Replicate(),)))}


def _apply(module: nn.Module, mesh: DeviceMesh, prefix: str, plan: dict) -> None:
    """parallelize_module for each entry of `plan`: submodule path ("" = the module) -> style or styles."""
    for key, styles in plan.items():
        path = ".".join(p for p in (prefix, key) if p)
        for style in styles if isinstance(styles, tuple) else (styles,):
            parallelize_module(module.get_submodule(path), mesh, style)


def apply_tensor_parallel(model: nn.Module, mesh: DeviceMesh, sp: bool) -> nn.Module:
    """Split `model` (a Transformer or a pipeline stage of one, on any device, meta included) over `mesh`."""
    if getattr(model, "embed", None) is not None:
        _apply(model, mesh, "embed", {"": _VocabParallelEmbedding(_residual(sp))})
    for name, block in model.layers.items():
        prefix = f"layers.{name}"
        if sp:
            _apply(model, mesh, prefix, {"attn_norm": _SequenceShardedRMSNorm(), "ffn_norm": _SequenceShardedRMSNorm()})
        _apply(model, mesh, f"{prefix}.attn", _attention_plan(block.attn, sp))
        _apply(model, mesh, f"{prefix}.ffn", _ffn_plan(block.ffn, sp))
        if block.is_moe:  # the tp ranks route parts of one micro-batch
            block.ffn.wire(micro_batch_group=mesh.get_group())
    if getattr(model, "lm_head", None) is not None:
        if sp:
            _apply(model, mesh, "norm", {"": _SequenceShardedRMSNorm()})
        head = ColwiseParallel(input_layouts=_residual(sp), output_layouts=Shard(-1), use_local_output=True)
        _apply(model, mesh, "lm_head", {"": head})
    return model


def tp_grad_roles(model: nn.Module) -> dict[str, str]:
    """name -> SPLIT | PARTIAL | REPLICATED for every trainable non-expert parameter of a model that
    `apply_tensor_parallel` split (see the module docstring); routed experts are expert parallelism's."""
    experts = expert_offsets(model)
    in_moe = {f"{n}.{p}" for n, m in model.named_modules() if isinstance(m, MoE) for p, _ in m.named_parameters()}
    head_norms = {
        f"{n}.{norm}.{p}"
        for n, m in model.named_modules()
        if isinstance(m, Attention) and m.qk_norm == "head"
        for norm in ("q_norm", "k_norm")
        for p, _ in getattr(m, norm).named_parameters()
    }
    roles = {}
    for name, param in model.named_parameters():
        if not param.requires_grad or name in experts:
            continue
        if isinstance(param, DTensor) and any(p.is_shard() for p in param.placements):
            roles[name] = SPLIT
        elif isinstance(param, DTensor):  # a norm's under sp (_SequenceShardedRMSNorm): each rank saw its rows
            roles[name] = PARTIAL
        else:
            roles[name] = PARTIAL if name in in_moe or name in head_norms else REPLICATED
    return roles


def tp_global_offsets(model: nn.Module, names: list[str]) -> dict[str, tuple[int, tuple[int, ...], tuple | None]]:
    """For the split parameters among `names`, where this rank's slice sits in the whole parameter, as the
    optimizer's state is keyed (optimus.optim.state_ranges): a block of rows (Shard(0)) is the range that
    starts at its first element; a block of columns (Shard(1), RowwiseParallel's) is its own block."""
    out = {}
    for name in names:
        param = model.get_parameter(name)
        if not isinstance(param, DTensor):
            continue
        (placement,) = param.placements  # a 1-D mesh
        if not placement.is_shard():
            continue
        local, rank = local_tensor(param), param.device_mesh.get_local_rank()
        if placement.dim == 0:
            out[name] = (rank * local.numel(), tuple(param.shape), None)
        else:
            assert placement.dim == 1 and param.dim() == 2, f"{name}: only matrices are split along columns"
            width = local.shape[1]
            out[name] = (0, tuple(param.shape), (rank * width, (rank + 1) * width))
    return out
