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
from optimus.train.metrics import MetricsLog, console_line, expert_load_imbalance, throughput, write_json_atomic
from optimus.train.precision import resolve_dtype
from optimus.train.run_dir import resolve_run_dir
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
        if cfg.checkpoint.interval > 0:
            raise ConfigError(
                "checkpoint.interval > 0: checkpointing is not available in this version; set checkpoint.interval=0."
            )
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
        self.tokens_seen = 0

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
        if ps.is_distributed:
            dist.all_reduce(sums_4)
            if counts_LE is not None:
                dist.all_reduce(counts_LE)
        means = (sums_4 / (self.accum * ps.world_size)).tolist()

        lr = lr_at(self.step, cfg.optim, cfg.train.steps)
        with timers("optimizer"):
            grad_norm = self.optimizer.step(lr)
            self.optimizer.zero_grad()
        skipped = not math.isfinite(grad_norm)
        if not skipped and counts_LE is not None and cfg.model.moe.router == "sigmoid":
            for router_counts_E, moe in zip(counts_LE, self.model.moe_layers):
                moe.router.update_bias(router_counts_E, cfg.model.moe.bias_update_rate)
        return {
            "loss": means[0], "lm_loss": means[1], "aux_loss": means[2], "z_loss": means[3],
            "grad_norm": grad_norm, "lr": lr, "skipped": skipped,
            "expert_load_imbalance": expert_load_imbalance(counts_LE),
        }  # fmt: skip

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
        bar = tqdm(total=cfg.train.steps, disable=not (ps.is_main and cfg.logging.progress), dynamic_ncols=True)
        summary = {"first_val_loss": self.evaluate()}
        self._print(f"step {self.step:>5}/{cfg.train.steps} | val_loss {summary['first_val_loss']:.4f}", bar)
        skipped_in_row = 0
        trace = self.trace
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
                skipped_in_row = skipped_in_row + 1 if record["skipped"] else 0
                if skipped_in_row > cfg.train.max_skipped_steps:
                    raise RuntimeError(
                        f"{skipped_in_row} steps in a row had a non-finite gradient norm: "
                        "lower optim.lr or check the data."
                    )
                if self.step % cfg.train.eval_interval == 0 or self.step == cfg.train.steps:
                    record["val_loss"] = summary["last_val_loss"] = self.evaluate()
                metrics.log(record)
                bar.update(1)
                bar.set_postfix(loss=f"{record['loss']:.3f}", tok_s=f"{record['tokens_per_s']:.0f}")
                if self.step % cfg.train.log_interval == 0 or "val_loss" in record:
                    line = console_line(record, cfg.train.steps)
                    self._print(line + (f" | val_loss {record['val_loss']:.4f}" if "val_loss" in record else ""), bar)
        finally:
            trace.close()
            bar.close()
            metrics.close()
            self.loader.close()
        summary.update(steps=self.step, run_dir=str(self.run_dir))
        return summary

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
