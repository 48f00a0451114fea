"""A checkpoint is trusted only with its whole integrity record, a failed save ends the run, and a checkpoint
of weights only starts a new run (issue 34, items 1, 7, 9 and 10).

- meta.json unreadable, truncated, without its "files" checksums (or one file's), or without the records a
  resume is held to: resuming skips that checkpoint like a corrupt one, and export refuses it.
- A save that cannot be written (a full disk, injected into DCP's file writer or into the publishing of
  meta.json) ends the run with exit code 2 and one sentence naming the cause and the last good checkpoint,
  in the foreground and in the background (checkpoint.async_save, where two ranks must agree, also when only
  one of them cannot copy its state to CPU memory), and leaves the checkpoint directory as it was.
- `optimus checkpoint import`'s checkpoint (weights only) given as plain checkpoint.load trains exactly as
  with checkpoint.load_weights_only=true.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import shlex
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
import torch.distributed.checkpoint.filesystem as dcp_files

from optimus.cli import load_config, main
from optimus.train.checkpoint_dirs import CheckpointWriteError
from optimus.train.trainer import Trainer
from tests.conftest import SMALL_MODEL_RUN, copy_small_run
from tests.distributed import run_distributed
from tests.train.test_run_safety import error_of, steps_of
from tests.unchanged import unchanged


def edit_meta(step_dir, change) -> None:
    meta = json.loads((step_dir / "meta.json").read_text())
    change(meta)
    (step_dir / "meta.json").write_text(json.dumps(meta))


def truncate_meta(step_dir) -> None:
    (step_dir / "meta.json").write_bytes((step_dir / "meta.json").read_bytes()[:100])


def corrupt_a_tensor(step_dir) -> None:
    """Flip bytes in the middle of the largest saved tensor: DCP still reads it, into other values."""
    storage = dcp.FileSystemReader(str(step_dir)).read_metadata().storage_data.values()
    largest = max(storage, key=lambda info: info.length)
    path = step_dir / largest.relative_path
    data = bytearray(path.read_bytes())
    middle = largest.offset + largest.length // 2
    data[middle : middle + 64] = bytes(255 - b for b in data[middle : middle + 64])
    path.write_bytes(bytes(data))


# What vouches for the files (the case: with it gone, their corruption is not seen) ...
FILE_RECORDS = {
    "truncated": truncate_meta,
    "not an object": lambda d: (d / "meta.json").write_text("[]"),
    "without files": lambda d: edit_meta(d, lambda m: m.pop("files")),
    "one file unlisted": lambda d: edit_meta(d, lambda m: m["files"].pop("__0_0.distcp")),
}
# ... and the settings a checkpoint is held to (with them gone, another model or data would be accepted).
DAMAGED_RECORDS = {**FILE_RECORDS, "without model": lambda d: edit_meta(d, lambda m: m.pop("model"))}
RESUME_RECORDS = {**DAMAGED_RECORDS, "without run": lambda d: edit_meta(d, lambda m: m.pop("run"))}


@pytest.mark.parametrize("damage", RESUME_RECORDS)
def test_a_checkpoint_without_its_integrity_record_is_skipped(small_run, tmp_path, caplog, damage):
    run_dir, overrides = copy_small_run(small_run, tmp_path)
    newest = run_dir / "checkpoints" / "step_000004"
    if damage in FILE_RECORDS:
        corrupt_a_tensor(newest)
    RESUME_RECORDS[damage](newest)
    with caplog.at_level(logging.WARNING, logger="optimus.checkpoint"):
        assert main(["train", *overrides]) == 0
    assert f"Checkpoint {newest} cannot be loaded ({newest / 'meta.json'}" in caplog.text
    assert "step_000002 (step 2;" in caplog.text  # resumed from the previous checkpoint
    assert steps_of(run_dir) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize("damage", DAMAGED_RECORDS)
def test_export_refuses_a_checkpoint_without_its_integrity_record(small_run, tmp_path, capsys, damage):
    run_dir, _ = copy_small_run(small_run, tmp_path)
    step_dir = run_dir / "checkpoints" / "step_000004"
    DAMAGED_RECORDS[damage](step_dir)
    for fmt in ("safetensors", "hf"):
        out = tmp_path / ("model.safetensors" if fmt == "safetensors" else "hf")
        with unchanged(tmp_path):
            assert main(["checkpoint", "export", str(step_dir), "--format", fmt, "--out", str(out)]) == 2
        err = error_of(capsys)
        assert f"checkpoint {step_dir} cannot be read: {step_dir / 'meta.json'}" in err and len(err.splitlines()) == 1


# ---- a save that cannot be written ---------------------------------------------------------------


def full_disk_write(step_name: str):
    """DCP's item writer, failing as on a full disk when it writes into a directory named `step_name`(.tmp)."""
    real_write = dcp_files._write_item

    def write_or_fail(transforms, stream, *args, **kwargs):
        if step_name in str(getattr(stream, "name", "")):
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real_write(transforms, stream, *args, **kwargs)

    return write_or_fail


