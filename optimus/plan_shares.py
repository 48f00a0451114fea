"""What each pipeline rank of a layout holds, for the planner (optimus.plan): its stages, layers and parameter
counts (RankShare, as optimus.parallel.pipeline splits the model), which parameters tensor parallelism splits,
and each optimizer group's parameters with the shapes a rank holds (for what the update rule's step plans from
the real buffer layout: optimus.optim.muon_plan)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

from optimus.config import ModelConfig, OptimusConfig, ParallelConfig
from optimus.layout import Layout
from optimus.model import ParamCounts, Transformer, padded_vocab_size
from optimus.parallel.flat_buffer import param_groups
from optimus.parallel.pipeline import (
    PartCounts,
    ScheduleMoment,
    cut_stage,
    distinct_moments,
    held_forwards,
    last_stage_in_flight,
    merge_stages,
    part_counts,
    rank_stage_indices,
    stage_layer_ids,
    stage_sizes,
    zero_bubble_moments,
)


def meta_model(m: ModelConfig) -> Transformer:
    """The whole model of config `m` on the meta device: its parameters' names and shapes, no memory."""
    with torch.device("meta"):
        return Transformer(m, kernels="torch")


def tp_split_names(model: Transformer) -> set[str]:
    """The parameters of `model` (whole, as meta_model builds it) that tensor parallelism splits over the tp ranks
    (optimus.parallel.tensor_parallel): attention's q/k/v/out projections (and with qk_norm=full the norms'
    weights, split like the q and k columns they scale), dense SwiGLU layers, the embedding's and the LM head's
    rows; norms, routers, shared and routed experts stay whole on every tp rank."""
    names = {"embed.weight", "lm_head.weight"}
    for i, block in model.layers.items():
        attn = [f"attn.{proj}.weight" for proj in ("wq", "wk", "wv", "wo")]
        if block.attn.qk_norm == "full":
            attn += ["attn.q_norm.weight", "attn.k_norm.weight"]
        ffn = [] if block.is_moe else [f"ffn.{name}" for name, _ in block.ffn.named_parameters()]
        names.update(f"layers.{i}.{name}" for name in attn + ffn)
    return names


def tp_split_params(model: Transformer) -> tuple[list[int], int, int]:
    """(per layer, embedding, final norm + LM head): the elements of the parameters of `model` (meta_model's) that
    tensor parallelism splits (tp_split_names)."""
    split = tp_split_names(model)
    per_layer = [
        sum(p.numel() for name, p in block.named_parameters(prefix=f"layers.{i}") if name in split)
        for i, block in model.layers.items()
    ]
    return per_layer, model.embed.weight.numel(), model.lm_head.weight.numel()


def local_dense_params(dense: int, tp_split: int, tp: int) -> int:
    """Dense parameters one tp rank holds of `dense`: 1/tp of the `tp_split` ones, all of the replicated ones."""
    return dense - tp_split + tp_split // tp


@dataclass(frozen=True)
class StageParams:
    """The parameters of one of a pipeline rank's stages, counted as RankShare counts the rank's."""

    dense: int
    expert: int
    tp_split: int

    def local_dense(self, tp: int) -> int:
        return local_dense_params(self.dense, self.tp_split, tp)


@dataclass
class RankShare:
    """What one pipeline rank holds (the whole model when pp = 1)."""

    pp_rank: int
    stages: list[int]
    layers: list[int]
    embed: bool
    head: bool
    dense: int  # parameters, all experts counted in `expert`
    expert: int
    in_flight: float  # micro-batches' worth of its layers' activations held at the peak
    head_copy: int = 0  # tie_embeddings: the last stage's copy of the embedding, held but not optimised
    tp_split: int = 0  # the part of `dense` that tensor parallelism splits (whole-model count)
    sent_outputs: float = 0  # stage outputs held at the peak: torch's schedule keeps each until its backward
    stage_layers: list[list[int]] | None = None  # pp > 1: the layers of each of `stages`
    head_in_flight: float = 1  # micro-batches' worth of the head's activations held at the peak (with `head`)
    # Zero bubble: each of its stages' parameters, and the rank's state after each action of its order (the peak
    # is where held activations and the gradient sums begun by weight passes weigh most together: optimus.plan)
    stage_params: list[StageParams] | None = None
    moments: list[ScheduleMoment] | None = None
    # With Muon, which plans its step from them: each optimizer group's (name, shape) on one rank, and the
    # tp-split parameters' split dimension (rank_param_shapes)
    param_shapes: tuple[dict[str, list[tuple[str, tuple[int, ...]]]], dict[str, int]] | None = None

    def local_dense(self, tp: int) -> int:
        """Dense parameters one tp rank holds: 1/tp of the split ones, all of the replicated ones."""
        return local_dense_params(self.dense, self.tp_split, tp)

    def per_device(self, tp: int, ep: int) -> int:
        """Parameters one device of this pipeline rank holds: its dense slices, its experts, a tied head's copy."""
        return self.local_dense(tp) + self.expert // ep + self.head_copy


def rank_shares(cfg: OptimusConfig, counts: ParamCounts, stage: Layout, accum: int) -> list[RankShare]:
    """Each pipeline rank's stages, layers and parameters, as the trainer splits them (optimus.parallel.pipeline),
    with `accum` micro-batches per step, on one pipeline stage's ranks `stage`; with optim.update=muon, also the
    shapes its step is planned from (param_shapes). The model is built on the meta device once, where needed."""
    m, p = cfg.model, cfg.parallel
    with_shapes = cfg.optim.update == "muon"
    model = meta_model(m) if p.tp > 1 or with_shapes else None
    split = tp_split_names(model) if p.tp > 1 else set()
    tp_split = tp_split_params(model) if p.tp > 1 else None
    shares = _pipeline_shares(cfg, counts, accum, tp_split)
    for share in shares if with_shapes else []:
        share.param_shapes = rank_param_shapes(model, share, p, stage, split)
    return shares


