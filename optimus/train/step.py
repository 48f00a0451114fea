"""One rank's optimizer step, built one way for a training run, a dry run and the predictor.

`parallel_state_of(spec)` makes the run's process groups; `TrainStep(spec, ps)` builds on them what a step
needs - this rank's model (run by a pipeline when pp > 1), its router statistics and the optimizer - and
`run(micro_batches, ...)` runs one step of gradient accumulation and the optimizer's update. What differs
between callers is handed in, never set afterwards: a dry run builds inside a fake tensor mode
(`tensor_mode`) with its load model's answers to the reads of values (`answers`), a run fills the parameters
from a checkpoint (`load_weights`); the step's micro-batches,
its step number, whether a stop was asked for and a collective recorder are arguments of `run`.
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from contextlib import contextmanager, nullcontext

import torch
import torch.distributed as dist

from optimus import fake_device
from optimus.config import ConfigError, MoEConfig, OptimusConfig
from optimus.device_memory import synchronize
from optimus.kernels import KernelUnavailable, get_backend
from optimus.model import Transformer, build_model, moe_layer_ids
from optimus.model.moe import RouterStats, router_loss
from optimus.optim import build_optimizer, lr_at
from optimus.parallel import ParallelState, build_parallel_state
from optimus.parallel.parallelize import parallelize
from optimus.parallel.pipeline import Pipeline
from optimus.platform import Platform
from optimus.run_spec import RunSpec
from optimus.train.faults import (
    TrainingDiverged,
    nonfinite_parameters_message,
    pack_step_flags,
    parameters_finite,
    summed_counts,
    unpack_step_flags,
)
from optimus.train.metrics import expert_load_imbalance
from optimus.train.timers import Timers


def autocast_context(cfg: OptimusConfig, platform: Platform):
    if cfg.train.dtype == "bf16":
        return torch.autocast(device_type=platform.device_type, dtype=torch.bfloat16)
    return nullcontext()


def micro_batch_loss(model: Transformer, batch_BS1: torch.Tensor, cfg: OptimusConfig, platform: Platform):
    """Next-token cross-entropy of one micro-batch of `seq_len + 1` windows. Its backward also trains the
    routers: their losses ride on the graph (optimus.model.moe.stats), their values go to the RouterStats."""
    inputs_BS, targets_BS = batch_BS1[:, :-1], batch_BS1[:, 1:]
    with autocast_context(cfg, platform):
        return model(inputs_BS, targets_BS).mean()  # the head's cross-entropy, fused (optimus.model.loss)


def step_loss_sums(lm_losses_M: torch.Tensor, router_losses_M3: torch.Tensor, moe: MoEConfig) -> torch.Tensor:
    """[4]: sums over micro-batches of (loss, lm_loss, aux_loss, z_loss), where a micro-batch's loss is its
    LM loss plus its weighted router losses (`router_losses_M3`: its aux, z, seq losses, means over layers)."""
    sums_4 = torch.zeros(4, device=lm_losses_M.device)
    for lm_loss, (aux_loss, z_loss, seq_aux_loss) in zip(lm_losses_M, router_losses_M3):
        loss = lm_loss + router_loss(moe, aux_loss, z_loss, seq_aux_loss)
        sums_4 += torch.stack([loss, lm_loss, aux_loss, z_loss])
    return sums_4


def parallel_state_of(spec: RunSpec) -> ParallelState:
    """The process groups of the run's layout on the initialised default group (a single process: none)."""
    platform, p = spec.platform, spec.cfg.parallel
    if platform.device_type != "cpu" and not platform.traced and fake_device.registered():
        raise RuntimeError(
            "this process has registered a dry run's stand-in device, and torch's autograd engine then cannot "
            "run a backward on a real GPU: run the GPU's step in a fresh process (optimus plan runs in its own)."
        )
    shard_ranks = spec.cfg.optim.shard_ranks
    ps = build_parallel_state(p.ep, p.timeout_s, p.pp, p.tp, platform.device_type, p.sp, p.pp_virtual, shard_ranks)
    if ps.layout != spec.layout:
        raise RuntimeError(f"a run resolved for {spec.layout}, in a group laid out as {ps.layout}")
    return ps


