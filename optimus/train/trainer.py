"""The training loop: one rank's view of a run.

`train(cfg)` runs on every rank of an initialised process group (or alone). The
order of work is: layout -> data -> model (same init on every rank, then
parallelised from outside) -> optimizer -> steps of gradient accumulation,
each followed by one optimizer step, periodic evaluation and logging.
"""

from __future__ import annotations

import math
import time
from contextlib import nullcontext
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.distributed as dist
import torch.nn.functional as F
from omegaconf import OmegaConf
from tqdm import tqdm

from optimus.config import ConfigError, OptimusConfig, grad_accum_steps, validate
from optimus.data import BatchLoader, build_data, eval_batches
from optimus.model import Transformer, count_params, flops_per_token
from optimus.optim import build_optimizer, lr_at
from optimus.parallel import ParallelState, build_parallel_state, parallelize_model
from optimus.platform import Platform, detect_platform, peak_flops_per_device, synchronize
from optimus.train.checkpoint import Checkpointer
from optimus.train.faults import (
    StopSignal,
    TrainingDiverged,
    discard_gradients,
    pack_step_flags,
    too_many_skipped_message,
    unpack_step_flags,
)
from optimus.train.metrics import MetricsLog, console_line, expert_load_imbalance, throughput, write_json_atomic
from optimus.train.precision import resolve_dtype
from optimus.train.run_dir import resolve_run_dir, resume_hint, truncate_metrics
from optimus.train.timers import Timers, TorchTrace, attach_timers


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


def micro_batch_loss(model: Transformer, batch_BS1: torch.Tensor, cfg: OptimusConfig, platform: Platform):
    """Loss of one micro-batch of `seq_len + 1` windows: next-token CE + weighted router losses."""
    inputs_BS, targets_BS = batch_BS1[:, :-1], batch_BS1[:, 1:]
    with autocast_context(cfg, platform):
        out = model(inputs_BS)
    lm_loss = F.cross_entropy(out.logits_BSV.flatten(0, 1).float(), targets_BS.reshape(-1))
    moe = cfg.model.moe
    loss = lm_loss + moe.aux_loss_coef * out.aux_loss + moe.z_loss_coef * out.z_loss
    return loss, lm_loss, out


