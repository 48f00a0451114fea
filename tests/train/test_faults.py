"""Fault handling: a non-finite loss on one rank is skipped on every rank, too many in a row stop the run
naming that rank, and SIGTERM / SIGUSR1 save a checkpoint at the next step boundary and exit 0.

Faults are injected by the tests (patching the loss inside the spawned ranks, sending signals), never
through hooks in the trainer.
"""

from __future__ import annotations

import json
import logging
import os
import signal
import subprocess
import sys
import time

import pytest
import torch
import torch.distributed as dist

from optimus.train.faults import StopSignal, TrainingDiverged, pack_step_flags, parameters_finite, unpack_step_flags
from tests.conftest import SMALL_MODEL_RUN
from tests.distributed import DistributedTestError, run_distributed

COMMON = [
    *SMALL_MODEL_RUN,
    "model.moe.router=sigmoid",
    "model.moe.bias_update_rate=0.01",
    "train.micro_batch=2",
    "train.eval_sequences=8",
    "train.eval_interval=100",
    "optim.warmup_steps=2",
    "parallel.timeout_s=60",
]


def read_metrics(run_dir) -> list[dict]:
    """The records of the run's optimizer steps (without the starting evaluation, step 0)."""
    records = [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines()]
    return [r for r in records if r["step"] > 0]


def test_step_flags_pack_and_unpack():
    sums = torch.tensor([4.0, 3.0, 2.0, float("nan")])
    packed = pack_step_flags(sums, rank=2, world_size=3, stop=True)
    assert packed.shape == (10,) and packed[4:].tolist() == [0.0, 0.0, 1.0, 1.0, 0.0, 0.0]
    agreed = unpack_step_flags(packed + pack_step_flags(torch.ones(4), 0, 3, False), n_micro_batches=2)
    assert agreed.nonfinite_ranks == [2] and agreed.stop and not agreed.nonfinite_params
    assert agreed.means[:3] == [2.5, 2.0, 1.5] and agreed.sq_norm == 0.0 and agreed.tokens_per_expert is None
    params_bad = pack_step_flags(torch.ones(4), 1, 3, False, params_finite=torch.tensor(False))
    agreed = unpack_step_flags(packed + params_bad, n_micro_batches=2)
    assert agreed.nonfinite_params and agreed.nonfinite_ranks == [2] and agreed.stop


def test_the_gradient_norm_and_tokens_per_expert_travel_with_the_flags_exactly():
    """One all-reduce (a sum) of two ranks' packed values: the squared norms add, the counts add as integers
    (exact in fp64 far past any step's token count)."""
    counts = [torch.tensor([[3, 2**40], [0, 7]]), torch.tensor([[1, 5], [2**40, 0]])]
    packed = [
        pack_step_flags(torch.ones(4), r, 2, False, sq_norm=torch.tensor(2.25 * (r + 1), dtype=torch.float64),
                        counts_LE=counts[r])
        for r in range(2)
    ]  # fmt: skip
    agreed = unpack_step_flags(packed[0] + packed[1], n_micro_batches=2, counts_shape=(2, 2))
    assert agreed.sq_norm == 6.75 and agreed.nonfinite_ranks == [] and not agreed.stop
    assert agreed.tokens_per_expert == (counts[0] + counts[1]).tolist()


def test_parameters_finite_sees_one_nan_or_inf_in_any_dtype():
    model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 4).to(torch.bfloat16))
    assert parameters_finite(model).item()
    for bad in (float("nan"), float("inf"), -float("inf")):
        with torch.no_grad():
            model[1].bias[2] = bad
        assert not parameters_finite(model).item()
        with torch.no_grad():
            model[1].bias[2] = 0.0


def test_stop_signal_sets_a_flag_instead_of_killing():
    stop = StopSignal()
    stop.install()
    try:
        os.kill(os.getpid(), signal.SIGUSR1)
        assert stop.requested and stop.received == "SIGUSR1"
    finally:
        stop.restore()
    assert signal.getsignal(signal.SIGUSR1) == signal.SIG_DFL


def faulty_rank(overrides: list[str], cache: str, bad_rank: int, bad_steps: list[int], term_step: int | None):
    """One rank: NaN added to its loss at `bad_steps` (gradients stay finite, so only the agreement can
    skip the step), or SIGTERM sent to itself during step `term_step`; returns per-step snapshots."""
    os.environ["OPTIMUS_CACHE"] = cache
    torch.set_num_threads(1)
    import optimus.train.step as step_module
    import optimus.train.trainer as trainer_module
    from optimus.cli import load_config

    trainer = trainer_module.Trainer.from_config(load_config(overrides))
    rank = dist.get_rank()
    real_loss = step_module.micro_batch_loss

    def poisoned_loss(model, batch, cfg, platform):
        loss = real_loss(model, batch, cfg, platform)
        if rank == bad_rank and trainer.step + 1 in bad_steps:
            loss = loss + float("nan")
        if rank == bad_rank and trainer.step + 1 == term_step:
            os.kill(os.getpid(), signal.SIGTERM)
        return loss

    step_module.micro_batch_loss = poisoned_loss
    snapshots = []
    real_step = trainer.train_step

    def recording_step():
        record = real_step()
        # Plain lists: tensors would travel back through shared memory that dies with the rank.
        state = {k: v.tolist() for k, v in trainer.model.state_dict().items() if ".experts." not in k}
        snapshots.append(state)
        return record

    trainer.train_step = recording_step
    summary = trainer.fit()
    return snapshots, summary, trainer.loader.state_dict()["samples_consumed"]