class TrainStep:
    """This rank's part of a run's step: model (and pipeline), router statistics, optimizer, and `run`."""

    def __init__(self, spec: RunSpec, ps: ParallelState, load_weights=None, tensor_mode=None, answers=None):
        """`load_weights(model)` fills the parameters before the optimizer takes its master copy; the model and
        optimizer are built inside `tensor_mode` (a dry run's FakeTensorMode), the process groups `ps` outside
        it (a DeviceMesh reads its ranks back); `answers` (a dry run's optimus.load_model.LoadAnswers) answer
        the step's reads of values that fake tensors do not hold, in the dispatchers and the kernels."""
        self.answers = answers
        self.spec, self.cfg, self.platform, self.ps = spec, spec.cfg, spec.platform, ps
        self.device = self.platform.device
        self.accum = spec.layout.micro_batches(self.cfg.train.global_batch, self.cfg.train.micro_batch)
        with tensor_mode or nullcontext():
            self._build(load_weights)

    def _build(self, load_weights) -> None:
        cfg, t = self.cfg, self.cfg.train
        # profile.timers: the dispatchers, the pipeline stages and the optimizer time their work through it.
        self.timers = Timers(cfg.profile.timers, lambda: synchronize(self.platform))
        try:  # the backend for the device the step runs on (a dry run's: the device it stands in for)
            reads = self.answers.row_reads() if self.answers is not None else None
            self.kernels = get_backend(cfg.kernels, self.device.type, self.platform.traced, reads)
        except KernelUnavailable as err:  # the `kernels` key: the user's to change
            raise ConfigError(str(err)) from None
        model = build_model(cfg.model, self.kernels)
        parts = parallelize(model, self.ps, cfg, self.device, self.timers, self.answers)
        self.model = parts.module  # every parameter this rank holds, under its whole-model name
        self.stages = parts.stages  # the modules this rank runs forward, in stage order
        self.pipeline: Pipeline | None = None  # pp > 1: this rank's stages and their schedule
        if parts.n_stages > 1:
            self.pipeline = Pipeline(
                parts.stages, parts.stage_indices, parts.n_stages, cfg.parallel.pp_schedule, self.accum,
                t.micro_batch, t.seq_len, self.ps, self.device, self.timers,
            )  # fmt: skip
        # The routers' losses, tokens per expert and bias updates, per step; their gradients follow the
        # LM loss's 1 / accum.
        moe = cfg.model.moe
        self.router_stats = RouterStats(moe_layer_ids(cfg.model), moe.n_experts, self.device, 1.0 / self.accum)
        self.model.attach_router_stats(self.router_stats)
        if load_weights is not None:
            load_weights(self.model)
        self.optimizer = build_optimizer(self.model, cfg, self.ps.stage(), self.timers, self.accum, parts.tied)
        if cfg.optim.overlap_param_gather:  # the modules this rank runs forward wait for their own parameters
            self.optimizer.overlap_param_gather(parts.stages)

    @contextmanager
    def _optimizer_phase(self, collectives) -> Iterator[None]:
        """The optimizer's part of the step: timed as `optimizer`, its collectives marked as the optimizer's
        (`collectives`: a CollectiveTrace, or None)."""
        with self.timers("optimizer"), collectives.phase("optimizer") if collectives is not None else nullcontext():
            yield

    def run(
        self, micro_batches: list[torch.Tensor], step: int, stop_requested: Callable[[], bool], collectives=None
    ) -> tuple[dict, bool]:
        """One optimizer step of `step`'s `accum` micro-batches ([micro_batch, seq_len + 1] windows each):
        (its record, whether every rank agreed to stop after it). `stop_requested()` is asked once the backward
        is done; `collectives` (a CollectiveTrace) is told which collectives are the optimizer's."""
        cfg, ps, timers = self.cfg, self.ps, self.timers
        self.model.train()
        self.router_stats.reset()
        if self.pipeline is not None:
            # The whole schedule; the stages time their own forwards and backwards inside it, so what
            # pipeline_wait keeps is this rank's idle time (the bubble) and its activation transfers.
            batch_BS1 = torch.cat(micro_batches).to(self.device, non_blocking=True)
            with timers("pipeline_wait"), autocast_context(cfg, self.platform):
                lm_losses_M = self.pipeline.step(batch_BS1)
        else:
            lm_losses = []
            for batch in micro_batches:  # the optimizer counts the backwards: the last one completes each gradient
                with timers("forward"):
                    lm_loss = micro_batch_loss(self.model, batch.to(self.device, non_blocking=True), cfg, self.platform)
                with timers("backward"):
                    (lm_loss / self.accum).backward()
                lm_losses.append(lm_loss.detach())
            lm_losses_M = torch.stack(lm_losses)
        # Every MoE layer's losses per micro-batch; with pp > 1 the stages' layers are summed in.
        router_losses_M3 = self.router_stats.micro_batch_means(len(micro_batches), ps.pp_group)
        sums_4 = step_loss_sums(lm_losses_M, router_losses_M3, cfg.model.moe)
        counts_LE = self.router_stats.tokens_per_expert()  # [L, E] or None
        self.optimizer.wait_for_params()  # (the forward has waited for their all-gathers)
        params_finite = parameters_finite(self.model)
        stop = stop_requested()
        with self._optimizer_phase(collectives):
            sq_norm = self.optimizer.reduce_gradients()  # the gradients' reductions end here
        # One reduction and one read agree on the losses, on which ranks saw a non-finite loss, on a stop signal, on
        # whether the last update left non-finite parameters, on the gradient norm and on the tokens per expert: a
        # GPU's queue drains once for them all.
        flags = pack_step_flags(sums_4, ps.rank, ps.world_size, stop, params_finite, sq_norm, counts_LE)
        if ps.pp_rank > 0:
            flags[:4] = 0  # every stage holds the same loss sums: count the first stage's only
        # The tp ranks of a group hold the same LM loss and each a 1/tp share's router losses: their mean
        # over the group is the micro-batch's, so the sums are averaged over all of a stage's ranks.
        if ps.is_distributed:
            dist.all_reduce(flags)
        counts_shape = None if counts_LE is None else tuple(counts_LE.shape)
        agreed = unpack_step_flags(flags, self.accum * ps.stage_size, counts_shape)
        if agreed.nonfinite_params:  # every rank stops here
            self.optimizer.zero_grad()
            raise TrainingDiverged(nonfinite_parameters_message(step))
        means = agreed.means

        lr = lr_at(step, cfg.optim, cfg.train.steps)
        with self._optimizer_phase(collectives):
            if agreed.nonfinite_ranks:  # every rank skips: no update, no bias update (the batch is consumed)
                grad_norm = float("nan")
            else:
                grad_norm = self.optimizer.global_norm(agreed.sq_norm)
                self.optimizer.apply(lr, grad_norm)  # skips the update itself if the norm is not finite
            self.optimizer.zero_grad()
        skipped = bool(agreed.nonfinite_ranks) or not math.isfinite(grad_norm)
        # Each rank routed its own tokens (a tp rank 1/tp of its group's, a pipeline rank its stages' layers), so
        # the summed counts hold every layer's assignments over the global batch once.
        tokens_LE = agreed.tokens_per_expert
        if not skipped and counts_LE is not None and cfg.model.moe.router == "sigmoid":
            summed_LE = summed_counts(flags, counts_shape)
            for moe in self.model.moe_layers:
                moe.update_bias(summed_LE[self.router_stats.row(moe.layer_idx)], cfg.model.moe.bias_update_rate)
        record = {
            "loss": means[0], "lm_loss": means[1], "aux_loss": means[2], "z_loss": means[3],
            "grad_norm": grad_norm, "lr": lr, "skipped": skipped,
            "expert_load_imbalance": expert_load_imbalance(tokens_LE), "expert_tokens": tokens_LE,
        }  # fmt: skip
        if agreed.nonfinite_ranks:
            record["nonfinite_ranks"] = agreed.nonfinite_ranks
        if self.pipeline is not None and timers:  # profile.timers: each stage's forward + backward seconds
            record["stage_time_s"] = self.pipeline.pop_stage_seconds()
        return record, agreed.stop