def fail_meta_json(monkeypatch) -> None:
    """The data is written, but publishing it cannot write meta.json (the last bytes of the disk went to it)."""
    import optimus.train.checkpoint as checkpoint

    real_write = checkpoint.write_text_atomic

    def write_or_fail(path, text):
        if path.name == "meta.json":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(path))
        real_write(path, text)

    monkeypatch.setattr(checkpoint, "write_text_atomic", write_or_fail)


def fail_staging(monkeypatch) -> None:
    """Not even the staging directory step_000006.tmp can be made."""
    real_mkdir = Path.mkdir

    def mkdir_or_fail(self, *args, **kwargs):
        if self.name == "step_000006.tmp":
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(self))
        real_mkdir(self, *args, **kwargs)

    monkeypatch.setattr(Path, "mkdir", mkdir_or_fail)


@pytest.mark.parametrize("where", ["staging", "data", "meta.json"])
@pytest.mark.parametrize("async_save", [False, True])
def test_a_save_on_a_full_disk_ends_the_run_naming_the_last_good_step(
    small_run, tmp_path, capsys, monkeypatch, where, async_save
):
    run_dir, overrides = copy_small_run(small_run, tmp_path)
    root = run_dir / "checkpoints"
    if where == "staging":
        fail_staging(monkeypatch)
    elif where == "data":
        monkeypatch.setattr(dcp_files, "_write_item", full_disk_write("step_000006"))
    else:
        fail_meta_json(monkeypatch)
    with unchanged(root):  # nothing published, nothing half-written left, `latest` unmoved
        code = main(["train", *overrides, "train.steps=8", f"checkpoint.async_save={str(async_save).lower()}"])
    assert code == 2
    out, err = capsys.readouterr()
    assert "Finished" not in out and "Traceback" not in err and len(err.splitlines()) == 1, err
    assert f"checkpoint of step 6 could not be written: no space left on {root}" in err
    assert f"the last good checkpoint is step 4 ({root / 'step_000004'})" in err


def test_a_failed_first_save_says_the_command_that_the_run_directory_then_accepts(
    tmp_path, corpus_file, capsys, monkeypatch
):
    """No checkpoint before it: the run's records are kept, so the same command is refused unless
    run.overwrite=true starts the run over, and the sentence says so (issue 55; it said "run the command
    again")."""
    run_dir = tmp_path / "run"
    args = [*SMALL_MODEL_RUN, "data=text", f"data.path={corpus_file}", f"run.dir={run_dir}", "train.micro_batch=4",
            "train.eval_sequences=4", "train.steps=2", "checkpoint.interval=2"]  # fmt: skip
    with monkeypatch.context() as mp:
        mp.setattr(dcp_files, "_write_item", full_disk_write("step_000002"))
        assert main(["train", *args]) == 2
    err = error_of(capsys)
    assert err.endswith(
        "no checkpoint of this run was saved before it: free space there and run the same command with "
        "run.overwrite=true to start it over.\n"
    )
    with unchanged(run_dir):
        assert main(["train", *args]) == 2
    assert "already holds a run" in error_of(capsys)
    assert main(["train", *args, "run.overwrite=true"]) == 0
    assert steps_of(run_dir) == [0, 1, 2]


def train_on_a_full_disk(overrides: list[str], cache: str, step_name: str) -> str:
    """Body of one rank: train while the save into `step_name` fails; what the run ended with."""
    dcp_files._write_item = full_disk_write(step_name)  # this process ends with the test
    return how_training_ends(overrides, cache)


def how_training_ends(overrides: list[str], cache: str) -> str:
    """Train on this rank: "finished", or the sentence of the CheckpointWriteError that ended the run."""
    os.environ["OPTIMUS_CACHE"] = cache
    torch.set_num_threads(1)
    try:
        Trainer.from_config(load_config(overrides)).fit()
    except CheckpointWriteError as err:
        return str(err)
    return "finished"


def test_a_failed_background_save_ends_every_rank_alike(tmp_path, corpus_file):
    """Two ranks see the failure of their background save at the same step and stop with the same sentence."""
    root = tmp_path / "run" / "checkpoints"
    overrides = [
        *SMALL_MODEL_RUN, "data=text", f"data.path={corpus_file}", f"run.dir={tmp_path / 'run'}", "train.steps=4",
        "train.micro_batch=2", "train.eval_sequences=4", "train.eval_interval=100", "checkpoint.interval=1",
        "checkpoint.async_save=true", "parallel.timeout_s=60",
    ]  # fmt: skip
    ended = run_distributed(train_on_a_full_disk, 2, overrides, str(tmp_path / "cache"), "step_000002", timeout_s=240)
    assert ended[0] == ended[1] and "checkpoint of step 2 could not be written: no space left on" in ended[0]
    assert f"the last good checkpoint is step 1 ({root / 'step_000001'})" in ended[0]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]
    assert (root / "latest").read_text().strip() == "step_000001"