def _overrides(corpus_file, run_dir, *extra):
    layout = ["parallel.nproc=2", "parallel.ep=2", "optim.sharding=ep_aware", "optim.zero=2", "optim.bucket_mb=0.01"]
    return [*COMMON, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", *layout, *extra]


def test_nonfinite_loss_on_one_rank_is_skipped_on_all(tmp_path, corpus_file):
    run_dir = tmp_path / "run"
    cache = os.environ["OPTIMUS_CACHE"]
    results = run_distributed(
        faulty_rank, 2, _overrides(corpus_file, run_dir, "train.steps=4"), cache, 1, [2], None, timeout_s=180
    )
    metrics = read_metrics(run_dir)
    assert [m["skipped"] for m in metrics] == [False, True, False, False]
    assert metrics[1]["nonfinite_ranks"] == [1] and metrics[1]["grad_norm"] is None
    for snapshots, _, consumed in results:
        assert consumed == 4 * 8  # the skipped step's batch is consumed all the same
        for key in snapshots[0]:
            assert snapshots[1][key] == snapshots[0][key], f"step 2 changed {key}"
        assert any(snapshots[2][k] != snapshots[1][k] for k in snapshots[0])  # step 3 trains
    (snaps0, _, _), (snaps1, _, _) = results
    for key in snaps0[-1]:  # replicated state stayed identical across ranks
        assert snaps0[-1][key] == snaps1[-1][key], key


def test_too_many_skipped_steps_name_the_rank(tmp_path, corpus_file):
    overrides = _overrides(corpus_file, tmp_path / "run", "train.steps=4", "train.max_skipped_steps=1")
    with pytest.raises(DistributedTestError, match=r"2 steps in a row were skipped .* rank\(s\) 1 of 2"):
        run_distributed(faulty_rank, 2, overrides, os.environ["OPTIMUS_CACHE"], 1, [2, 3], None, timeout_s=180)


def test_sigterm_on_one_rank_stops_all_at_a_checkpoint(tmp_path, corpus_file):
    run_dir = tmp_path / "run"
    overrides = _overrides(corpus_file, run_dir, "train.steps=20")  # checkpoint.interval=0: a signal still saves
    results = run_distributed(faulty_rank, 2, overrides, os.environ["OPTIMUS_CACHE"], 1, [], 2, timeout_s=180)
    # The signal lands during step 2's forward on rank 1, before the step's flags are reduced: both ranks
    # finish step 2, save it, and stop.
    (_, summary0, _), (_, summary1, _) = results
    assert summary0["steps"] == summary1["steps"] == 2
    assert summary1["stopped_by"] == "SIGTERM" and summary0["stopped_by"] == "a stop signal on another rank"
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert not list((run_dir / "checkpoints").glob("*.tmp"))


@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_sigterm_or_ctrl_c_to_a_training_process_saves_and_exits_zero(tmp_path, corpus_file, sig):
    run_dir = tmp_path / "run"
    overrides = [*COMMON, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", "train.steps=500"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "optimus", "train", *overrides],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )
    try:
        deadline = time.monotonic() + 120
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # step 0, then 2 steps
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        proc.send_signal(sig)
        output, _ = proc.communicate(timeout=60)
    finally:
        proc.kill()
    assert proc.returncode == 0, output
    last = read_metrics(run_dir)[-1]["step"]
    assert 2 <= last < 500
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == f"step_{last:06d}"
    assert "run the same command again to resume" in output


def _descendants(pid: int) -> list[int]:
    """Every process below `pid` (Linux /proc)."""
    found, todo = [], [pid]
    while todo:
        for task in os.scandir(f"/proc/{todo.pop()}/task"):
            try:
                children = [int(c) for c in open(f"{task.path}/children").read().split()]
            except OSError:
                continue
            found += children
            todo += children
    return found


def _alive(pid: int) -> bool:
    """Running (a zombie waiting for a reaper counts as ended)."""
    try:
        status = open(f"/proc/{pid}/status").read()
    except OSError:
        return False
    return "\nState:\tZ" not in status


@pytest.mark.skipif(not os.path.isdir("/proc/self/task"), reason="reads the process tree from /proc")
@pytest.mark.parametrize("sig", [signal.SIGTERM])  # SIGUSR1 and SIGINT take the same path (test_launch.py)
def test_a_stop_signal_to_a_local_two_rank_run_saves_and_ends_every_process(tmp_path, corpus_file, sig):
    """The signal goes to the launching process only (as `kill PID` or a batch system does): it passes it on,
    the ranks save at the next step boundary, and every process ends within 10 s of the checkpoint."""
    run_dir = tmp_path / "run"
    overrides = [*COMMON, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", "parallel.nproc=2"]
    proc = subprocess.Popen(
        [sys.executable, "-m", "optimus", "train", *overrides, "train.steps=100000"],
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
        start_new_session=True,  # its own process group, so the test can clean up whatever is left
    )
    latest = run_dir / "checkpoints" / "latest"
    try:
        deadline = time.monotonic() + 180
        metrics = run_dir / "metrics.jsonl"
        while not (metrics.exists() and len(metrics.read_text().splitlines()) >= 3):  # step 0, then 2 steps
            assert proc.poll() is None and time.monotonic() < deadline, proc.stdout.read() if proc.stdout else ""
            time.sleep(0.1)
        ranks = _descendants(proc.pid)
        assert len(ranks) >= 2
        proc.send_signal(sig)
        while not latest.exists():
            assert time.monotonic() < deadline, "no checkpoint was saved"
            time.sleep(0.05)
        saved_at = time.monotonic()
        output, _ = proc.communicate(timeout=60)
        while any(_alive(pid) for pid in ranks) and time.monotonic() < saved_at + 10:
            time.sleep(0.1)
        left = [pid for pid in ranks if _alive(pid)]
        ended_after_s = time.monotonic() - saved_at
    finally:
        if proc.poll() is None:
            os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    assert proc.returncode == 0, output
    assert not left and ended_after_s < 10, f"processes {left} still ran {ended_after_s:.1f} s after the checkpoint"
    last = read_metrics(run_dir)[-1]["step"]
    assert latest.read_text().strip() == f"step_{last:06d}"
    # One line answers the signal, rank 0's: the launcher adds none, and no "Finished" line follows.
    assert output.splitlines()[-1].startswith(f"Stop signal: saved step {last} in "), output
    assert "Traceback" not in output and "Finished" not in output and "stopped by" not in output


def faulty_pipeline_rank(overrides: list[str], cache: str, bad_rank: int, bad_step: int):
    """One rank of a pipeline: NaN added to the last stage's loss on `bad_rank` at `bad_step`; per-step
    snapshots of this rank's stage."""
    os.environ["OPTIMUS_CACHE"] = cache
    torch.set_num_threads(1)
    import optimus.parallel.pipeline as pipeline_module
    import optimus.train.trainer as trainer_module
    from optimus.cli import load_config

    real_loss, real_pipeline_step = pipeline_module.Pipeline._loss, pipeline_module.Pipeline.step
    rank, steps_run = dist.get_rank(), [0]

    def counting_step(self, batch_BS1):
        steps_run[0] += 1
        return real_pipeline_step(self, batch_BS1)

    def poisoned_loss(self, loss_BS, target):
        if rank == bad_rank and steps_run[0] == bad_step and not self.evaluating:
            loss_BS = loss_BS + float("nan")
        return real_loss(self, loss_BS, target)

    # before the pipeline hands its loss to the schedule
    pipeline_module.Pipeline._loss, pipeline_module.Pipeline.step = poisoned_loss, counting_step
    trainer = trainer_module.Trainer.from_config(load_config(overrides))
    snapshots = []
    real_step = trainer.train_step

    def recording_step():
        record = real_step()
        snapshots.append({k: v.tolist() for k, v in trainer.model.state_dict().items()})
        return record

    trainer.train_step = recording_step
    trainer.fit()
    return snapshots


def test_nonfinite_loss_on_the_last_pipeline_stage_is_skipped_on_every_stage(tmp_path, corpus_file):
    run_dir = tmp_path / "run"
    layout = ["parallel.nproc=2", "parallel.pp=2", "train.steps=4"]
    overrides = [*COMMON, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", *layout]
    results = run_distributed(faulty_pipeline_rank, 2, overrides, os.environ["OPTIMUS_CACHE"], 1, 2, timeout_s=180)
    metrics = read_metrics(run_dir)
    assert [m["skipped"] for m in metrics] == [False, True, False, False]
    for snapshots in results:  # the first stage, whose own loss was finite, skipped the update as well
        assert snapshots[1] == snapshots[0], "step 2 changed the stage"
        assert snapshots[2] != snapshots[1], "step 3 did not train"


# ---- parameters that an update left non-finite ------------------------------------------------------------


def poison_update(bad_update: int, ranks: tuple[int, ...] | None = None):
    """Patch the optimizer's AdamW update (optimus.optim.adamw.adamw_update) so that its update number
    `bad_update` writes a nan into the values it updates, on `ranks` (every rank when None): what beta2=1 or
    an overflowing update does, reached through the real optimizer step."""
    import optimus.optim.adamw as adamw

    real_update = adamw.adamw_update

    def poisoned(segments, param, grad, m, v, lr, step, *rest):
        real_update(segments, param, grad, m, v, lr, step, *rest)
        rank = dist.get_rank() if dist.is_initialized() else 0
        if step == bad_update and (ranks is None or rank in ranks):
            param[0] = float("nan")

    return adamw, "adamw_update", poisoned


class SavedWhenWaitedFor:
    """A background save that has not finished until someone waits for it (then it is written): the run
    ends while it is still in flight, whatever the machine's speed."""

    def __init__(self, state, kwargs):
        self.state = {k: v.clone() for k, v in state.items()}  # what async_save stages: later steps change it
        self.kwargs = kwargs

    def done(self) -> bool:
        return False

    def result(self) -> None:
        import torch.distributed.checkpoint as dcp

        from optimus.train.dcp_warning import no_single_process_warning

        with no_single_process_warning():  # as the checkpointer's own calls
            dcp.save(self.state, **self.kwargs)


def test_an_update_that_leaves_nan_parameters_fails_the_run_and_keeps_the_last_checkpoint(
    tmp_path, corpus_file, monkeypatch, capsys, caplog
):
    """The last update of the run goes non-finite: it is caught before its checkpoint is written, the run
    exits 1 with one sentence, the save of step 2 that was still in flight is published, and rerunning
    without the fault resumes from it."""
    import torch.distributed.checkpoint as dcp

    from optimus.cli import main

    run_dir = tmp_path / "run"
    overrides = [
        *COMMON, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", "train.steps=4",
        "checkpoint.interval=2", "checkpoint.async_save=true",
    ]  # fmt: skip
    with monkeypatch.context() as patch:
        patch.setattr(*poison_update(4))
        patch.setattr(dcp, "async_save", lambda state, **kwargs: SavedWhenWaitedFor(state, kwargs))
        assert main(["train", *overrides]) == 1
        out, err = capsys.readouterr()
    assert err.strip() == (
        "optimus: error: the parameters were not finite (nan or inf) after the update of step 4, which skipping "
        "steps cannot undo: no checkpoint of them was saved, so lower optim.lr (or check the other optim.* "
        "settings) and resume from the last checkpoint."
    )
    assert "Finished" not in out and "Traceback" not in out + err
    checkpoints = run_dir / "checkpoints"
    assert (checkpoints / "latest").read_text().strip() == "step_000002"
    assert sorted(p.name for p in checkpoints.iterdir()) == ["latest", "step_000002"]
    with caplog.at_level(logging.WARNING, logger="optimus.checkpoint"):
        assert main(["train", *overrides]) == 0  # the same run without the fault
    assert "step_000002 (step 2;" in caplog.text and "Finished 4 steps" in capsys.readouterr().out
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3, 4]


def nonfinite_update_rank(overrides: list[str], cache: str, bad_rank: int, bad_update: int) -> str:
    """One rank of a run whose update `bad_update` leaves a nan on `bad_rank` only; returns how it ended."""
    os.environ["OPTIMUS_CACHE"] = cache
    torch.set_num_threads(1)
    import optimus.train.trainer as trainer_module
    from optimus.cli import load_config

    module, name, poisoned = poison_update(bad_update, ranks=(bad_rank,))
    setattr(module, name, poisoned)
    try:
        trainer_module.Trainer.from_config(load_config(overrides)).fit()
    except TrainingDiverged as err:
        return str(err)
    return "finished"


def test_nan_parameters_on_one_rank_stop_every_rank_at_the_next_step(tmp_path, corpus_file):
    """sharding=none: each rank updates its own replica, so only rank 1's goes non-finite; the step flags
    carry it to rank 0, and both stop at step 4 without saving past step 2."""
    run_dir = tmp_path / "run"
    layout = ["parallel.nproc=2", "optim.sharding=none", "train.steps=6", "checkpoint.interval=2"]
    overrides = [*COMMON, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", *layout]
    endings = run_distributed(nonfinite_update_rank, 2, overrides, os.environ["OPTIMUS_CACHE"], 1, 3, timeout_s=180)
    assert endings == [endings[1]] * 2 and "after the update of step 3," in endings[0]
    assert [m["step"] for m in read_metrics(run_dir)] == [1, 2, 3]
    assert (run_dir / "checkpoints" / "latest").read_text().strip() == "step_000002"
    assert not list((run_dir / "checkpoints").glob("step_000004*"))
