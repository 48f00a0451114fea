"""The training loop: one rank's view of a run.

`train(cfg)` runs on every rank of an initialised process group (or alone). The
order of work is: layout -> data -> model (same init on every rank, then
parallelised from outside) -> optimizer -> steps of gradient accumulation,
each followed by one optimizer step, periodic evaluation and logging.
"""

from __future__ import annotations

import concurrent.futures
import json
import sys
import time
from contextlib import ExitStack
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
from omegaconf import OmegaConf
from tqdm import tqdm

from optimus.config import TORCH_DTYPES, ConfigError, OptimusConfig
from optimus.cpu_runtime import cpu_share, release_free_cpu_memory
from optimus.data import BatchLoader, build_data, eval_batches, eval_set_size
from optimus.device_memory import peak_memory_bytes, reset_peak_memory
from optimus.host_syncs import HostSyncCounter
from optimus.local_launcher import report_saved_at_stop
from optimus.model import count_params, count_params_of_config, flops_per_token
from optimus.parallel import ParallelState
from optimus.parallel.collective_check import check_collectives
from optimus.parallel.collective_trace import CollectiveTrace, write_trace
from optimus.peak_flops import peak_flops_per_device
from optimus.platform import detect_platform
from optimus.run_spec import RunSpec, resolve_run
from optimus.train import step_memory
from optimus.train.checkpoint import Checkpointer
from optimus.train.checkpoint_dirs import candidates
from optimus.train.faults import (
    StopSignal,
    TrainingDiverged,
    nonfinite_parameters_message,
    parameters_finite_on_every_rank,
    too_many_skipped_message,
)
from optimus.train.intervals import due_every
from optimus.train.kernel_check import check_kernels, kernel_check_enabled
from optimus.train.metrics import (
    MetricsLog,
    RunWriteError,
    console_line,
    throughput,
    write_json_atomic,
    write_problem,
    write_text_atomic,
)
from optimus.train.operator_times import OperatorTimes
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
from optimus.train.step import TrainStep, autocast_context, parallel_state_of
from optimus.train.step_memory import step_memory_tracker
from optimus.train.timers import TorchTrace


def eval_loss_sum(model, batch_BS1: torch.Tensor, weight_B: torch.Tensor, cfg, platform) -> torch.Tensor:
    """fp64 sum over tokens of next-token cross-entropy, each sequence weighted by `weight_B` (0 = padding); the
    head's cross-entropy is fused, so a long sequence's logits are never all alive."""
    inputs_BS, targets_BS = batch_BS1[:, :-1], batch_BS1[:, 1:]
    with autocast_context(cfg, platform):
        loss_BS = model(inputs_BS, targets_BS)
    return (loss_BS.sum(1).double() * weight_B).sum()


def schedule_batches(batches: list[tuple[torch.Tensor, torch.Tensor]], n: int):
    """(windows [n x B, S + 1], weights [n x B]) of `n` micro-batches of (windows, weights) at a time, the last
    group completed with copies of its first micro-batch at weight 0 (what a pipeline schedule needs)."""
    for start in range(0, len(batches), n):
        group = batches[start : start + n]
        group += [(group[0][0], torch.zeros_like(group[0][1]))] * (n - len(group))
        yield torch.cat([b for b, _ in group]), torch.cat([w for _, w in group])


class Trainer:
    def __init__(self, spec: RunSpec, local_rank: int = 0):
        """`spec`: the run's settings, resolved and validated for its world (optimus.run_spec.resolve_run; or
        Trainer.from_config)."""
        if spec.platform.path != "cpu":
            torch.get_device_module(spec.platform.device_type).set_device(spec.platform.device)
        self.spec, self.cfg, self.platform, self.device = spec, spec.cfg, spec.platform, spec.platform.device
        self.ps: ParallelState = parallel_state_of(spec)
        cfg, p = self.cfg, self.cfg.parallel
        compute_dtype = TORCH_DTYPES[cfg.train.dtype]  # resolved: bf16 or fp32
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
        load_weights = partial(self.checkpointer.load_weights, start_paths[0]) if start_mode == "weights" else None
        self.parts = TrainStep(spec, self.ps, load_weights)
        self.model, self.optimizer, self.pipeline = self.parts.model, self.parts.optimizer, self.parts.pipeline
        self.timers, self.kernels, self.accum = self.parts.timers, self.parts.kernels, self.parts.accum
        self.router_stats = self.parts.router_stats
        p = cfg.profile
        self.collectives = CollectiveTrace() if p.collectives else None  # records the first step's collectives
        self.host_syncs = HostSyncCounter() if p.host_syncs else None  # and its host synchronisations
        self.profile_memory = p.memory  # and its memory by category
        self.step = 0
        self.skipped_in_row = 0
        self.stop_signal = StopSignal()
        self.stop_agreed = False
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
        self.operator_times = OperatorTimes(
            cfg.profile.operators, cfg.profile.torch_steps, self.run_dir, self.ps.rank, self.platform.device_type
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

    # ---- one optimizer step -------------------------------------------------

    def train_step(self) -> dict:
        """One optimizer step of the loader's next `accum` micro-batches (TrainStep.run): its record."""
        with self.timers("data_wait"):
            micro_batches = self.loader.next_step()
        record, self.stop_agreed = self.parts.run(micro_batches, self.step, self._stop_requested, self.collectives)
        return record

    def _stop_requested(self) -> bool:
        """A stop signal reached this rank, or another run took rank 0's directory."""
        return self.stop_signal.requested or lost_claim() is not None

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
            # parallel degree world / (pp x ep), the replicas of each expert; shard_ranks: optim.shard_ranks.
            "layout": {
                "world": self.ps.world_size, "pp": self.ps.pp, "dp": self.ps.dp, "tp": self.ps.tp,
                "ep": self.ps.ep, "edp": self.ps.edp, "accum": self.accum, "shard_ranks": self.ps.layout.shard_ranks,
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

    @classmethod
    def from_config(cls, cfg: OptimusConfig, local_rank: int = 0) -> Trainer:
        """A trainer of `cfg`, resolved and validated here for this process: its device for `local_rank`, the world
        of the initialised process group (one process without one)."""
        world_size = dist.get_world_size() if dist.is_initialized() else 1
        return cls(resolve_run(cfg, world_size, detect_platform(cfg.machine, local_rank)), local_rank)

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
                self.operator_times.before_step(self.step + 1)
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
                self.operator_times.after_step(self.step)
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
            self.operator_times.close()
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
