"""Sharded checkpoints with torch.distributed.checkpoint (DCP): save, publish, keep, find, validate, load.

What a checkpoint directory holds (its step_* directories and `latest`) and which of its
checkpoints a run tries is in optimus.train.checkpoint_dirs. A save writes into the .tmp
directory; only after DCP has finished on every rank (its last step gathers all ranks'
results to rank 0, which then writes .metadata) does rank 0 rename it and move `latest`.
A crash during a save therefore leaves the previous checkpoint as the latest, and a
directory without the .tmp suffix is always complete. What the keys mean is in
optimus.train.checkpoint_state.

A save that fails (a full disk, on any rank, while writing or publishing) ends the run
with CheckpointWriteError, one sentence naming the cause and the last good checkpoint;
its staging directory is removed. A background save (checkpoint.async_save) is checked
at every step boundary while it runs: the ranks agree that it has ended, on a gloo group
of its own, so that all of them publish it or stop at the same step; on that group they
first agree that every rank copied its state to CPU memory, before any starts writing.

Loading tries `latest` first and then older checkpoints: one whose files are
missing, short, unreadable or differ from the checksums in its meta.json, or whose
meta.json cannot vouch for them (unreadable, or without a checksum of each file), is
reported with a warning and skipped; when none loads the run stops (and keeps
them all) rather than start again from step 0. One saved from a different model
or with other data settings is a configuration error, not a reason to fall back
(see optimus.train.checkpoint_checks). A checkpoint that holds weights only (what
`optimus checkpoint import` writes) starts a new run from step 0 with fresh optimizer
state, whether or not checkpoint.load_weights_only says so.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time
from dataclasses import asdict, dataclass
from datetime import timedelta
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from omegaconf import OmegaConf
from torch.distributed.checkpoint.api import CheckpointException

from optimus.config import ConfigError, OptimusConfig
from optimus.parallel import ParallelState
from optimus.train.checkpoint_checks import (
    changed_setting,
    hash_files,
    meaning_changes,
    model_differences,
    read_meta,
    run_identity,
    verify_files,
)
from optimus.train.checkpoint_dirs import (
    LATEST,
    META,
    TMP_SUFFIX,
    CheckpointWriteError,
    candidates,
    checkpoint_root,
    dir_bytes,
    fsync_dir,
    holds_weights_only,
    inspect,
    published,
    resolve_checkpoint,
    step_dir_name,
    step_of,
    write_failure,
)
from optimus.train.checkpoint_state import (
    apply_model_state,
    load_optimizer_state,
    model_state,
    model_targets,
    needed_ranges,
    optimizer_requests,
    optimizer_state,
    saved_ranges,
)
from optimus.train.dcp_warning import no_single_process_warning
from optimus.train.intervals import due_every
from optimus.train.metrics import write_text_atomic
from optimus.train.run_dir import next_command

log = logging.getLogger("optimus.checkpoint")

TRAINER_KEYS = ("trainer/step", "trainer/samples_consumed", "trainer/skipped_in_row", "trainer/world", "optim/step")


def _shown(value: Any) -> str:
    """A setting's value as it is written on the command line (true, null, 0.01, full)."""
    return json.dumps(value) if isinstance(value, bool) or value is None else str(value)


@dataclass
class PendingSave:
    step: int
    tmp: Path
    future: Any  # concurrent.futures.Future of dcp.async_save
    started: float
    blocking_s: float  # time the training loop waited (staging copies)


class _PreStagedWriter(dcp.FileSystemWriter):
    """The writer of a background save whose state was copied to CPU memory beforehand (copy_to_cpu, as the
    writer's own staging does): dcp.async_save, which stages through its writer, has nothing left to copy."""

    def copy_to_cpu(self, state_dict: dict) -> dict:
        return super().stage(state_dict)

    def stage(self, state_dict: dict) -> dict:
        return state_dict


@dataclass
class Restored:
    """Where a resumed run continues."""

    path: Path
    step: int
    samples_consumed: int
    skipped_in_row: int


