"""Pipeline parallelism: the model cut into stages, driven by torch.distributed.pipelining schedules.

The layers are cut into `pp * pp_virtual` stages of consecutive layers; stage 0 also holds
the embedding, the last stage the final norm and LM head. A stage is the model class itself
holding a subset of the whole model's modules (`cut_stage`), so its parameters keep their
names (`layers.5.attn.wq.weight`) and initial values. Stage s lives on pipeline rank s % pp
(looped placement: with `pp_virtual` > 1 each rank holds stages r, r + pp, ..., as the
interleaved schedule expects).

How many layers each stage takes: `parallel.pp_layers`, or the split whose costliest stage
is cheapest (`balanced_split`), with the embedding and the head counted on the end stages.

PyTorch's `PipelineStage` (as optimus.parallel.pipeline_stage.Stage, which keeps a receive buffer only while
its micro-batch needs it) and schedule classes run the micro-batches, for training (`step`)
and for evaluation (the schedule's forward-only `eval`); this module builds them, merges a
rank's stages into one module for the optimizer and checkpoints, and ties the embedding to
the head across stages. The last stage returns the per-token cross-entropy of the model's own
loss path (optimus.model.loss.head_cross_entropy: fused, vocabulary-masked), given the targets
as a keyword argument that the schedule splits into micro-batches like the inputs; the logits
are never materialised.
"""

from __future__ import annotations

import math
import time
from collections.abc import Callable
from dataclasses import dataclass

import torch
import torch.distributed as dist
from torch.distributed.pipelining import (
    Schedule1F1B,
    ScheduleGPipe,
    ScheduleInterleaved1F1B,
    ScheduleInterleavedZeroBubble,
)

from optimus.config import INTERLEAVED_SCHEDULES, ConfigError, ModelConfig
from optimus.kernels.torch_private import zero_bubble_order
from optimus.model import Transformer
from optimus.model.moe.experts import expert_offsets
from optimus.parallel.pipeline_stage import Stage
from optimus.parallel.state import ParallelState

# interleaved_zb: zero bubble (ZB1P), which splits each backward into the input gradient, sent on at once,
# and the weight gradient, run later to fill the bubble.
SCHEDULES = {
    "gpipe": ScheduleGPipe,
    "1f1b": Schedule1F1B,
    "interleaved_1f1b": ScheduleInterleaved1F1B,
    "interleaved_zb": ScheduleInterleavedZeroBubble,
}


@dataclass(frozen=True)
class PartCounts:
    """Parameters of a part of the model (a layer, the embedding, the head): routed experts apart."""

    dense: int = 0
    expert: int = 0

    def __add__(self, other: PartCounts) -> PartCounts:
        return PartCounts(self.dense + other.dense, self.expert + other.expert)


_PART_COUNTS: dict[str, tuple[list[PartCounts], PartCounts, PartCounts]] = {}  # by repr(model config)


def part_counts(cfg: ModelConfig) -> tuple[list[PartCounts], PartCounts, PartCounts]:
    """(per layer, embedding, final norm + LM head) parameter counts, on the meta device (no memory); counted once
    per model config (a layout search plans hundreds of layouts of one model)."""
    key = repr(cfg)
    if key not in _PART_COUNTS:
        _PART_COUNTS[key] = _count_parts(cfg)
    layers, embed, head = _PART_COUNTS[key]
    return list(layers), embed, head


def _count_parts(cfg: ModelConfig) -> tuple[list[PartCounts], PartCounts, PartCounts]:
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


