"""The training loop: one rank's view of a run.

`train(cfg)` runs on every rank of an initialised process group (or alone). The
order of work is: layout -> data -> model (same init on every rank, then
parallelised from outside) -> optimizer -> steps of gradient accumulation,
each followed by one optimizer step, periodic evaluation and logging.
"""

from __future__ import annotations

import concurrent.futures
import json
import math
import sys
import time
from contextlib import ExitStack, nullcontext
from dataclasses import dataclass
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from tqdm import tqdm

from optimus import fake_device
from optimus.config import ConfigError, MoEConfig, OptimusConfig
from optimus.data import BatchLoader, build_data, eval_batches, eval_set_size
from optimus.host_syncs import HostSyncCounter
from optimus.kernels import KernelUnavailable, get_backend
from optimus.model import Transformer, build_model, count_params, count_params_of_config, flops_per_token, moe_layer_ids
from optimus.model.moe import RouterStats, router_loss
from optimus.optim import build_optimizer, lr_at
from optimus.parallel import ParallelState, build_parallel_state
from optimus.parallel.collective_check import check_collectives
from optimus.parallel.collective_trace import CollectiveTrace, write_trace
from optimus.parallel.parallelize import parallelize
from optimus.parallel.pipeline import Pipeline
from optimus.platform import (
    Platform,
    cpu_share,
    detect_platform,
    peak_flops_per_device,
    peak_memory_bytes,
    release_free_cpu_memory,
    reset_peak_memory,
    synchronize,
)
from optimus.ranks import report_saved_at_stop
from optimus.run_spec import RunSpec, resolve_run
from optimus.train import step_memory
from optimus.train.checkpoint import Checkpointer, candidates
from optimus.train.faults import (
    StopSignal,
    TrainingDiverged,
    nonfinite_parameters_message,
    pack_step_flags,
    parameters_finite,
    parameters_finite_on_every_rank,
    summed_counts,
    too_many_skipped_message,
    unpack_step_flags,
)
from optimus.train.intervals import due_every
from optimus.train.kernel_check import check_kernels, kernel_check_enabled
from optimus.train.metrics import (
    MetricsLog,
    RunWriteError,
    console_line,
    expert_load_imbalance,
    throughput,
    write_json_atomic,
    write_problem,
    write_text_atomic,
)
from optimus.train.run_dir import (
    ClaimLost,
    last_record_step,
    lost_claim,
    next_command,
    remove_if_empty,
    resolve_run_dir,
    resume_hint,
    truncate_metrics,
)
from optimus.train.step_memory import step_memory_tracker
from optimus.train.timers import Timers, TorchTrace


@dataclass
class StepLosses:
    """Sums over this rank's micro-batches, then averaged over the global batch."""

    loss: float
    lm_loss: float
    aux_loss: float
    z_loss: float


def autocast_context(cfg: OptimusConfig, platform: Platform):
    if cfg.train.dtype == "bf16":
        return torch.autocast(device_type=platform.device_type, dtype=torch.bfloat16)
    return nullcontext()


def eval_loss_sum(model, batch_BS1: torch.Tensor, weight_B: torch.Tensor, cfg, platform) -> torch.Tensor:
    """fp64 sum over tokens of next-token cross-entropy, each sequence weighted by `weight_B` (0 = padding); the
    head's cross-entropy is fused, so a long sequence's logits are never all alive."""
    inputs_BS, targets_BS = batch_BS1[:, :-1], batch_BS1[:, 1:]
    with autocast_context(cfg, platform):
        loss_BS = model(inputs_BS, targets_BS)
    return (loss_BS.sum(1).double() * weight_B).sum()


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


def schedule_batches(batches: list[tuple[torch.Tensor, torch.Tensor]], n: int):
    """(windows [n x B, S + 1], weights [n x B]) of `n` micro-batches of (windows, weights) at a time, the last
    group completed with copies of its first micro-batch at weight 0 (what a pipeline schedule needs)."""
    for start in range(0, len(batches), n):
        group = batches[start : start + n]
        group += [(group[0][0], torch.zeros_like(group[0][1]))] * (n - len(group))
        yield torch.cat([b for b, _ in group]), torch.cat([w for _, w in group])