class Checkpointer:
    """One per rank; every method is called by every rank (they hold collectives) unless it says otherwise."""

    def __init__(
        self, cfg: OptimusConfig, run_dir: Path, ps: ParallelState, device_type: str, data_identity: dict | None = None
    ):
        c = cfg.checkpoint
        if c.interval < 0:
            raise ConfigError(f"checkpoint.interval={c.interval} must be 0 (off) or a number of steps.")
        if c.keep < 1:
            raise ConfigError(f"checkpoint.keep={c.keep} must be at least 1: it is how many checkpoints are kept.")
        if c.load_weights_only and not c.load:
            raise ConfigError("checkpoint.load_weights_only=true needs checkpoint.load=PATH: name the checkpoint.")
        if c.allow_architecture_change and not c.load:
            raise ConfigError(
                "checkpoint.allow_architecture_change=true needs checkpoint.load=PATH: name the checkpoint whose "
                "weights start the run."
            )
        self.cfg, self.ps, self.device_type, self.run_dir = cfg, ps, device_type, Path(run_dir)
        self.data_identity = data_identity  # recorded at save, compared on resume (with the data settings)
        self.root = checkpoint_root(cfg, run_dir)
        if self.root.exists() and not self.root.is_dir():
            raise ConfigError(f"checkpoint.dir={self.root} is a file, not a directory: choose another checkpoint.dir.")
        # A gloo group of its own: DCP's collectives (from a background thread for async saves, and on
        # CPU tensors) never interleave with the training collectives.
        self.group = None
        self.poll_group = None  # where the ranks agree that a background save has ended (self.group may be busy)
        if ps.is_distributed:
            timeout = timedelta(seconds=cfg.parallel.timeout_s)
            self.group = dist.new_group(backend="gloo", timeout=timeout)
            if c.async_save:
                self.poll_group = dist.new_group(backend="gloo", timeout=timeout)
        self.pending: PendingSave | None = None
        self.last_saved_step: int | None = None
        self.last_save: dict | None = None  # what the latest published save cost (rank 0)
        if ps.is_main and self.root.is_dir():
            for stale in self.root.glob(f"step_*{TMP_SUFFIX}"):  # saves a crash interrupted
                shutil.rmtree(stale, ignore_errors=True)

    # ---- agreement between ranks ----------------------------------------------------------

    def _from_main(self, fn):
        """Run `fn` on rank 0 and hand its result (or its ConfigError) to every rank."""
        box: list[Any] = [None]
        if self.ps.is_main:
            try:
                box[0] = fn()
            except ConfigError as err:
                box[0] = err
        if self.group is not None:
            dist.broadcast_object_list(box, src=0, group=self.group)
        if isinstance(box[0], ConfigError):
            raise box[0]
        return box[0]

    def _first_problem(self, problem: str | None, group=None) -> str | None:
        """The first rank's problem, the same on every rank (agreed on `group`, by default self.group)."""
        group = self.group if group is None else group
        if group is None:
            return problem
        problems: list[str | None] = [None] * self.ps.world_size
        dist.all_gather_object(problems, problem, group=group)
        return next((p for p in problems if p is not None), None)

    # ---- which checkpoint a run starts from ---------------------------------------------------

    def start_point(self) -> tuple[str, list[Path]]:
        """("resume", [newest first]) from checkpoint.dir; else checkpoint.load as ("load" | "weights",
        [path]); else ("fresh", []). A run's own checkpoints win, so a requeued job resumes itself."""

        def decide():
            own = candidates(self.root)
            if own:
                return "resume", own
            if self.cfg.checkpoint.load:
                path = resolve_checkpoint(self.cfg.checkpoint.load)
                if self.cfg.checkpoint.load_weights_only:
                    return "weights", [path]
                if holds_weights_only(path):  # nothing to resume but the weights: the optimizer starts afresh
                    log.warning(
                        f"checkpoint.load={path} holds weights only (no optimizer state, as `optimus checkpoint "
                        "import` writes): starting a new run from them at step 0 with fresh optimizer state."
                    )
                    return "weights", [path]
                return "load", [path]
            return "fresh", []

        return self._from_main(decide)

    # ---- save ------------------------------------------------------------------------------

    def state(self, step: int, model, optimizer, loader, skipped_in_row: int) -> dict[str, torch.Tensor]:
        """Everything a run needs to continue, as flat DCP keys (this rank's part)."""
        optimizer.wait_for_params()  # the parameters are read here: their all-gathers may still be in flight
        sd: dict[str, torch.Tensor] = {**model_state(model), **optimizer_state(optimizer, model)}
        sd["trainer/step"] = torch.tensor(step)
        sd["trainer/samples_consumed"] = torch.tensor(loader.state_dict()["samples_consumed"])
        sd["trainer/skipped_in_row"] = torch.tensor(skipped_in_row)
        sd["trainer/world"] = torch.tensor(self.ps.world_size)
        sd[f"rng/cpu/rank_{self.ps.rank}"] = torch.get_rng_state()
        if self.device_type != "cpu":
            sd[f"rng/{self.device_type}/rank_{self.ps.rank}"] = torch.get_device_module(
                self.device_type
            ).get_rng_state()
        return sd

    def save(self, step: int, state: dict[str, torch.Tensor], block: bool = False, started: float | None = None):
        """Write `state` for `step`; with checkpoint.async_save (and not `block`) the writing runs in the
        background after a copy to CPU memory, and is published by a later poll(). `started`: when the
        caller began collecting `state` (perf_counter), for the reported cost."""
        started = time.perf_counter() if started is None else started
        self.wait()  # one save in flight at a time
        tmp = self.root / (step_dir_name(step) + TMP_SUFFIX)
        failed = None
        if self.ps.is_main:
            try:
                shutil.rmtree(tmp, ignore_errors=True)
                tmp.mkdir(parents=True)
            except OSError as err:
                failed = err
        self._stop_if_failed(step, tmp, failed)  # and every rank sees the fresh directory before writing into it
        self.last_saved_step = step
        if self.cfg.checkpoint.async_save and not block:
            self._start_in_background(step, tmp, state, started)
            return
        writer = dcp.FileSystemWriter(str(tmp), single_file_per_rank=True, sync_files=True)
        try:  # DCP hands every rank the same CheckpointException when any rank failed
            with no_single_process_warning():
                dcp.save(state, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
        except (Exception, CheckpointException) as err:
            failed = err
        digests = None if failed else self._gather_digests(hash_files(tmp, self.ps.rank, self.ps.world_size))
        elapsed = time.perf_counter() - started
        self._finish(step, tmp, failed, elapsed, elapsed, digests)

    def _start_in_background(self, step: int, tmp: Path, state: dict, started: float) -> None:
        """Copy `state` to CPU memory, then write it in DCP's thread, on every rank or on none: a rank whose
        copy failed (out of memory) must not leave the others' saves waiting for it in DCP's collectives on
        self.group. The ranks agree on poll_group, which DCP's thread never uses, before any thread starts."""
        writer = _PreStagedWriter(str(tmp), single_file_per_rank=True, sync_files=True)
        failed = staged = None
        try:
            staged = writer.copy_to_cpu(state)
        except Exception as err:
            failed = err
        self._stop_if_failed(step, tmp, failed, group=self.poll_group)
        with no_single_process_warning():
            future = dcp.async_save(staged, storage_writer=writer, process_group=self.group, no_dist=self.group is None)
        self.pending = PendingSave(step, tmp, future, started, time.perf_counter() - started)

    def _gather_digests(self, mine: dict[str, str]) -> dict[str, str]:
        """Every rank hashed a share of the files; rank 0 gets them all."""
        if self.group is None:
            return mine
        shares: list[dict[str, str] | None] = [None] * self.ps.world_size
        dist.all_gather_object(shares, mine, group=self.group)
        return {name: digest for share in shares for name, digest in share.items()}

    def poll(self, block: bool = False) -> None:
        """Publish a background save once it has ended on every rank (wait for it with `block`); one that
        failed ends the run. Every rank calls it at the same step."""
        p = self.pending
        if p is None or not (block or self._ended_everywhere(p)):
            return
        self.pending = None
        failed = None
        try:
            p.future.result()
        except (Exception, CheckpointException) as err:
            failed = err
        self._finish(p.step, p.tmp, failed, time.perf_counter() - p.started, p.blocking_s)

    def _ended_everywhere(self, pending: PendingSave) -> bool:
        """Whether the background save has ended on every rank: the same answer on all of them."""
        ended = torch.tensor([int(pending.future.done())])
        if self.poll_group is not None:
            dist.all_reduce(ended, op=dist.ReduceOp.MIN, group=self.poll_group)
        return bool(ended.item())

    def wait(self) -> None:
        self.poll(block=True)

    def _finish(
        self, step: int, tmp: Path, failed: BaseException | None, total_s: float, blocking_s: float, digests=None
    ):
        """Publish the written checkpoint, unless writing it failed (`failed`, on any rank); publishing can fail too."""
        if failed is None and self.ps.is_main:
            try:
                self._publish(step, tmp, total_s, blocking_s, digests)
            except OSError as err:
                failed = err
        self._stop_if_failed(step, tmp, failed)

    def _stop_if_failed(self, step: int, tmp: Path, failed: BaseException | None, group=None) -> None:
        """When saving `step` failed on any rank (`failed`: this rank's error, or None), remove what was written
        into `tmp` and end the run on every rank with CheckpointWriteError (agreed on `group`, by default
        self.group)."""
        mine = None if failed is None else self._failure_message(step, *write_failure(failed, self.root))
        message = self._first_problem(mine, group)
        if message is None:
            return
        if self.ps.is_main:  # never published (or, if only `latest` failed, published whole and not named)
            shutil.rmtree(tmp, ignore_errors=True)
            (self.root / (LATEST + TMP_SUFFIX)).unlink(missing_ok=True)
        raise CheckpointWriteError(message)

    def _failure_message(self, step: int, cause: str, remedy: str) -> str:
        """One sentence: what failed, why, the checkpoint the same command would resume from, and that command
        (without a checkpoint, the run's records are refused unless run.overwrite=true starts it over)."""
        good = candidates(self.root)  # what the same command would resume from
        kept = (
            f"the last good checkpoint is step {step_of(good[0])} ({good[0]})"
            if good
            else "no checkpoint of this run was saved before it"
        )
        return (
            f"checkpoint of step {step} could not be written: {cause}; {kept}: {remedy} and "
            f"{next_command(self.cfg, self.run_dir)}."
        )

    def _publish(self, step: int, tmp: Path, total_s: float, blocking_s: float, digests=None) -> None:
        """Rank 0: record checksums, rename the finished directory, move `latest`, drop checkpoints beyond `keep`.
        `digests`: the files' checksums, hashed by the ranks in parallel (a background save has rank 0 hash)."""
        if not self.ps.is_main:
            return
        ps = self.ps
        meta = {
            "step": step, "world": ps.world_size, "pp": ps.pp, "dp": ps.dp, "edp": ps.edp, "ep": ps.ep, "tp": ps.tp,
            "sharding": self.cfg.optim.sharding, "shard_ranks": self.cfg.optim.shard_ranks,
            "saved_at": time.strftime("%Y-%m-%dT%H:%M:%S"), "model": asdict(self.cfg.model),
            "run": run_identity(self.cfg, self.data_identity),
            "files": digests if digests is not None else hash_files(tmp),
        }  # fmt: skip
        write_text_atomic(tmp / META, json.dumps(meta, indent=2) + "\n")
        write_text_atomic(tmp / "config.yaml", OmegaConf.to_yaml(OmegaConf.structured(self.cfg)))
        final = self.root / step_dir_name(step)
        if final.exists():  # saved again after resuming from an older checkpoint
            old = final.with_name(final.name + ".old")
            shutil.rmtree(old, ignore_errors=True)
            os.replace(final, old)
            shutil.rmtree(old, ignore_errors=True)
        os.replace(tmp, final)
        write_text_atomic(self.root / LATEST, final.name + "\n")
        fsync_dir(self.root)
        self.last_save = {"step": step, "seconds": total_s, "blocking_seconds": blocking_s, "bytes": dir_bytes(final)}
        self._retain(final)

    def _retain(self, newest: Path) -> None:
        """Keep the `keep` newest up to `newest`; newer ones belong to a timeline this run abandoned
        (it resumed from an older checkpoint because they could not be loaded)."""
        history = [p for p in published(self.root) if step_of(p) <= step_of(newest)]
        keep = set(history[-self.cfg.checkpoint.keep :])
        for path in published(self.root):
            if path not in keep:
                shutil.rmtree(path, ignore_errors=True)

    def pop_last_save(self) -> dict | None:
        """What the latest published save cost (rank 0), once: {step, seconds, blocking_seconds, bytes}, or None."""
        saved, self.last_save = self.last_save, None
        return saved

    def close(self) -> None:
        try:
            self.wait()
        finally:
            for group in (self.group, self.poll_group):
                if group is not None:
                    dist.destroy_process_group(group)
            self.group = self.poll_group = None

    # ---- load ------------------------------------------------------------------------------

    def _inspect(self, path: Path, weights_only: bool = False) -> tuple[str | None, Any]:
        """(why `path` cannot be loaded, or None; its DCP metadata), the same on every rank. A checkpoint of
        other settings is a ConfigError; the files' checksums are verified by the ranks in parallel."""

        def on_main():
            problem, metadata = inspect(path, resume=not weights_only)
            meta = read_meta(path) if problem is None else {}
            if problem is None:
                self._check_settings(path, meta, weights_only)
            return problem, metadata, meta

        problem, metadata, meta = self._from_main(on_main)
        if problem is None:
            problem = self._first_problem(verify_files(path, meta, self.ps.rank, self.ps.world_size))
        return problem, metadata

    def _check_settings(self, path: Path, meta: dict, weights_only: bool) -> None:
        changed = changed_setting(meta, self.cfg, self.data_identity, weights_only)
        if changed is None:
            if weights_only:
                self._check_architecture(path, meta)
            return
        key, saved, now = changed
        if weights_only:
            raise ConfigError(
                f"{key} is {now} but checkpoint {path} was saved with {saved}: its weights need the same model "
                f"shape; set {key}={saved}."
            )
        # The data's identity is its content, not a setting: what to restore is the data itself.
        is_data = key.startswith("data.") or key == "tokenizer"
        restore = "train on the data it was saved with" if is_data else "set it back"
        raise ConfigError(
            f"{key} changed from {saved} to {now} since the checkpoint {path}: {restore} to resume that run, or "
            "start a new one (another run.dir, or run.overwrite=true; checkpoint.load=PATH "
            "checkpoint.load_weights_only=true starts from its weights)."
        )

    def _check_architecture(self, path: Path, meta: dict) -> None:
        """A start from the weights of `path` (their shapes already match): every other model setting that
        differs from its record is named in one line; those that change what the weights compute are refused
        unless checkpoint.allow_architecture_change=true confirms them."""
        differences = model_differences(meta.get("model") or {}, self.cfg.model)
        refused = meaning_changes(differences)
        if refused and not self.cfg.checkpoint.allow_architecture_change:
            saved = ", ".join(f"{key}={_shown(was)}" for key, was, _ in refused)
            now = ", ".join(_shown(now) for _, _, now in refused)
            raise ConfigError(
                f"checkpoint {path} was saved with {saved}, which this run changes (to {now}) and which change what "
                "its weights compute: set them back, or set checkpoint.allow_architecture_change=true to train "
                "its weights in the changed model."
            )
        if differences:
            changes = ", ".join(f"{key} {_shown(was)} -> {_shown(now)}" for key, was, now in differences)
            log.warning(f"Model settings that differ from those checkpoint {path} was saved with: {changes}.")

    def _read(self, path: Path, targets: dict[str, torch.Tensor]) -> str | None:
        """Load `targets` in place; returns why it failed on any rank (the same on all), or None."""
        problem = None
        try:
            with no_single_process_warning():
                dcp.load(
                    targets,
                    storage_reader=dcp.FileSystemReader(str(path)),
                    process_group=self.group,
                    no_dist=self.group is None,
                )
        except (Exception, CheckpointException) as err:  # CheckpointException (a BaseException) on every rank
            first_line = (str(err).strip() or "no message").splitlines()[0][:300]
            problem = f"reading it failed ({type(err).__name__}: {first_line})"
        return self._first_problem(problem)

    def _model_targets(self, model, metadata, path: Path) -> dict[str, torch.Tensor]:
        """This rank's model entries to read; a missing key or another shape means another model."""
        targets = model_targets(model)
        saved = metadata.state_dict_metadata
        problem = None
        for key, t in targets.items():
            if key not in saved:
                problem = f"it has no {key}"
            elif tuple(saved[key].size) != tuple(t.shape):
                problem = f"{key} has shape {tuple(saved[key].size)}, this model's {tuple(t.shape)}"
            if problem:
                break
        problem = self._first_problem(problem)
        if problem:
            raise ConfigError(
                f"checkpoint {path} was saved from another model ({problem}): use the model settings it was "
                "saved with (its config.yaml), or a new checkpoint.dir / run.dir."
            )
        return targets

    def load_weights(self, path: Path, model) -> None:
        """checkpoint.load_weights_only: the model's weights (router biases included) and nothing else."""
        problem, metadata = self._inspect(path, weights_only=True)
        if problem is None:
            targets = self._model_targets(model, metadata, path)
            problem = self._read(path, targets)
        if problem:
            raise ConfigError(f"checkpoint.load={path} cannot be loaded: {problem}; give another checkpoint.")
        apply_model_state(model, targets)
        if self.ps.is_main:
            log.warning(f"Starting a new run from the weights of {path}.")

    def resume(self, paths: list[Path], explicit: bool, model, optimizer, loader) -> Restored | None:
        """Restore everything from the first loadable of `paths`; an unloadable one is skipped with a
        warning (or, when the user named it with checkpoint.load, is an error)."""
        for path in paths:
            started = time.perf_counter()
            problem, metadata = self._inspect(path)
            if problem is None:
                targets = self._model_targets(model, metadata, path)
                shards, problem = self._optimizer_targets(optimizer, model, metadata)
                if problem is None:
                    targets.update(self._scalar_targets(metadata))
                    targets.update({f"{r.key}/{k}": t for r, tensors in shards.items() for k, t in tensors.items()})
                    problem = self._read(path, targets)
            if problem is None:
                restored = self._apply(path, targets, shards, model, optimizer, loader)
                if restored.step > self.cfg.train.steps:  # the loop would not run: nothing would be said
                    raise ConfigError(
                        f"checkpoint {path} is at step {restored.step}, past train.steps={self.cfg.train.steps}: "
                        f"nothing is left to train; raise train.steps above {restored.step} to continue it."
                    )
                if self.ps.is_main:
                    log.warning(
                        f"Resuming from {path} (step {restored.step}; read in {time.perf_counter() - started:.2f} s)."
                    )
                return restored
            if explicit:
                raise ConfigError(f"checkpoint.load={path} cannot be loaded: {problem}; give another checkpoint.")
            if self.ps.is_main:
                log.warning(f"Checkpoint {path} cannot be loaded ({problem}); trying the previous one.")
        if paths:  # starting afresh would later delete them (retention): keep them and stop
            raise ConfigError(
                f"none of the {len(paths)} checkpoint(s) in {self.root} can be loaded (see the warnings above); "
                "they are kept: repair or move them away, or start a new run with another run.dir."
            )
        return None

    def _optimizer_targets(self, optimizer, model, metadata):
        saved = metadata.state_dict_metadata
        step = saved.get("optim/step")
        by_name = saved_ranges(saved)
        needed = needed_ranges(optimizer, model)
        if not by_name:
            return {}, "it holds no optimizer state (give it as checkpoint.load to start a new run from its weights)"
        requests, problem = optimizer_requests(needed, by_name)
        problem = self._first_problem(problem)
        if problem or step is None:
            return {}, problem or "it has no optim/step"
        shards = {}
        for r in requests:
            kinds = [k for k in ("exp_avg", "exp_avg_sq", "master") if f"{r.key}/{k}" in saved]
            shards[r] = {k: torch.empty(r.hi - r.lo, dtype=saved[f"{r.key}/{k}"].properties.dtype) for k in kinds}
        return shards, None

    def _scalar_targets(self, metadata) -> dict[str, torch.Tensor]:
        saved = metadata.state_dict_metadata
        targets = {key: torch.zeros((), dtype=torch.int64) for key in TRAINER_KEYS if key in saved}
        # RNG states continue only in the same world size; elsewhere the seeded states stay.
        for device in {"cpu", self.device_type}:
            key = f"rng/{device}/rank_{self.ps.rank}"
            if key in saved:
                targets[key] = torch.empty(tuple(saved[key].size), dtype=torch.uint8)
        return targets

    def _apply(self, path: Path, targets, shards, model, optimizer, loader) -> Restored:
        """The load succeeded on every rank: only now is live state replaced."""
        apply_model_state(model, targets)
        load_optimizer_state(optimizer, model, int(targets.get("optim/step", torch.tensor(0))), shards)
        step = int(targets["trainer/step"])
        samples = int(targets["trainer/samples_consumed"])
        loader.load_state_dict({"samples_consumed": samples})
        same_world = int(targets.get("trainer/world", torch.tensor(-1))) == self.ps.world_size
        if same_world and f"rng/cpu/rank_{self.ps.rank}" in targets:
            torch.set_rng_state(targets[f"rng/cpu/rank_{self.ps.rank}"])
        device_key = f"rng/{self.device_type}/rank_{self.ps.rank}"
        if same_world and self.device_type != "cpu" and device_key in targets:
            torch.get_device_module(self.device_type).set_rng_state(targets[device_key])
        self.last_saved_step = step
        return Restored(path, step, samples, int(targets.get("trainer/skipped_in_row", torch.tensor(0))))

    # ---- cadence -----------------------------------------------------------------------------

    def due(self, step: int, total_steps: int) -> bool:
        """A save is due every `interval` steps and at the end of training (when checkpointing is on)."""
        return step != self.last_saved_step and due_every(step, self.cfg.checkpoint.interval, total_steps)
