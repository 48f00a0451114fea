"""Pipeline parallelism: the model cut into stages, driven by torch.distributed.pipelining schedules.

The layers are cut into `pp * pp_virtual` stages of consecutive layers; stage 0 also holds
the embedding, the last stage the final norm and LM head. A stage is the model class itself
with a subset of layers (`Transformer(cfg, layer_ids=..., embed=..., head=...)`), so its
parameters keep their names (`layers.5.attn.wq.weight`) and initial values. Stage s lives on
pipeline rank s % pp (looped placement: with `pp_virtual` > 1 each rank holds stages
r, r + pp, ..., as the interleaved schedule expects).

How many layers each stage takes: `parallel.pp_layers`, or the split whose costliest stage
is cheapest (`balanced_split`), with the embedding and the head counted on the end stages.

PyTorch's `PipelineStage` and schedule classes run the micro-batches; this module only builds
them, merges a rank's stages into one module for the optimizer, and passes activations along
for evaluation, which has no backward. Its stage class (`TimedStage`) tells the optimizer which
backward is a stage's last of the step (ZeRO-2 reduces then) and times the stages.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable, Iterable
from contextlib import contextmanager
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    PipelineStage,
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from optimus.config import INTERLEAVED_SCHEDULES, ConfigError, ModelConfig
from optimus.model import Transformer
from optimus.model.counts import expert_offsets
from optimus.parallel.state import ParallelState

# interleaved_zb: zero bubble (ZB1P), which splits each backward into the input gradient, sent on at once,
# and the weight gradient, run later to fill the bubble.
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
}


@dataclass
class PartCounts:
    """Parameters of a part of the model (a layer, the embedding, the head): routed experts apart."""

    dense: int = 0
    expert: int = 0

    def __add__(self, other: PartCounts) -> PartCounts:
        return PartCounts(self.dense + other.dense, self.expert + other.expert)


def part_counts(cfg: ModelConfig) -> tuple[list[PartCounts], PartCounts, PartCounts]:
    """(per layer, embedding, final norm + LM head) parameter counts, on the meta device (no memory)."""
    with torch.device("meta"):
        model = Transformer(cfg, kernels="torch")

    def count(module: torch.nn.Module) -> PartCounts:
        total, experts = PartCounts(), expert_offsets(module)
        for name, p in module.named_parameters():
            total += PartCounts(0, p.numel()) if name in experts else PartCounts(p.numel(), 0)
        return total

    return [count(b) for b in model.layers.values()], count(model.embed), count(model.norm) + count(model.lm_head)


def stage_costs(cfg: ModelConfig) -> tuple[list[int], int, int]:
    """(per layer, embedding, final norm + LM head): the parameters a token passes through.

    A routed expert counts top_k / n_experts of its parameters, since a stage's time follows the
    parameters its tokens touch, not those it stores; the embedding and the head count whole
    (at vocab 50k each weighs about as much as one layer of the Mula recipes)."""
    layers, embed, head = part_counts(cfg)

    def active(c: PartCounts) -> int:
        return c.dense + (c.expert * cfg.moe.top_k // cfg.moe.n_experts if cfg.moe.n_experts else 0)

    return [active(c) for c in layers], active(embed), active(head)


def balanced_split(layer_costs: list[int], n_stages: int, first_extra: int = 0, last_extra: int = 0) -> list[int]:
    """Layers per stage: consecutive runs that minimise the costliest stage, the first stage also carrying
    `first_extra` and the last `last_extra`; among equally costly splits the most even one, then the one
    with the larger stages first (a dynamic programme over (stages, layers), L^2 S steps)."""
    n = len(layer_costs)
    if n < n_stages:
        raise ConfigError(
            f"model.n_layers={n} cannot fill {n_stages} pipeline stages (parallel.pp x parallel.pp_virtual): "
            "use fewer stages or more layers."
        )
    prefix = [0]
    for cost in layer_costs:
        prefix.append(prefix[-1] + cost)

    def cost(stage: int, lo: int, hi: int) -> int:  # layers [lo, hi) on stage `stage`
        extra = (first_extra if stage == 0 else 0) + (last_extra if stage == n_stages - 1 else 0)
        return prefix[hi] - prefix[lo] + extra

    def layers_per_stage(key: Callable[[tuple, int, int], tuple]) -> tuple[tuple, list[int]]:
        """Best (key, sizes) over the splits, `key(prefix key, cost, size)` combining a prefix with a stage;
        exact for keys that keep their order when the same stages are appended to both sides."""
        best: dict[int, tuple[tuple, list[int]]] = {0: ((), [])}  # end of the layers placed so far -> best
        for stage in range(n_stages):
            nxt: dict[int, tuple[tuple, list[int]]] = {}
            left = n_stages - stage - 1  # stages still to fill after this one, one layer at least each
            for lo, (prefix_key, sizes) in best.items():
                for hi in range(lo + 1, n - left + 1):
                    candidate = key(prefix_key, cost(stage, lo, hi), hi - lo)
                    if hi not in nxt or candidate < nxt[hi][0]:
                        nxt[hi] = (candidate, [*sizes, hi - lo])
            best = nxt
        return best[n]

    # First the smallest possible costliest stage; then, among the splits under it, the most even (least
    # sum of squares), ties going to the larger stages first.
    (worst,), _ = layers_per_stage(lambda k, c, size: (max(k[0] if k else 0, c),))

    def evenness(k: tuple, c: int, size: int) -> tuple:
        squares = (k[0] if k else 0) + (c * c if c <= worst else math.inf)
        return (squares, *k[1:], -size)

    _, sizes = layers_per_stage(evenness)
    return sizes


def stage_layer_ids(sizes: list[int]) -> list[list[int]]:
    """Global layer indices of each stage, from its number of layers."""
    starts = [sum(sizes[:stage]) for stage in range(len(sizes))]
    return [list(range(start, start + size)) for start, size in zip(starts, sizes)]


def stage_sizes(cfg: ModelConfig, n_stages: int, pp_layers: list[int] | None = None) -> list[int]:
    """Layers per stage: `parallel.pp_layers` when the recipe gives them, else the balanced split."""
    if pp_layers:
        return list(pp_layers)
    layers, embed, head = stage_costs(cfg)
    return balanced_split(layers, n_stages, embed, head)


def in_flight_chunks(schedule: str, pp: int, pp_virtual: int, pp_rank: int, n_micro_batches: int) -> int:
    """Most stage forwards (micro-batch x local stage) whose activations pipeline rank `pp_rank` holds at once:
    the forwards a schedule runs before its first backward, plus the one in flight."""
    if schedule == "gpipe":
        return n_micro_batches  # every forward before any backward
    if schedule == "1f1b":
        return min(n_micro_batches, pp - pp_rank)
    # The interleaved schedules, as torch's count their warm-up: (v - 1) rounds of micro-batches, then two
    # forwards more per hop from the last rank (one with zero bubble, which also keeps a micro-batch's
    # activations from its input backward to its weight backward; not counted here)
    per_round = n_micro_batches // max(1, n_micro_batches // pp)
    per_hop = 1 if schedule == "interleaved_zb" else 2
    warmup = (pp_virtual - 1) * per_round + per_hop * (pp - 1 - pp_rank)
    return min(warmup + 1, n_micro_batches * pp_virtual)


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
    # The whole model's module order (embedding first): with one stage per rank the parameters are then listed
    # in the stage's own order, the order of its flat buffer, which the optimizer adopts instead of copying.
    merged._modules = {
        name: merged._modules[name] for name in ("embed", "layers", "norm", "lm_head") if name in merged._modules
    }
    if tied_head_copy(merged):
        # The head's weight is a copy of the embedding (tie_embeddings), which the first stage's optimizer
        # trains: held here as a buffer, it is saved and loaded under its name but not optimised twice.
        holder = torch.nn.Module()
        holder.register_buffer("weight", merged.lm_head.weight)
        merged.lm_head = holder
    return merged


def tied_head_copy(model: Transformer) -> bool:
    """Whether `model` (a stage, or a rank's stages) holds the LM head of a tied model without its embedding."""
    return model.cfg.tie_embeddings and model.lm_head is not None and model.embed is None


def stage_io_meta(
    stage: Transformer, micro_batch: int, seq_len: int, ps: ParallelState
) -> tuple[torch.Tensor, torch.Tensor]:
    """Shapes and dtypes of a stage's input and output for one micro-batch, on the meta device: given to
    PipelineStage so that it infers nothing at run time (inference would run the routers an extra time).
    Under tensor parallelism a rank passes on its part of the residual stream (ps.residual_seq_len) and the
    last stage gives its vocabulary columns, V / tp."""
    dtype = next(stage.parameters()).dtype  # the residual stream's and the logits' dtype: the parameters'
    positions = ps.residual_seq_len(seq_len)
    with torch.device("meta"):
        if stage.embed is not None:
            inputs = torch.empty(micro_batch, seq_len, dtype=torch.long)  # [B, S] tokens
        else:
            inputs = torch.empty(micro_batch, positions, stage.cfg.dim, dtype=dtype, requires_grad=True)  # [B, s, D]
        if stage.lm_head is not None:
            outputs = torch.empty(micro_batch, seq_len, stage.vocab_size // ps.tp, dtype=dtype, requires_grad=True)
        else:
            outputs = torch.empty(micro_batch, positions, stage.cfg.dim, dtype=dtype, requires_grad=True)
    return inputs, outputs


class TimedStage(PipelineStage):
    """A PipelineStage that reports each forward and backward it runs to its pipeline: for the per-stage
    timers and for ZeRO-2, which must know which backward is the stage's last of the step."""

    def __init__(self, pipeline: Pipeline, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.pipeline = pipeline

    def forward_one_chunk(self, *args, **kwargs):
        with self.pipeline.timed(self.stage_index, "forward"):
            return super().forward_one_chunk(*args, **kwargs)

    def backward_maybe_with_nosync(self, backward_type, bwd_kwargs, last_backward=False, **kwargs):
        # Every schedule's backward (full, or its input and weight halves) passes through here with
        # `last_backward` set for the stage's last micro-batch of the step: the parameters' gradients are
        # complete once it has run, which is when ZeRO-2 reduces them.
        self.pipeline.before_backward(last_backward)
        with self.pipeline.timed(self.stage_index, "backward"):
            result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward, **kwargs)
        if backward_type == "weight":  # zero bubble's weight pass assigns .grad, which fires no gradient hook
            self.pipeline.after_weight_backward(self.submod.parameters())
        return result


class Pipeline:
    """This rank's stages and the schedule that runs a step's micro-batches through all stages.

    `loss_fn(logits_BSV, targets_BS)` is called on the last stage once per micro-batch, in order;
    its backward drives the pipeline's (gradients are not rescaled by the schedule: the loss
    carries the 1 / micro-batches factor itself). The trainer sets `before_backward(is_last)`, called
    before each of this rank's stage backwards (the optimizer's set_last_micro_batch),
    `after_weight_backward(params)` (the optimizer's grads_assigned), and `timers`
    (profile.timers), which time the stages' forwards and backwards; `stage_seconds` sums those per stage.
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
        self.residual_seq_len = ps.residual_seq_len  # what a rank passes between stages (sequence parallelism)
        self.before_backward: Callable[[bool], None] = lambda is_last: None
        # Called with a stage's parameters after each weight pass of a zero-bubble schedule (the optimizer's
        # grads_assigned): that pass assigns their .grad instead of accumulating it through autograd.
        self.after_weight_backward: Callable[[Iterable[torch.Tensor]], None] = lambda params: None
        self.timers = None  # profile.timers (optimus.train.timers.Timers), set by the trainer
        self.device = device
        self.stage_seconds = dict.fromkeys(stage_indices, 0.0)
        pipeline_stages = []
        for stage, index in zip(stages, stage_indices):
            inputs, outputs = stage_io_meta(stage, micro_batch, seq_len, ps)
            pipeline_stages.append(
                TimedStage(
                    self, stage, index, n_stages, device, input_args=inputs, output_args=outputs, group=self.group
                )
            )
        schedule_cls = SCHEDULES[schedule]
        driven = pipeline_stages if schedule in INTERLEAVED_SCHEDULES else pipeline_stages[0]
        self.schedule = schedule_cls(driven, n_microbatches=n_micro_batches, loss_fn=loss_fn, scale_grads=False)
        self.is_first, self.is_last = 0 in stage_indices, n_stages - 1 in stage_indices
        self.tied = stages[0].cfg.tie_embeddings  # the first stage's embedding is the last stage's head
        pp = dist.get_world_size(self.group)
        self.first_rank = dist.get_global_rank(self.group, 0)
        self.last_rank = dist.get_global_rank(self.group, (n_stages - 1) % pp)

    @contextmanager
    def timed(self, stage_index: int, phase: str):
        """Time `phase` (forward | backward) of stage `stage_index` with profile.timers, when they are on."""
        if not self.timers:
            yield
            return
        start = time.perf_counter()
        with self.timers(phase):
            yield
        self.stage_seconds[stage_index] += time.perf_counter() - start

    def pop_stage_seconds(self) -> list[float]:
        """Seconds each stage spent in its forwards and backwards since the last call, [n_stages], on every
        rank of the pipeline group (a collective over it)."""
        seconds_S = torch.zeros(self.n_stages, dtype=torch.float64, device=self.device)  # [S]
        for index, seconds in self.stage_seconds.items():
            seconds_S[index] = seconds
        self.stage_seconds = dict.fromkeys(self.stage_indices, 0.0)
        dist.all_reduce(seconds_S, group=self.group)
        return seconds_S.tolist()

    def _stage_with(self, name: str) -> Transformer:
        return next(stage for stage in self.stages if getattr(stage, name) is not None)

    def add_tied_gradient(self) -> None:
        """tie_embeddings: after a step's backwards, the last stage's head gradient is added into the first
        stage's embedding gradient (each rank pairs with the rank at its place in the other stage, before the
        stage's data-parallel reduction sums the pairs), as one tied tensor would have accumulated both."""
        if not self.tied:
            return
        if self.is_last:
            weight = self._stage_with("lm_head").lm_head.weight
            grad = weight.grad if weight.grad is not None else torch.zeros_like(weight)
            dist.send(grad.contiguous(), dst=self.first_rank)
            weight.grad = None
        elif self.is_first:
            weight = self._stage_with("embed").embed.weight
            received = torch.empty_like(weight)  # [V, D]
            dist.recv(received, src=self.last_rank)
            if weight.grad is None:  # the optimizer moved the backward's gradient into its own buffer
                weight.grad = received
            else:
                weight.grad.add_(received)

    @torch.no_grad()
    def copy_tied_weight(self) -> None:
        """tie_embeddings: the last stage's head takes the first stage's embedding (at the start, after each
        update)."""
        if not self.tied:
            return
        if self.is_first:
            dist.send(self._stage_with("embed").embed.weight.contiguous(), dst=self.last_rank)
        elif self.is_last:
            weight = self._stage_with("lm_head").lm_head.weight
            received = torch.empty_like(weight)  # [V, D]
            dist.recv(received, src=self.first_rank)
            weight.copy_(received)

    def step(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor) -> None:
        """Forward and backward of every micro-batch of `inputs_BS` (split along the batch dimension)."""
        args = (inputs_BS,) if self.is_first else ()
        self.schedule.step(*args, target=targets_BS if self.is_last else None)

    def forward(self, inputs_BS: torch.Tensor, targets_BS: torch.Tensor | None = None) -> torch.Tensor | None:
        """Logits [B, S, V] of `inputs_BS` (with `targets_BS`: per-token losses [B, S], as Transformer.forward
        gives them) on the last stage's ranks, None elsewhere, without a backward: each stage in turn
        receives the previous one's hidden states, runs, and sends them on."""
        pp = dist.get_world_size(self.group)
        h = inputs_BS
        for index in range(self.n_stages):
            if index not in self.stage_indices:
                continue
            stage = self.stages[self.stage_indices.index(index)]
            if index > 0:
                dtype = next(stage.parameters()).dtype  # the residual stream's dtype: the parameters'
                B, S = inputs_BS.shape
                h = torch.empty(B, self.residual_seq_len(S), stage.cfg.dim, dtype=dtype, device=inputs_BS.device)
                dist.recv(h, src=dist.get_global_rank(self.group, (index - 1) % pp))
            h = stage(h, targets_BS) if index == self.n_stages - 1 else stage(h)
            if index < self.n_stages - 1:
                dist.send(h.contiguous(), dst=dist.get_global_rank(self.group, (index + 1) % pp))
        return h if self.is_last else None
