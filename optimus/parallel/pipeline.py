"""Pipeline parallelism: the model cut into stages, driven by torch.distributed.pipelining schedules.

The layers are cut into `pp * pp_virtual` stages of consecutive layers; stage 0 also holds
the embedding, the last stage the final norm and LM head. A stage is the model class itself
with a subset of layers (`Transformer(cfg, layer_ids=..., embed=..., head=...)`), so its
parameters keep their names (`layers.5.attn.wq.weight`) and initial values. Stage s lives on
pipeline rank s % pp (looped placement: with `pp_virtual` > 1 each rank holds stages
r, r + pp, ..., as the interleaved schedule expects).

PyTorch's `PipelineStage` and schedule classes run the micro-batches; this module only builds
them, merges a rank's stages into one module for the optimizer, and passes activations along
for evaluation, which has no backward.
"""

from __future__ import annotations

from collections.abc import Callable

import torch
import torch.distributed as dist
from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe, ScheduleInterleaved1F1B

from optimus.config import ConfigError
from optimus.model import Transformer
from optimus.parallel.state import ParallelState

SCHEDULES = {"gpipe": ScheduleGPipe, "1f1b": Schedule1F1B, "interleaved_1f1b": ScheduleInterleaved1F1B}
MULTI_STAGE_SCHEDULES = ("interleaved_1f1b",)  # the schedules that drive several stages per rank


def stage_layer_ids(n_layers: int, n_stages: int) -> list[list[int]]:
    """Consecutive runs of layers, one per stage, as even as possible (earlier stages take the remainder)."""
    if n_layers < n_stages:
        raise ConfigError(
            f"model.n_layers={n_layers} cannot fill {n_stages} pipeline stages (parallel.pp x parallel.pp_virtual): "
            "use fewer stages or more layers."
        )
    base, extra = divmod(n_layers, n_stages)
    sizes = [base + (stage < extra) for stage in range(n_stages)]
    starts = [sum(sizes[:stage]) for stage in range(n_stages)]
    return [list(range(start, start + size)) for start, size in zip(starts, sizes)]


def rank_stage_indices(pp_rank: int, pp: int, pp_virtual: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds (looped placement)."""
    return [pp_rank + k * pp for k in range(pp_virtual)]


def merge_stages(stages: list[Transformer]) -> Transformer:
    """One module holding a rank's stages, with each parameter under its whole-model name (for the optimizer,
    counts and checkpoints); it shares the stages' modules and is never called itself."""
    first = stages[0]
    with torch.device("meta"):  # empty: no layers, no embedding, no head
        merged = Transformer(first.cfg, layer_ids=[], embed=False, head=False)
    for stage in stages:
        merged.layers.update(stage.layers)
        for name in ("embed", "norm", "lm_head"):
            if getattr(stage, name) is not None:
                setattr(merged, name, getattr(stage, name))
    return merged


def stage_io_meta(stage: Transformer, micro_batch: int, seq_len: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes and dtypes of a stage's input and output for one micro-batch, on the meta device: given to
    PipelineStage so that it infers nothing at run time (inference would run the routers an extra time)."""
    dtype = next(stage.parameters()).dtype  # the residual stream's and the logits' dtype: the parameters'
    with torch.device("meta"):
        if stage.embed is not None:
            inputs = torch.empty(micro_batch, seq_len, dtype=torch.long)  # [B, S] tokens
        else:
            inputs = torch.empty(micro_batch, seq_len, stage.cfg.dim, dtype=dtype, requires_grad=True)  # [B, S, D]
        width = stage.vocab_size if stage.lm_head is not None else stage.cfg.dim
        outputs = torch.empty(micro_batch, seq_len, width, dtype=dtype, requires_grad=True)  # [B, S, V or D]
    return inputs, outputs


class Pipeline:
    """This rank's stages and the schedule that runs a step's micro-batches through all stages.

    `loss_fn(logits_BSV, targets_BS)` is called on the last stage once per micro-batch, in order;
    its backward drives the pipeline's (gradients are not rescaled by the schedule: the loss
    carries the 1 / micro-batches factor itself).
    """

    def __init__(
        self,
        stages: list[Transformer],
        stage_indices: list[int],
        n_stages: int,
        schedule: str,
        n_micro_batches: int,
        micro_batch: int,
        seq_len: int,
        loss_fn: Callable[[torch.Tensor, torch.Tensor], torch.Tensor],
        ps: ParallelState,
        device: torch.device,
    ):
        self.stages, self.stage_indices, self.n_stages = stages, stage_indices, n_stages
        self.group = ps.pp_group
        pipeline_stages = []
        for stage, index in zip(stages, stage_indices):
            inputs, outputs = stage_io_meta(stage, micro_batch, seq_len)
            pipeline_stages.append(
                PipelineStage(stage, index, n_stages, device, input_args=inputs, output_args=outputs, group=self.group)
            )
        schedule_cls = SCHEDULES[schedule]
        driven = pipeline_stages if schedule in MULTI_STAGE_SCHEDULES else pipeline_stages[0]
        self.schedule = schedule_cls(driven, n_microbatches=n_micro_batches, loss_fn=loss_fn, scale_grads=False)
        self.is_first, self.is_last = 0 in stage_indices, n_stages - 1 in stage_indices

    def step(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> None:
        """Forward and backward of every micro-batch of `inputs_BS` (split along the batch dimension)."""
        args = (inputs_BS,) if self.is_first else ()
        self.schedule.step(*args, target=targets_BS if self.is_last else None)

    def forward(self, inputs_BS: torch.Tensor) -> torch.Tensor | None:
        """Logits [B, S, V] of `inputs_BS` on the last stage's ranks (None elsewhere), without a backward:
        each stage in turn receives the previous one's hidden states, runs, and sends them on."""
        pp = dist.get_world_size(self.group)
        h = inputs_BS
        for index in range(self.n_stages):
            if index not in self.stage_indices:
                continue
            stage = self.stages[self.stage_indices.index(index)]
            if index > 0:
                dtype = next(stage.parameters()).dtype  # the residual stream's dtype: the parameters'
                h = torch.empty(*inputs_BS.shape, stage.cfg.dim, dtype=dtype, device=inputs_BS.device)  # [B, S, D]
                dist.recv(h, src=dist.get_global_rank(self.group, (index - 1) % pp))
            h = stage(h)
            if index < self.n_stages - 1:
                dist.send(h.contiguous(), dst=dist.get_global_rank(self.group, (index + 1) % pp))
        return h if self.is_last else None