class Trainer:
    def __init__(self, run: OptimusConfig | RunSpec, local_rank: int = 0):
        """`run`: a RunSpec (optimus.run_spec), or a config, which is resolved and validated here for this process
        (its device for `local_rank`, the world of the initialised process group)."""
        if not isinstance(run, RunSpec):
            world_size = dist.get_world_size() if dist.is_initialized() else 1
            run = resolve_run(run, world_size, detect_platform(run.machine, local_rank))
        spec = run
        if spec.platform.path != "cpu":
            torch.get_device_module(spec.platform.device_type).set_device(spec.platform.device)
        self._init_layout(spec)
        cfg, p = self.cfg, self.cfg.parallel
        compute_dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
        if p.check_collectives:  # before anything is written: a backend that corrupts data stops the run here
            check_collectives(self.ps, self.platform.device, compute_dtype, p.dispatcher)
        if kernel_check_enabled(cfg.check_kernels, self.platform.device_type):  # and so does a wrong kernel
            check_kernels(cfg, self.ps, self.platform.device, compute_dtype)
            reset_peak_memory(self.platform)  # its tensors are gone: the memory figures are the run's
        self.run_dir = resolve_run_dir(cfg, self.ps)

        self.data = build_data(cfg.data, cfg.train.seq_len, cfg.train.seed)
        if self.data.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"The tokenizer has {self.data.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}: "
                f"set model.vocab_size >= {self.data.vocab_size}."
            )
        self.memory_before_model = peak_memory_bytes(self.platform)  # CPU: the interpreter, libraries, data
        # Where the run starts: its own latest checkpoint, else checkpoint.load. Weights-only loads come
        # before the optimizer is built, since it takes its own copy of the parameters.
        self.checkpointer = Checkpointer(
            cfg, self.run_dir, self.ps, self.platform.device_type, data_identity=self.data.identity
        )
        start_mode, start_paths = self.checkpointer.start_point()
        weights_only = start_mode == "weights"
        self._init_step(partial(self.checkpointer.load_weights, start_paths[0]) if weights_only else None)
        # A pipeline rank holds some layers only: count the whole model from the config.
        self.param_counts = (
            count_params(self.model, cfg.model) if self.pipeline is None else count_params_of_config(cfg.model)
        )
        self.flops_per_token = flops_per_token(self.param_counts, cfg.model, cfg.train.seq_len)
        # On a CPU the peak is a matmul probe in the dtype the run computes in.
        self.peak_flops, self.peak_source = peak_flops_per_device(self.platform, cfg.machine, compute_dtype)
        self.trace = TorchTrace(
            cfg.profile.torch, cfg.profile.torch_steps, self.run_dir, self.ps.rank, self.platform.device_type
        )

        # Every pipeline stage reads the same data, and so do the ranks of a tensor-parallel group.
        t, data_rank, data_world = cfg.train, self.ps.dp_rank, self.ps.dp
        self.loader = BatchLoader(
            self.data.train, t.global_batch, t.micro_batch, data_rank, data_world, t.seed, prefetch=cfg.data.prefetch,
            pin_memory=self.platform.device_type != "cpu",
        )  # fmt: skip
        # A fixed held-out set of sequences, the same in every layout (see eval_batches).
        self.eval_batches = [
            (batch.to(self.device), weight.to(self.device, torch.float64))
            for batch, weight in eval_batches(self.data.val, t.eval_sequences, t.micro_batch, data_rank, data_world)
        ]
        self.eval_sequences = eval_set_size(self.data.val, t.eval_sequences)  # all it has, when it has fewer
        self.eval_tokens = self.eval_sequences * t.seq_len
        if start_mode in ("resume", "load"):
            restored = self.checkpointer.resume(
                start_paths, start_mode == "load", self.model, self.optimizer, self.loader
            )
            if restored is not None:
                self.step, self.skipped_in_row = restored.step, restored.skipped_in_row
        self.tokens_seen = self.step * t.global_batch * t.seq_len

    @classmethod
    def for_one_step(cls, spec: RunSpec, tensor_mode=None) -> Trainer:
        """What `train_step` needs and nothing more: the layout, model, router statistics and optimizer; the
        caller sets `.loader` (whose `next_step()` gives a step's `accum` micro-batches). `optimus plan
        --dry-run` runs this on fake tensors: no collective check, run directory, data, checkpoint or
        evaluation. The model and optimizer are built inside `tensor_mode` (a FakeTensorMode), the process
        groups outside it (a DeviceMesh reads its ranks back)."""
        trainer = cls.__new__(cls)
        trainer._init_layout(spec)
        with tensor_mode or nullcontext():
            trainer._init_step()
        return trainer

    def _init_layout(self, spec: RunSpec) -> None:
        """The device, the process groups of the layout, and the micro-batches per rank and step."""
        self.spec, self.cfg, self.platform = spec, spec.cfg, spec.platform
        if self.platform.device_type != "cpu" and not self.platform.traced and fake_device.registered():
            raise RuntimeError(
                "this process has registered a dry run's stand-in device, and torch's autograd engine then cannot "
                "run a backward on a real GPU: run the GPU's step in a fresh process (optimus plan runs in its own)."
            )
        p = self.cfg.parallel
        self.ps: ParallelState = build_parallel_state(
            p.ep, p.timeout_s, p.pp, p.tp, self.platform.device_type, p.sp, p.pp_virtual
        )
        if self.ps.layout != spec.layout:
            raise RuntimeError(f"a run resolved for {spec.layout}, in a group laid out as {self.ps.layout}")
        self.accum = spec.layout.micro_batches(self.cfg.train.global_batch, self.cfg.train.micro_batch)
        self.device = self.platform.device

    def _init_step(self, load_weights=None) -> None:
        """This rank's part of the model (run by `self.pipeline` when pp > 1), its router statistics and the
        optimizer; `load_weights(model)` fills the parameters before the optimizer takes its master copy."""
        cfg = self.cfg
        # profile.timers: the dispatchers, the pipeline stages and the optimizer time their work through it.
        self.timers = Timers(cfg.profile.timers, lambda: synchronize(self.platform))
        try:  # the backend for the device the step runs on (a dry run's: the device it stands in for)
            self.kernels = get_backend(cfg.kernels, self.device.type, traced=self.platform.traced)
        except KernelUnavailable as err:  # the `kernels` key: the user's to change
            raise ConfigError(str(err)) from None
        parts = parallelize(build_model(cfg.model, self.kernels), self.ps, cfg, self.device, self.timers)
        self.model = parts.module  # every parameter this rank holds, under its whole-model name
        self.pipeline: Pipeline | None = None  # pp > 1: this rank's stages and their schedule
        if parts.n_stages > 1:
            t = cfg.train
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
        p = cfg.profile
        self.collectives = CollectiveTrace() if p.collectives else None  # records the first step's collectives
        self.host_syncs = HostSyncCounter() if p.host_syncs else None  # and its host synchronisations
        self.profile_memory = p.memory  # and its memory by category
        self.step = 0
        self.skipped_in_row = 0
        self.stop_signal = StopSignal()
        self.stop_agreed = False

    # ---- one optimizer step -------------------------------------------------

    def train_step(self) -> dict:
        cfg, ps = self.cfg, self.ps
        self.model.train()
        timers = self.timers
        with timers("data_wait"):
            micro_batches = self.loader.next_step()
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
        stop = self.stop_signal.requested or lost_claim() is not None  # rank 0: another run took its directory
        with timers("optimizer"), self._collectives_phase("optimizer"):
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
            raise TrainingDiverged(nonfinite_parameters_message(self.step))
        self.stop_agreed = agreed.stop
        means = agreed.means

        lr = lr_at(self.step, cfg.optim, cfg.train.steps)
        with timers("optimizer"), self._collectives_phase("optimizer"):
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
        return record

    def _collectives_phase(self, label: str):
        return self.collectives.phase(label) if self.collectives is not None else nullcontext()

    def _traced_step(self) -> dict:
        """train_step; the process's first step records its collectives (profile.collectives), its host
        synchronisations (profile.host_syncs) and its memory (profile.memory) into the run directory."""
        memory = step_memory_tracker(self.model, self.optimizer) if self.profile_memory else None
        recorders = [r for r in (self.collectives, self.host_syncs, memory) if r is not None]
        if not recorders:
            return self.train_step()
        with ExitStack() as stack:
            for recorder in recorders:
                stack.enter_context(recorder)
            record = self.train_step()
        name = f"rank{self.ps.rank}.json"
        if self.collectives is not None:
            write_trace(self.collectives.calls, self.run_dir / "collectives" / name)
        if self.host_syncs is not None:
            (self.run_dir / "host_syncs").mkdir(exist_ok=True)
            write_json_atomic(self.run_dir / "host_syncs" / name, self.host_syncs.as_list())
        if memory is not None:
            (self.run_dir / "memory").mkdir(exist_ok=True)
            write_json_atomic(self.run_dir / "memory" / name, step_memory.record(memory))
        self.collectives = self.host_syncs = None  # one step is recorded
        self.profile_memory = False
        return record

    def _first_evaluation(self, bar: tqdm) -> float:
        """The held-out loss where the run starts, printed; first, when train.eval_sequences (an upper bound) asks
        for more sequences than the held-out set has, how many every evaluation uses."""
        asked = self.cfg.train.eval_sequences
        if self.eval_sequences < asked:
            self._print(
                f"train.eval_sequences={asked}, but the held-out set has {self.eval_sequences} windows of "
                f"train.seq_len + 1 tokens: every evaluation uses those {self.eval_sequences} (val_sequences in "
                "metrics.jsonl; raise data.val_fraction for more)",
                bar,
            )
        val_loss = self.evaluate()
        self._print(f"step {self.step:>5}/{self.cfg.train.steps} | val_loss {val_loss:.4f}", bar)
        return val_loss

    def _val_record(self, val_loss: float) -> dict:
        """An evaluation's keys of a metrics.jsonl record: the held-out loss and how many sequences it averages."""
        return {"val_loss": val_loss, "val_sequences": self.eval_sequences}

    @torch.no_grad()
    def evaluate(self) -> float:
        """Mean next-token loss over the held-out set's tokens (layout-independent)."""
        self.model.eval()
        total = torch.zeros((), dtype=torch.float64, device=self.device)
        if self.pipeline is None:
            for batch, weight in self.eval_batches:
                total += eval_loss_sum(self.model, batch, weight, self.cfg, self.platform)
        else:  # the schedule runs a step's number of micro-batches at a time
            for batch, weight in schedule_batches(self.eval_batches, self.accum):
                with autocast_context(self.cfg, self.platform):
                    total += self.pipeline.eval_loss_sum(batch, weight)
        if self.platform.device_type == "cpu":  # the step does not reuse all of the pass's holes: unmap them
            release_free_cpu_memory()
        if self.ps.tp_rank > 0:
            total.zero_()  # the tp ranks of a group evaluate the same sequences: count them once
        if self.ps.is_distributed:
            dist.all_reduce(total)
        return total.item() / self.eval_tokens

    # ---- the run ------------------------------------------------------------

    def write_run_info(self) -> None:
        # cpu_share: whether ranks shared cores; update_bytes: what the update rule adds to a step (optim.update)
        mine = {**self.optimizer.memory_bytes(), **self.optimizer.update_bytes(), **cpu_share()}
        per_rank = [None] * self.ps.world_size
        if self.ps.is_distributed:
            dist.all_gather_object(per_rank, mine)
        else:
            per_rank = [mine]
        if not self.ps.is_main:
            return
        counts = self.param_counts
        info = {
            "params": {"total": counts.total, "active": counts.active, "dense": counts.dense, "expert": counts.expert},
            "params_dense": counts.dense,
            "params_expert": counts.expert,
            "flops_per_token": self.flops_per_token,
            # dp: the data-parallel degree world / (pp x tp), as optimus plan counts it; edp: the expert-data-
            # parallel degree world / (pp x ep), the replicas of each expert.
            "layout": {
                "world": self.ps.world_size, "pp": self.ps.pp, "dp": self.ps.dp, "tp": self.ps.tp,
                "ep": self.ps.ep, "edp": self.ps.edp, "accum": self.accum,
            },
            "moe_layers": self.router_stats.layer_ids,  # the block index of each row of expert_tokens
            "dtypes": {"param": self.cfg.train.dtype, "grad": self.cfg.optim.grad_dtype, "master": "fp32"},
            "optim_update": self.optimizer.update_rule,
            "device": {
                "type": self.platform.device_type, "name": self.platform.device_name, "backend": self.platform.backend,
                "peak_flops": self.peak_flops, "peak_flops_source": self.peak_source,
            },
            "kernels": self.kernels.name if self.model.moe_layers else None,
            "tokens_per_step": self.cfg.train.global_batch * self.cfg.train.seq_len,
            "per_rank": per_rank,
        }  # fmt: skip
        write_json_atomic(self.run_dir / "run_info.json", info)

    def _max_peak_memory(self) -> int:
        """The largest peak_memory_bytes over the ranks."""
        peak = torch.tensor(peak_memory_bytes(self.platform), dtype=torch.int64, device=self.device)
        if self.ps.is_distributed:
            dist.all_reduce(peak, op=dist.ReduceOp.MAX)
        return int(peak.item())

    def _planned_memory(self) -> tuple[int, int]:
        """optimus plan's (per-rank total, activations) for this run (with pp > 1, its busiest pipeline rank's)."""
        from optimus.plan import plan_run

        plan = plan_run(self.spec)  # its total, the figure `optimus plan` and a dry run print (with Muon's step)
        return plan.memory["total_configured"], plan.activations["configured"]

    def _record_peak_memory(self, bar: tqdm) -> None:
        """Add each rank's measured peak to run_info.json and print it beside optimus plan's prediction."""
        peaks = [None] * self.ps.world_size
        mine = {"peak_memory_bytes": peak_memory_bytes(self.platform), "before_model_bytes": self.memory_before_model}
        if self.ps.is_distributed:
            dist.all_gather_object(peaks, mine)
        else:
            peaks = [mine]
        if not self.ps.is_main:
            return
        planned = self._planned_memory()
        path = self.run_dir / "run_info.json"
        info = json.loads(path.read_text())
        for rank_info, peak in zip(info["per_rank"], peaks):
            rank_info.update(peak)
        busiest = max(range(len(peaks)), key=lambda r: peaks[r]["peak_memory_bytes"])
        info["peak_memory_bytes"] = peaks[busiest]["peak_memory_bytes"]
        info["planned_memory_bytes"] = planned[0] if planned else None
        write_json_atomic(path, info)
        mib = 2**20
        line = (
            f"memory after step {self.step}: peak {peaks[busiest]['peak_memory_bytes'] / mib:.1f} MiB "
            f"({'device allocator' if self.platform.device_type != 'cpu' else 'resident set'}, rank {busiest}; "
            f"{peaks[busiest]['before_model_bytes'] / mib:.1f} MiB before the model was built)"
        )
        if planned:
            line += (
                f"; optimus plan predicts {planned[0] / mib:.1f} MiB (activations {planned[1] / mib:.1f} MiB with "
                f"train.activation_checkpointing={self.cfg.train.activation_checkpointing})"
            )
        self._print(line, bar)

    def fit(self) -> dict:
        """Train to train.steps. A file of the run directory that cannot be written (a full disk) ends the run
        in one sentence naming the disk and what the run kept; the file is left as it was (optimus.train.metrics)."""
        try:
            return self._fit()
        except RunWriteError as err:
            raise ConfigError(self._write_failure(err)) from None

    def _write_failure(self, err: RunWriteError) -> str:
        """The sentence: the file, the disk, the records and checkpoint kept, and the command that goes on."""
        cause, remedy = write_problem([err], err.path.parent)
        last = last_record_step(self.run_dir)
        kept = f"metrics.jsonl keeps the records up to step {last}" if last is not None else "no record was kept"
        good = candidates(self.checkpointer.root)
        if good:
            kept += f", and the latest checkpoint is {good[0].name} ({good[0]})"
        then = next_command(self.cfg, self.run_dir)
        return f"{err.path} could not be written ({cause}); {kept}: {remedy} and {then}."

    def _fit(self) -> dict:
        cfg, ps = self.cfg, self.ps
        if ps.is_main:
            truncate_metrics(self.run_dir, self.step)  # records past the resumed step are re-done
        # metrics.jsonl first: a directory holding a run's other files without it was not left by a run (run_dir)
        metrics = MetricsLog(self.run_dir, ps.is_main, moe_layer_ids=self.router_stats.layer_ids)
        # A batch job's log (stdout redirected to a file) gets the periodic step lines only, not the bar's
        # carriage-return updates.
        show_bar = ps.is_main and cfg.logging.progress and sys.stdout.isatty() and sys.stderr.isatty()
        bar = tqdm(total=cfg.train.steps, initial=self.step, disable=not show_bar, dynamic_ncols=True)
        try:
            if ps.is_main:
                write_text_atomic(self.run_dir / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(cfg)))
            self.write_run_info()
            metrics.wandb_run = self._start_wandb() if ps.is_main and cfg.logging.wandb else None
            summary = {"first_val_loss": self._first_evaluation(bar)}
            if self.step == 0:  # where the curve starts; a resumed run's start is its checkpoint step's record
                metrics.log({"step": 0, "tokens": 0, **self._val_record(summary["first_val_loss"])})
        except BaseException:
            bar.close()
            metrics.close()
            raise
        tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        trace = self.trace
        record_memory = True
        self.stop_signal.install()
        try:
            while self.step < cfg.train.steps:
                trace.before_step(self.step + 1)
                self.timers.pop_totals()  # drop what evaluation timed (its dispatches)
                start = time.perf_counter()
                record = self._traced_step()
                self._stop_if_claim_lost()
                self.step += 1
                self.tokens_seen += tokens_per_step
                if record_memory:  # the first step of this process has run every kind of allocation once
                    self._record_peak_memory(bar)
                    record_memory = False
                elapsed = time.perf_counter() - start
                trace.after_step(self.step)
                record = {"step": self.step, **record, "tokens": self.tokens_seen, "step_time_s": elapsed}
                record.update(self.timers.pop_totals())  # time_<phase>_s, only with profile.timers=true
                record.update(
                    throughput(tokens_per_step, elapsed, self.flops_per_token, ps.world_size, self.peak_flops)
                )
                self.skipped_in_row = self.skipped_in_row + 1 if record["skipped"] else 0
                if self.skipped_in_row > cfg.train.max_skipped_steps:
                    metrics.log(record)  # the record of the step that ended the run is kept
                    raise TrainingDiverged(
                        too_many_skipped_message(
                            self.skipped_in_row,
                            cfg.train.max_skipped_steps,
                            record.get("nonfinite_ranks", []),
                            ps.world_size,
                        )
                    )
                if due_every(self.step, cfg.train.eval_interval, cfg.train.steps):
                    record.update(self._val_record(self.evaluate()))
                    summary["last_val_loss"] = record["val_loss"]
                    record["peak_memory_bytes"] = self._max_peak_memory()
                metrics.log(record)
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if due_every(self.step, cfg.train.log_interval) or "val_loss" in record:
                    line = console_line(record, cfg.train.steps)
                    self._print(line + (f" | val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""), bar)
                if self._checkpoint_boundary(bar):
                    summary["stopped_by"] = self.stop_signal.received or "a stop signal on another rank"
                    break
            self.optimizer.wait_for_params()  # the model is the caller's after fit(): fully updated
            self.checkpointer.close()  # waits for a background save
            self._report_checkpoint(bar)
        except TrainingDiverged:  # every rank stops at the same step; a save still in flight holds earlier,
            self.checkpointer.wait()  # finite parameters: finish and publish it rather than lose it
            raise
        finally:
            self.stop_signal.restore()
            trace.close()
            bar.close()
            metrics.close()
            self.loader.close()
            self._let_background_save_end()
            remove_if_empty()  # the run is over: another may use its directories
        summary.update(steps=self.step, run_dir=str(self.run_dir))
        return summary

    def _stop_if_claim_lost(self) -> None:
        """When the ranks agreed to stop, ask rank 0 whether it was because another run took over its run or
        checkpoint directory: then every rank ends here, writing nothing more (no record, no checkpoint)."""
        if not self.stop_agreed:
            return
        lost = [lost_claim() if self.ps.is_main else None]
        if self.ps.is_distributed:
            dist.broadcast_object_list(lost, src=0)
        if lost[0]:
            raise ClaimLost(lost[0])

    def _let_background_save_end(self) -> None:
        """fit() ended by an exception with a save in flight: its thread still writes into the checkpoint
        directory, so the claim waits for it (on this rank alone: no collective on a failing path). It is not
        published, and its failure does not replace the exception that ended the run."""
        if self.checkpointer.pending is not None:
            concurrent.futures.wait([self.checkpointer.pending.future])

    # ---- checkpoints ----------------------------------------------------------

    def save_checkpoint(self, block: bool = False) -> None:
        started = time.perf_counter()
        state = self.checkpointer.state(self.step, self.model, self.optimizer, self.loader, self.skipped_in_row)
        self.checkpointer.save(self.step, state, block=block, started=started)

    def _checkpoint_boundary(self, bar: tqdm) -> bool:
        """Publish finished background saves, save when due; True when the ranks agreed to stop."""
        self.checkpointer.poll()
        saving = self.stop_agreed or self.checkpointer.due(self.step, self.cfg.train.steps)
        if saving or self.step == self.cfg.train.steps:  # the next step's flags would check this update: too late
            self.optimizer.wait_for_params()
            if not parameters_finite_on_every_rank(self.model):
                raise TrainingDiverged(nonfinite_parameters_message(self.step))
        if saving:
            self.save_checkpoint(block=self.stop_agreed)  # a stopping job must not exit mid-write
        if self.stop_agreed:  # a stop signal is answered in one line, the one below, which says what was saved
            self.checkpointer.pop_last_save()
        self._report_checkpoint(bar)
        if self.stop_agreed:
            root = self.checkpointer.root
            self._print(f"Stop signal: saved step {self.step} in {root}; {resume_hint(self.cfg, self.run_dir)}.", bar)
            report_saved_at_stop()  # for a local launcher: a second Ctrl-C from now on ends a run that saved
        return self.stop_agreed

    def _report_checkpoint(self, bar: tqdm) -> None:
        saved = self.checkpointer.pop_last_save()
        if saved:
            self._print(
                f"checkpoint step {saved['step']}: {saved['bytes'] / 2**20:.1f} MiB in {saved['seconds']:.2f} s "
                f"({saved['blocking_seconds']:.2f} s blocking training)",
                bar,
            )

    def _print(self, line: str, bar: tqdm) -> None:
        if self.ps.is_main:
            bar.write(line)

    def _start_wandb(self):
        import wandb

        return wandb.init(
            project=self.cfg.logging.wandb_project,
            dir=str(self.run_dir),
            name=Path(self.run_dir).name,
            config=OmegaConf.to_container(OmegaConf.structured(self.cfg)),
        )


def train(run: OptimusConfig | RunSpec, local_rank: int = 0) -> dict:
    return Trainer(run, local_rank).fit()