class Trainer:
    def __init__(self, cfg: OptimusConfig, local_rank: int = 0):
        self.cfg = cfg
        self.platform = detect_platform(cfg.machine, local_rank)
        if self.platform.device_type != "cpu":
            torch.get_device_module(self.platform.device_type).set_device(self.platform.device)
        self.ps: ParallelState = build_parallel_state(cfg.parallel.ep, cfg.parallel.timeout_s)
        validate(cfg, self.ps.world_size)
        cfg.train.dtype = resolve_dtype(cfg.train.dtype, self.platform.device_type)  # recorded in config.yaml
        self.accum = grad_accum_steps(cfg, self.ps.world_size)
        self.run_dir = resolve_run_dir(cfg, self.ps)
        self.device = self.platform.device

        self.data = build_data(cfg.data, cfg.train.seq_len, cfg.train.seed)
        if self.data.vocab_size > cfg.model.vocab_size:
            raise ConfigError(
                f"The tokenizer has {self.data.vocab_size} tokens but model.vocab_size={cfg.model.vocab_size}: "
                f"set model.vocab_size >= {self.data.vocab_size}."
            )
        self.model = self._build_model()
        # Where the run starts: its own latest checkpoint, else checkpoint.load. Weights-only loads come
        # before the optimizer is built, since it takes its own copy of the parameters.
        self.checkpointer = Checkpointer(cfg, self.run_dir, self.ps, self.platform.device_type)
        start_mode, start_paths = self.checkpointer.start_point()
        if start_mode == "weights":
            self.checkpointer.load_weights(start_paths[0], self.model)
        self.param_counts = count_params(self.model, cfg.model)
        self.flops_per_token = flops_per_token(self.param_counts, cfg.model, cfg.train.seq_len)
        # On a CPU the peak is a matmul probe in the dtype the run computes in.
        compute_dtype = torch.bfloat16 if cfg.train.dtype == "bf16" else torch.float32
        self.peak_flops, self.peak_source = peak_flops_per_device(self.platform, cfg.machine, compute_dtype)
        self.optimizer = build_optimizer(self.model, cfg, self.ps)
        # profile.timers: the dispatchers and the optimizer time their collectives through this object.
        self.timers = Timers(cfg.profile.timers, lambda: synchronize(self.platform))
        attach_timers(self.timers, [moe.dispatcher for moe in self.model.moe_layers] + [self.optimizer])
        p = cfg.profile
        self.trace = TorchTrace(p.torch, p.torch_steps, self.run_dir, self.ps.rank, self.platform.device_type)

        t = cfg.train
        self.loader = BatchLoader(
            self.data.train,
            t.global_batch,
            t.micro_batch,
            self.ps.rank,
            self.ps.world_size,
            t.seed,
            prefetch=cfg.data.prefetch,
        )
        # A fixed held-out set, the same in every layout whose world size divides eval_batches.
        self.eval_batches = [
            b.to(self.device)
            for b in eval_batches(self.data.val, t.eval_batches, t.micro_batch, self.ps.rank, self.ps.world_size)
        ]
        self.step = 0
        self.skipped_in_row = 0
        self.stop_signal = StopSignal()
        self.stop_agreed = False
        if start_mode in ("resume", "load"):
            restored = self.checkpointer.resume(
                start_paths, start_mode == "load", self.model, self.optimizer, self.loader
            )
            if restored is not None:
                self.step, self.skipped_in_row = restored.step, restored.skipped_in_row
        self.tokens_seen = self.step * t.global_batch * t.seq_len
        if self.ps.is_main:
            truncate_metrics(self.run_dir, self.step)  # records past the resumed step are re-done

    def _build_model(self) -> Transformer:
        cfg = self.cfg
        model = Transformer(cfg.model, kernels=cfg.kernels)
        # Same init on every rank and in every layout: seeded CPU generator, full model, then sliced.
        model.init_weights(torch.Generator().manual_seed(cfg.train.seed))
        model = model.to(self.device)
        parallelize_model(model, self.ps, cfg.parallel)
        return model

    # ---- one optimizer step -------------------------------------------------

    def train_step(self) -> dict:
        cfg, ps = self.cfg, self.ps
        self.model.train()
        timers = self.timers
        with timers("data_wait"):
            micro_batches = self.loader.next_step()
        sums_4 = torch.zeros(4, device=self.device)  # loss, lm_loss, aux_loss, z_loss
        counts_LE = None
        for i, batch in enumerate(micro_batches):
            # ZeRO-2 reduces gradients during the backward of the last micro-batch only.
            self.optimizer.set_last_micro_batch(i == len(micro_batches) - 1)
            with timers("forward"):
                loss, lm_loss, out = micro_batch_loss(
                    self.model, batch.to(self.device, non_blocking=True), cfg, self.platform
                )
            with timers("backward"):
                (loss / self.accum).backward()
            sums_4 += torch.stack([loss.detach(), lm_loss.detach(), out.aux_loss.detach(), out.z_loss.detach()])
            if out.tokens_per_expert_LE is not None:
                counts_LE = out.tokens_per_expert_LE if counts_LE is None else counts_LE + out.tokens_per_expert_LE
        # One reduction agrees on the losses, on which ranks saw a non-finite loss, and on a stop signal.
        flags = pack_step_flags(sums_4, ps.rank, ps.world_size, self.stop_signal.requested)
        if ps.is_distributed:
            dist.all_reduce(flags)
            if counts_LE is not None:
                dist.all_reduce(counts_LE)
        agreed = unpack_step_flags(flags, self.accum * ps.world_size)
        self.stop_agreed = agreed.stop
        means = agreed.means

        lr = lr_at(self.step, cfg.optim, cfg.train.steps)
        with timers("optimizer"):
            if agreed.nonfinite_ranks:  # every rank skips: no update, no bias update (the batch is consumed)
                discard_gradients(self.optimizer)
                grad_norm = float("nan")
            else:
                grad_norm = self.optimizer.step(lr)  # skips the update itself if the norm is not finite
                self.optimizer.zero_grad()
        skipped = bool(agreed.nonfinite_ranks) or not math.isfinite(grad_norm)
        if not skipped and counts_LE is not None and cfg.model.moe.router == "sigmoid":
            for router_counts_E, moe in zip(counts_LE, self.model.moe_layers):
                moe.router.update_bias(router_counts_E, cfg.model.moe.bias_update_rate)
        record = {
            "loss": means[0], "lm_loss": means[1], "aux_loss": means[2], "z_loss": means[3],
            "grad_norm": grad_norm, "lr": lr, "skipped": skipped,
            "expert_load_imbalance": expert_load_imbalance(counts_LE),
        }  # fmt: skip
        if agreed.nonfinite_ranks:
            record["nonfinite_ranks"] = agreed.nonfinite_ranks
        return record

    @torch.no_grad()
    def evaluate(self) -> float:
        self.model.eval()
        total = torch.zeros((), device=self.device)
        for batch in self.eval_batches:
            total += micro_batch_loss(self.model, batch, self.cfg, self.platform)[1]
        if self.ps.is_distributed:
            dist.all_reduce(total)
        return (total / (len(self.eval_batches) * self.ps.world_size)).item()

    # ---- the run ------------------------------------------------------------

    def write_run_info(self) -> None:
        memory = self.optimizer.memory_bytes()
        per_rank = [None] * self.ps.world_size
        if self.ps.is_distributed:
            dist.all_gather_object(per_rank, memory)
        else:
            per_rank = [memory]
        if not self.ps.is_main:
            return
        counts = self.param_counts
        info = {
            "params": {"total": counts.total, "active": counts.active, "dense": counts.dense, "expert": counts.expert},
            "params_dense": counts.dense,
            "params_expert": counts.expert,
            "flops_per_token": self.flops_per_token,
            "layout": {"world": self.ps.world_size, "dp": self.ps.dp, "ep": self.ps.ep, "accum": self.accum},
            "device": {
                "type": self.platform.device_type, "name": self.platform.device_name, "backend": self.platform.backend,
                "peak_flops": self.peak_flops, "peak_flops_source": self.peak_source,
            },
            "kernels": self.model.moe_layers[0].experts.kernels.name if self.model.moe_layers else None,
            "tokens_per_step": self.cfg.train.global_batch * self.cfg.train.seq_len,
            "per_rank": per_rank,
        }  # fmt: skip
        write_json_atomic(self.run_dir / "run_info.json", info)

    def fit(self) -> dict:
        cfg, ps = self.cfg, self.ps
        if ps.is_main:
            (self.run_dir / "config.yaml").write_text(OmegaConf.to_yaml(OmegaConf.structured(cfg)))
        self.write_run_info()
        wandb_run = self._start_wandb() if ps.is_main and cfg.logging.wandb else None
        metrics = MetricsLog(self.run_dir, enabled=ps.is_main, wandb_run=wandb_run)
        tokens_per_step = cfg.train.global_batch * cfg.train.seq_len
        show_bar = ps.is_main and cfg.logging.progress
        bar = tqdm(total=cfg.train.steps, initial=self.step, disable=not show_bar, dynamic_ncols=True)
        summary = {"first_val_loss": self.evaluate()}
        self._print(f"step {self.step:>5}/{cfg.train.steps} | val_loss {summary['first_val_loss']:.4f}", bar)
        trace = self.trace
        self.stop_signal.install()
        try:
            while self.step < cfg.train.steps:
                trace.before_step(self.step + 1)
                self.timers.pop_totals()  # drop what evaluation timed (its dispatches)
                start = time.perf_counter()
                record = self.train_step()
                self.step += 1
                self.tokens_seen += tokens_per_step
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
                if self.step % cfg.train.eval_interval == 0 or self.step == cfg.train.steps:
                    record["val_loss"] = summary["last_val_loss"] = self.evaluate()
                metrics.log(record)
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if self.step % cfg.train.log_interval == 0 or "val_loss" in record:
                    line = console_line(record, cfg.train.steps)
                    self._print(line + (f" | val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""), bar)
                if self._checkpoint_boundary(bar):
                    summary["stopped_by"] = self.stop_signal.received or "a stop signal on another rank"
                    break
            self.checkpointer.close()  # waits for a background save
            self._report_checkpoint(bar)
        finally:
            self.stop_signal.restore()
            trace.close()
            bar.close()
            metrics.close()
            self.loader.close()
        summary.update(steps=self.step, run_dir=str(self.run_dir))
        return summary

    # ---- checkpoints ----------------------------------------------------------

    def save_checkpoint(self, block: bool = False) -> None:
        started = time.perf_counter()
        state = self.checkpointer.state(self.step, self.model, self.optimizer, self.loader, self.skipped_in_row)
        self.checkpointer.save(self.step, state, block=block, started=started)

    def _checkpoint_boundary(self, bar: tqdm) -> bool:
        """Publish finished background saves, save when due; True when the ranks agreed to stop."""
        self.checkpointer.poll()
        if self.stop_agreed or self.checkpointer.due(self.step, self.cfg.train.steps):
            self.save_checkpoint(block=self.stop_agreed)  # a stopping job must not exit mid-write
        self._report_checkpoint(bar)
        if self.stop_agreed:
            root = self.checkpointer.root
            self._print(f"Stop signal: saved step {self.step} in {root}; {resume_hint(self.cfg, self.run_dir)}.", bar)
        return self.stop_agreed

    def _report_checkpoint(self, bar: tqdm) -> None:
        saved, self.checkpointer.last_save = self.checkpointer.last_save, None
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


def train(cfg: OptimusConfig, local_rank: int = 0) -> dict:
    return Trainer(cfg, local_rank).fit()