def _pipeline_shares(
    cfg: OptimusConfig, counts: ParamCounts, accum: int, tp_split: tuple[list[int], int, int] | None
) -> list[RankShare]:
    """rank_shares without the shapes; `tp_split`: tp_split_params of the model (None without tp)."""
    m, p = cfg.model, cfg.parallel
    split_layers, split_embed, split_head = tp_split or ([0] * m.n_layers, 0, 0)
    if p.pp == 1:
        split = sum(split_layers) + split_embed + split_head
        return [RankShare(0, [0], list(range(m.n_layers)), True, True, counts.dense, counts.expert, 1, 0, split)]
    n_stages = p.pp * p.pp_virtual
    stage_layers = stage_layer_ids(stage_sizes(m, n_stages, p.pp_layers))
    layers, embed, head = part_counts(m)
    shares = []
    for rank in range(p.pp):
        stages = rank_stage_indices(rank, p.pp, p.pp_virtual)
        ids = [i for stage in stages for i in stage_layers[stage]]
        first, last = 0 in stages, n_stages - 1 in stages
        held = [layers[i] for i in ids] + [embed] * first + [head] * last
        total = sum(held, PartCounts())
        split = sum(split_layers[i] for i in ids) + split_embed * first + split_head * last
        head_copy = m.dim * padded_vocab_size(m.vocab_size) if m.tie_embeddings and last else 0
        # Each stage's forwards weighted by its layers: what a forward keeps, where every layer keeps the same (all
        # the recipes' models; a first_k_dense layer keeps less than an MoE one)
        sizes = [len(stage_layers[stage]) for stage in stages]
        # Zero bubble's order is walked once per rank: its moments give the planner's peak (optimus.plan) and the
        # summary figures below; the other schedules' peaks have closed forms.
        zero_bubble = p.pp_schedule == "interleaved_zb"
        moments = distinct_moments(zero_bubble_moments(p.pp, p.pp_virtual, rank, accum)) if zero_bubble else None
        held = held_forwards(p.pp_schedule, p.pp, p.pp_virtual, rank, accum, sizes, moments)
        head_in_flight = last_stage_in_flight(p.pp_schedule, accum, p.pp, p.pp_virtual, moments) if last else 0
        in_flight = sum(n * size for n, size in zip(held, sizes)) / sum(sizes)
        chunks = sum(held)
        # Outputs held: one per chunk in flight, but the last stage's, whose backward follows its forward at once
        # (on the last rank of an interleaved schedule, every chunk in flight but the one of the last stage).
        sent = chunks if not last else (chunks - 1 if p.pp_virtual > 1 else 0)
        share = RankShare(rank, stages, ids, first, last, total.dense - head_copy, total.expert, in_flight,
                          head_copy, split, sent, [stage_layers[i] for i in stages], head_in_flight)  # fmt: skip
        if moments is not None:
            share.moments = moments
            share.stage_params = [
                _stage_params(stage_layers[i], layers, embed if i == 0 else None, head if i == n_stages - 1 else None,
                              split_layers, split_embed, split_head, head_copy)
                for i in stages
            ]  # fmt: skip
        shares.append(share)
    return shares


def _stage_params(
    ids: list[int], layers: list[PartCounts], embed: PartCounts | None, head: PartCounts | None,
    split_layers: list[int], split_embed: int, split_head: int, head_copy: int,
) -> StageParams:  # fmt: skip
    """One stage's parameters: its layers', with the embedding's on the first stage and the final norm's and LM
    head's on the last (less a tied head's copy, which no optimizer group holds)."""
    total = sum([layers[i] for i in ids] + [part for part in (embed, head) if part is not None], PartCounts())
    split = sum(split_layers[i] for i in ids) + split_embed * (embed is not None) + split_head * (head is not None)
    return StageParams(total.dense - head_copy * (head is not None), total.expert, split)


def rank_param_shapes(
    model: Transformer, share: RankShare, p: ParallelConfig, stage: Layout, tp_split: set[str]
) -> tuple[dict[str, list[tuple[str, tuple[int, ...]]]], dict[str, int]]:
    """The parameters of each optimizer group ("dense", "expert") that a rank of pipeline rank `share` holds, in
    the order the optimizer lays them out (its stages cut from `model`, the whole model on the meta device, and
    merged as the trainer does), with the shapes they have there: experts [E / ep, ...], the `tp_split`
    parameters with one dimension divided by tp; and those split ones' names -> the dimension divided (the
    first that tp divides: what a rank's step holds depends on their element counts and their whole shapes,
    not on which dimension tensor parallelism splits)."""
    n_stages = p.pp * p.pp_virtual
    if n_stages == 1:
        held = model
    else:
        stages = [
            cut_stage(model, layers, embed=i == 0, head=i == n_stages - 1)
            for i, layers in zip(share.stages, share.stage_layers)
        ]
        held = merge_stages(stages)
    groups, split_dims = {}, {}
    for kind, named in param_groups(held).items():
        groups[kind] = []
        for name, param in named:
            shape = tuple(param.shape)
            if kind == "expert":
                shape = (shape[0] // stage.ep, *shape[1:])
            elif name in tp_split and stage.tp > 1:
                dim = split_dims[name] = next(d for d, n in enumerate(shape) if n % stage.tp == 0)
                shape = (*shape[:dim], shape[dim] // stage.tp, *shape[dim + 1 :])
            groups[kind].append((name, shape))
    return groups, split_dims