NO_STAGING_MEMORY = "DefaultCPUAllocator: can't allocate memory"


def train_while_rank_1_cannot_stage(overrides: list[str], cache: str, step_name: str) -> str:
    """Body of one rank: train while rank 1 alone fails to copy the state of `step_name` to CPU memory."""
    if dist.get_rank() == 1:
        real_stage = dcp.FileSystemWriter.stage

        def stage_or_fail(self, state_dict):
            if Path(self.path).name == step_name + ".tmp":
                raise RuntimeError(f"{NO_STAGING_MEMORY}: you tried to allocate 1048576 bytes.")
            return real_stage(self, state_dict)

        dcp.FileSystemWriter.stage = stage_or_fail  # this process ends with the test
    return how_training_ends(overrides, cache)


def test_a_background_save_that_one_rank_cannot_stage_ends_every_rank_alike(tmp_path, corpus_file):
    """Only rank 1 cannot copy its state of step 2 to CPU memory: both ranks stop at once with the same
    sentence, rather than rank 1 reporting it on the group where rank 0's save has started (a hang)."""
    root = tmp_path / "run" / "checkpoints"
    overrides = [
        *SMALL_MODEL_RUN, "data=text", f"data.path={corpus_file}", f"run.dir={tmp_path / 'run'}", "train.steps=4",
        "train.micro_batch=2", "train.eval_sequences=4", "train.eval_interval=100", "checkpoint.interval=1",
        "checkpoint.async_save=true", "parallel.timeout_s=60",
    ]  # fmt: skip
    args = (overrides, str(tmp_path / "cache"), "step_000002")
    ended = run_distributed(train_while_rank_1_cannot_stage, 2, *args, timeout_s=240)
    assert ended[0] == ended[1], ended
    assert f"checkpoint of step 2 could not be written: RuntimeError: {NO_STAGING_MEMORY}" in ended[0]
    assert f"the last good checkpoint is step 1 ({root / 'step_000001'})" in ended[0]
    assert sorted(p.name for p in root.iterdir()) == ["latest", "step_000001"]


# ---- a checkpoint of weights only ----------------------------------------------------------------

HF_TRAIN = [
    "train.dtype=fp32", "kernels=torch", "logging.progress=false", "train.steps=2", "train.seq_len=16",
    "train.global_batch=2", "train.micro_batch=2", "train.eval_interval=2", "train.eval_sequences=2",
    "optim.warmup_steps=1", "checkpoint.interval=2",
]  # fmt: skip


def test_an_imported_checkpoint_given_as_plain_load_starts_at_step_0(tmp_path, corpus_file, capsys, caplog):
    pytest.importorskip("transformers")
    from tests.hf.test_hf import CASES, random_hf_model

    fmt, shape = CASES["olmoe-gqa-top8"]
    random_hf_model(fmt, **{**shape, "vocab": 301}).save_pretrained(tmp_path / "hf")
    assert main(["checkpoint", "import", str(tmp_path / "hf"), "--out", str(tmp_path / "imported")]) == 0
    command = shlex.split(capsys.readouterr().out.strip().splitlines()[-1])[2:]  # after `optimus train`
    # the data keys it leaves to fill in (DATA_PATH, TOKENIZER: the source has no tokenizer) are this test's own
    command = [o for o in command if not o.startswith(("data=", "data.path=", "data.tokenizer="))]
    plain = [o for o in command if o != "checkpoint.load_weights_only=true"]
    assert len(plain) == len(command) - 1
    summaries = {}
    for name, overrides in {"plain": plain, "weights_only": command}.items():
        data = ["data=text", f"data.path={corpus_file}", "data.vocab_size=300", f"run.dir={tmp_path / name}"]
        with caplog.at_level(logging.WARNING, logger="optimus.checkpoint"):
            summaries[name] = Trainer.from_config(load_config([*overrides, *data, *HF_TRAIN])).fit()
    assert "holds weights only" in caplog.text
    metrics = {name: (tmp_path / name / "metrics.jsonl").read_text().splitlines() for name in summaries}
    losses = {name: [json.loads(line)["loss"] for line in lines[1:]] for name, lines in metrics.items()}  # 1: step 0
    assert len(losses["plain"]) == 2 and losses["plain"] == losses["weights_only"]  # steps 1-2, fresh optimizer
    assert summaries["plain"]["first_val_loss"] == summaries["weights_only"]["first_val_loss"]


def test_a_full_disk_is_named_even_when_it_interrupted_another_error(tmp_path):
    """ENOSPC raised while another error was being handled: the disk is the cause to report, not the other."""
    import errno

    from optimus.train.checkpoint_dirs import write_failure

    try:
        try:
            raise ValueError("an unrelated earlier problem")
        except ValueError:
            raise OSError(errno.ENOSPC, "No space left on device")  # noqa: B904 (the implicit context is the case)
    except OSError as err:
        cause, action = write_failure(err, tmp_path)
    assert cause.startswith("no space left on") and str(tmp_path) in cause and action == "free space there"