def held_forwards(
    schedule: str, pp: int, pp_virtual: int, pp_rank: int, n_micro_batches: int, weights: list[float],
    moments: list[ScheduleMoment] | None = None,
) -> list[int]:  # fmt: skip
    """Forwards of each of pipeline rank `pp_rank`'s local stages whose activations it holds at once, at the point
    of the schedule where they weigh most, stage k's forwards each weighing `weights[k]` (what one keeps).

    GPipe runs every forward before any backward, 1F1B holds pp - rank. Interleaved 1F1B follows torch's action
    order (ScheduleInterleaved1F1B): a warm-up of (v - 1) rounds of micro-batches and two forwards more per hop
    from the last rank, the local stage of the i-th forward (i // per round) % v; then a forward and a backward in
    turn, the backwards taking the stages last first. Zero bubble holds each forward until its weight pass, counted
    along torch's order of its actions (`zero_bubble_moments`; `moments`: the rank's, when the caller has walked
    them already). Where a rank's stages
    differ in size the peak is not where the most forwards are held but where the heaviest are: on rank 1 of a
    pp 8 x v 2 pipeline with two rounds of micro-batches, 16 forwards of its first stage and 5 of its second."""
    if schedule == "gpipe":
        return [n_micro_batches] * pp_virtual
    if schedule == "1f1b":
        return [min(n_micro_batches, pp - pp_rank)]
    if schedule == "interleaved_zb":
        return heaviest_moment(moments or zero_bubble_moments(pp, pp_virtual, pp_rank, n_micro_batches), weights)
    per_round = n_micro_batches // max(1, n_micro_batches // pp)
    total = n_micro_batches * pp_virtual
    warmup = min((pp_virtual - 1) * per_round + 2 * (pp - 1 - pp_rank), total)
    held = [0] * pp_virtual
    for op in range(warmup):
        held[(op // per_round) % pp_virtual] += 1
    heaviest, most = list(held), sum(n * w for n, w in zip(held, weights))
    for op in range(warmup, total):  # each forward of the steady state runs before the next backward
        held[(op // per_round) % pp_virtual] += 1
        weight = sum(n * w for n, w in zip(held, weights))
        if weight > most:
            heaviest, most = list(held), weight
        held[pp_virtual - 1 - ((op - warmup) // per_round) % pp_virtual] -= 1
    return heaviest


@dataclass(frozen=True)
class ScheduleMoment:
    """A pipeline rank's state during one action of its schedule, per local stage: the forwards whose activations
    it holds (a weight pass's still among them), the weight passes (or full backwards) it has run, this one
    included (from the first, the stage's weight gradients are being summed), and the micro-batches whose input
    pass has run and weight pass has not ended (what an input pass leaves for its weight pass is alive)."""

    held: tuple[int, ...]
    weight_passes: tuple[int, ...]
    awaiting_weight: tuple[int, ...]


def zero_bubble_moments(pp: int, pp_virtual: int, pp_rank: int, n_micro_batches: int) -> list[ScheduleMoment]:
    """The state during each action of pipeline rank `pp_rank`'s zero-bubble order, counted from torch's own
    (optimus.kernels.torch_private.zero_bubble_order): a forward holds its micro-batch's activations until its
    weight pass, since the input pass keeps the graph for it; torch's order puts that pass a few actions later on
    most ranks, and a round later on the last."""
    held, passes, awaiting, moments = [0] * pp_virtual, [0] * pp_virtual, [0] * pp_virtual, []
    for kind, stage in zero_bubble_order(pp, pp_virtual, n_micro_batches, pp_rank):
        local = stage // pp
        held[local] += kind == "F"
        passes[local] += kind in ("W", "B")
        awaiting[local] += kind == "I"
        moments.append(ScheduleMoment(tuple(held), tuple(passes), tuple(awaiting)))
        held[local] -= kind in ("W", "B")
        awaiting[local] -= kind == "W"
    return moments


def distinct_moments(moments: list[ScheduleMoment]) -> list[ScheduleMoment]:
    """`moments` without repeats, in order: a state the order passes through twice (a weight pass and the forward
    after it often leave the same) weighs the same each time, and the planner prices each moment it keeps."""
    return list(dict.fromkeys(moments))


def heaviest_moment(moments: list[ScheduleMoment], weights: list[float]) -> list[int]:
    """The held forwards of the first of `moments` where they weigh most, stage k's forwards each `weights[k]`."""
    heaviest = max(moments, key=lambda moment: sum(n * w for n, w in zip(moment.held, weights)))
    return list(heaviest.held)


def last_stage_in_flight(
    schedule: str, n_micro_batches: int, pp: int = 1, pp_virtual: int = 1, moments: list[ScheduleMoment] | None = None
) -> int:
    """Most forwards of the last stage whose activations are held at once: under GPipe every micro-batch's, under
    the 1F1B family one, since a last stage's backward follows its forward at once; under zero bubble every one
    whose weight pass has not run yet (torch's order runs the last stage's input passes first; `moments`: the last
    pipeline rank's zero_bubble_moments, when the caller has walked them already)."""
    if schedule == "gpipe":
        return n_micro_batches
    if schedule != "interleaved_zb":
        return 1
    moments = moments or zero_bubble_moments(pp, pp_virtual, pp - 1, n_micro_batches)
    return max(moment.held[-1] for moment in moments)


def rank_stage_indices(pp_rank: int, pp: int, pp_virtual: int) -> list[int]:
    """The stages pipeline rank `pp_rank` holds (looped placement)."""
    return [pp_rank + k * pp for k in range(pp_virtual)]


def cut_stage(model: Transformer, layer_ids: list[int], embed: bool, head: bool) -> Transformer:
    """One pipeline stage of `model` (built whole on the meta device): a Transformer holding `model`'s own modules
    for the blocks `layer_ids`, with the embedding (`embed`) and the final norm and LM head (`head`)."""
    with torch.device("meta"):
        stage = Transformer(model.cfg, kernels="torch", layer_ids=[], embed=False, head=False)  # a shell: no norms
    stage.layers.update({str(i): model.layers[str(i)] for i in layer_ids})
    if embed:
        stage.embed = model.embed
    if head:
        stage.norm, stage.lm_head = model.norm, model.lm_head
    _order_as_the_model(stage)
    return stage


def _order_as_the_model(module: Transformer) -> None:
    """The whole model's module order (embedding first): the parameters are then listed as the whole model lists
    them, the order of the optimizer's flat buffers."""
    order = ("embed", "layers", "norm", "lm_head")
    module._modules = {name: module._modules[name] for name in order if name in module._modules}


def merge_stages(stages: list[Transformer]) -> Transformer:
    """One module holding a rank's stages, with each parameter under its whole-model name (for the optimizer,
    counts and checkpoints); it shares the stages' modules and is never called itself."""
    first = stages[0]
    with torch.device("meta"):  # empty: no layers, no embedding, no head
        merged = Transformer(first.cfg, kernels="torch", layer_ids=[], embed=False, head=False)
    for stage in stages:
        merged.layers.update(stage.layers)
        for name in ("embed", "norm", "lm_head"):
            if getattr(stage, name) is not None:
                setattr(merged, name, getattr(stage, name))
    _order_as_the_model(merged)
    if tied_head_copy(merged):
        # The head's weight is a copy of the embedding (tie_embeddings), which the first stage's optimizer
        # trains: held here as a buffer, it is saved and loaded under its name but not optimised twice.
        holder = torch.nn.Module()
        holder.register_buffer("weight", merged.lm_head.weight.detach())  # the stage's head, storage shared
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
    Under tensor parallelism a rank passes on its part of the residual stream (ps.residual_seq_len); the last
    stage gives the per-token loss [B, S] in fp32."""
    dtype = next(stage.parameters()).dtype  # the residual stream's dtype: the parameters'
    positions = ps.residual_seq_len(seq_len)
    with torch.device("meta"):
        if stage.embed is not None:
            inputs = torch.empty(micro_batch, seq_len, dtype=torch.long)  # [B, S] tokens
        else:
            inputs = torch.empty(micro_batch, positions, stage.cfg.dim, dtype=dtype, requires_grad=True)  # [B, s, D]
        if stage.lm_head is not None:
            outputs = torch.empty(micro_batch, seq_len, dtype=torch.float32, requires_grad=True)  # [B, S] loss
        else:
            outputs = torch.empty(micro_batch, positions, stage.cfg.dim, dtype=dtype, requires_grad=True)
    return inputs, outputs


@dataclass
class TiedEmbedding:
    """tie_embeddings with the embedding and the head on different pipeline ranks. The first stage trains the
    embedding; the last stage's head is a copy of it, whose gradient the sharder adds into the embedding's before
    its reduction (`exchange_gradient`) and which takes the embedding's values after each update
    (`exchange_weight`). Each last-stage rank pairs with the rank at its place in the first stage. The copy
    starts equal: both are initialised from the embedding's name (optimus.model.init), and a checkpoint holds the
    head under its own name with the embedding's values."""

    embedding: torch.nn.Parameter | None  # on a rank of the first stage
    head: torch.nn.Parameter | None  # on a rank of the last stage
    first_rank: int
    last_rank: int

    def exchange_gradient(self) -> torch.Tensor | None:
        """After a step's backwards: the head's gradient [V, D] on the first stage's rank (None on the other)."""
        if self.head is not None:
            grad = self.head.grad if self.head.grad is not None else torch.zeros_like(self.head)
            dist.send(grad.contiguous(), dst=self.first_rank)
            self.head.grad = None
            return None
        received = torch.empty_like(self.embedding)  # [V, D]
        dist.recv(received, src=self.last_rank)
        return received

    @torch.no_grad()
    def exchange_weight(self) -> None:
        """After an update: the head takes the embedding's values."""
        if self.embedding is not None:
            dist.send(self.embedding.detach().contiguous(), dst=self.last_rank)
        else:
            received = torch.empty_like(self.head)  # [V, D]
            dist.recv(received, src=self.first_rank)
            self.head.copy_(received)


def tied_embedding(stages: list[Transformer], stage_indices: list[int], n_stages: int, ps: ParallelState):
    """The TiedEmbedding of this rank's stages, or None (untied, one stage, or neither end of the pipeline)."""
    if not stages[0].cfg.tie_embeddings or n_stages == 1:
        return None
    embedding = next((s.embed.weight for s in stages if s.embed is not None), None)
    head = next((s.lm_head.weight for s in stages if s.lm_head is not None), None)
    if embedding is None and head is None:
        return None
    first_rank = dist.get_global_rank(ps.pp_group, 0)
    last_rank = dist.get_global_rank(ps.pp_group, (n_stages - 1) % ps.pp)
    return TiedEmbedding(embedding, head, first_rank, last_rank)


class _StageClock:
    """profile.timers for one stage, from public hooks: its forward (module pre- and post-hooks) and its
    backward, from the arrival of its output's gradient to that of its input's (the first stage, whose input is
    token ids: to its embedding's). A zero-bubble schedule's weight passes are not timed as the stage's (they
    count as pipeline wait): they start from saved intermediates, where no hook sees them begin."""

    def __init__(self, pipeline: Pipeline, index: int, stage: Transformer):
        self.pipeline, self.index = pipeline, index
        self.forward, self.backward = None, None  # the running phases' timer contexts and start times
        stage.register_forward_pre_hook(self._forward_begins)
        stage.register_forward_hook(self._forward_ends)
        if stage.embed is not None:
            stage.embed.weight.register_hook(self._backward_ends)

    def _begin(self, phase: str):
        context = self.pipeline.timers(phase)
        context.__enter__()
        return context, time.perf_counter()

    def _end(self, running) -> None:
        context, start = running
        context.__exit__(None, None, None)
        self.pipeline.stage_seconds[self.index] += time.perf_counter() - start

    def _forward_begins(self, module, args) -> None:
        if self.pipeline.timers:
            self.forward = self._begin("forward")

    def _forward_ends(self, module, args, output) -> None:
        if self.forward is None:
            return
        self._end(self.forward)
        self.forward = None
        if torch.is_grad_enabled() and output.requires_grad:
            _once(output, self._backward_begins)
            if args and isinstance(args[0], torch.Tensor) and args[0].requires_grad:
                _once(args[0], self._backward_ends)

    def _backward_begins(self, grad) -> None:
        if self.backward is None:
            self.backward = self._begin("backward")

    def _backward_ends(self, grad) -> None:
        if self.backward is not None:
            self._end(self.backward)
            self.backward = None


def _once(tensor: torch.Tensor, fn) -> None:
    """Call `fn(grad)` when `tensor`'s gradient is computed next, then forget it (a stage's received inputs are
    buffers it reuses every step)."""
    handle = None

    def hook(grad):
        handle.remove()
        fn(grad)

    handle = tensor.register_hook(hook)


class Pipeline:
    """This rank's stages and the schedule that runs a step's micro-batches through all stages.

    `step(batch)` runs the forward and backward of every micro-batch and returns their LM losses; the last
    stage's loss for the schedule is the mean per-token loss of a micro-batch over the micro-batches per step
    (the schedule does not rescale gradients). `eval_loss_sum(batch, weights)` runs the forwards only. With
    `timers` (profile.timers) the stages time their forwards and backwards; `pop_stage_seconds` sums them.
    """

    def __init__(
        self, stages: list[Transformer], stage_indices: list[int], n_stages: int, schedule: str,
        n_micro_batches: int, micro_batch: int, seq_len: int, ps: ParallelState, device: torch.device, timers=None,
    ):  # fmt: skip
        self.stages, self.stage_indices, self.n_stages = stages, stage_indices, n_stages
        self.n_micro_batches, self.micro_batch = n_micro_batches, micro_batch
        self.group = ps.pp_group
        self.timers = timers
        self.device = device
        self.stage_seconds = dict.fromkeys(stage_indices, 0.0)
        self.lm_losses: list[torch.Tensor] = []  # the last stage's, per micro-batch of a step
        self.evaluating = False
        pipeline_stages = []
        for stage, index in zip(stages, stage_indices):
            inputs, outputs = stage_io_meta(stage, micro_batch, seq_len, ps)
            pipeline_stages.append(
                Stage(stage, index, n_stages, device, input_args=inputs, output_args=outputs, group=self.group)
            )
            if timers:
                _StageClock(self, index, stage)
        self.pipeline_stages = pipeline_stages  # torch's stage objects, whose actions a step trace marks
        schedule_cls = SCHEDULES[schedule]
        driven = pipeline_stages if schedule in INTERLEAVED_SCHEDULES else pipeline_stages[0]
        self.schedule = schedule_cls(driven, n_microbatches=n_micro_batches, loss_fn=self._loss, scale_grads=False)
        self.is_first, self.is_last = 0 in stage_indices, n_stages - 1 in stage_indices

    def _loss(self, loss_BS: torch.Tensor, target: torch.Tensor) -> torch.Tensor:
        """The schedule's loss of one micro-batch on the last stage, from the per-token losses its forward gave.
        Training: the mean over the micro-batches of the step, whose backward drives the pipeline's (its LM loss
        is kept). Evaluation (`target` the sequences' weights [B]): the fp64 weighted sum of the token losses."""
        if self.evaluating:
            return (loss_BS.sum(1).double() * target).sum()
        lm_loss = loss_BS.mean()
        self.lm_losses.append(lm_loss.detach())
        return lm_loss / self.n_micro_batches

    def pop_stage_seconds(self) -> list[float]:
        """Seconds each stage spent in its forwards and backwards since the last call, [n_stages], on every
        rank of the pipeline group (a collective over it)."""
        seconds_S = torch.zeros(self.n_stages, dtype=torch.float64, device=self.device)  # [S]
        for index, seconds in self.stage_seconds.items():
            seconds_S[index] = seconds
        self.stage_seconds = dict.fromkeys(self.stage_indices, 0.0)
        dist.all_reduce(seconds_S, group=self.group)
        return seconds_S.tolist()

    def step(self, batch_BS1: torch.Tensor) -> torch.Tensor:
        """Forward and backward of every micro-batch of `batch_BS1` ([M x B, S + 1] token windows, split along the
        batch); the M micro-batches' LM losses [M] on every rank of the pipeline group."""
        inputs_BS, targets_BS = batch_BS1[:, :-1], batch_BS1[:, 1:]
        self.lm_losses = []
        args = (inputs_BS,) if self.is_first else ()
        self.schedule.step(*args, target=targets_BS, return_outputs=False, targets_BS=targets_BS)
        lm_losses_M = torch.zeros(self.n_micro_batches, device=self.device)  # [M]
        if self.is_last:
            lm_losses_M = torch.stack(self.lm_losses)
        dist.all_reduce(lm_losses_M, group=self.group)  # the last stage's values, zeros from the others
        return lm_losses_M

    @torch.no_grad()
    def eval_loss_sum(self, batch_BS1: torch.Tensor, weight_B: torch.Tensor) -> torch.Tensor:
        """fp64 sum over the tokens of `batch_BS1` (M micro-batches) of the next-token loss, each sequence weighted
        by `weight_B` (0 = padding), on the last stage's ranks; 0 on the others."""
        inputs_BS, targets_BS = batch_BS1[:, :-1], batch_BS1[:, 1:]
        losses: list[torch.Tensor] = []
        args = (inputs_BS,) if self.is_first else ()
        self.evaluating = True
        try:
            self.schedule.eval(*args, target=weight_B, losses=losses, targets_BS=targets_BS)
        finally:
            self.evaluating = False
        if not self.is_last:
            return torch.zeros((), dtype=torch.float64, device=self.device)
        return torch.stack(losses).sum()
