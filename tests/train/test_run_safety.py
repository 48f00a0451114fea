"""A run's history is never lost or silently wrong (issue 17): run directories belong to one run, checkpoints
carry checksums and the settings they were saved with, and every refusal is one sentence (exit code 2).

All tests share one small trained run (conftest.small_run) and work on copies of it.
"""

from __future__ import annotations

import json
import logging
import os
import stat

import pytest
from torch.distributed.checkpoint.api import CheckpointException

from optimus.cli import load_config, main
from optimus.config import ConfigError
from optimus.train.checkpoint_dirs import inspect
from tests.conftest import copy_small_run
from tests.unchanged import unchanged


def flip_middle(path, nbytes=4096) -> None:
    """Overwrite `nbytes` in the middle of `path` with their complement: same size, other content."""
    data = bytearray(path.read_bytes())
    mid = len(data) // 2 - nbytes // 2
    data[mid : mid + nbytes] = bytes(255 - b for b in data[mid : mid + nbytes])
    path.write_bytes(bytes(data))


def steps_of(run_dir) -> list[int]:
    return [json.loads(line)["step"] for line in (run_dir / "metrics.jsonl").read_text().splitlines()]


def error_of(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err
    return err


def test_checkpoints_record_checksums_and_settings(small_run):
    run_dir, _ = small_run
    meta = json.loads((run_dir / "checkpoints" / "step_000004" / "meta.json").read_text())
    assert set(meta["files"]) == {".metadata", "__0_0.distcp"}
    assert meta["run"]["train.seq_len"] == 16 and meta["run"]["tokenizer"].startswith("sha256:")


def test_a_same_size_corruption_falls_back_with_a_warning_naming_the_file(small_run, tmp_path, caplog):
    run_dir, overrides = copy_small_run(small_run, tmp_path)
    bad = run_dir / "checkpoints" / "step_000004" / "__0_0.distcp"
    flip_middle(bad)
    assert inspect(bad.parent)[0] is None  # sizes and metadata alone cannot see it
    with caplog.at_level(logging.WARNING, logger="optimus.checkpoint"):
        assert main(["train", *overrides]) == 0
    assert f"{bad} does not match the checksum" in caplog.text
    assert "step_000002 (step 2;" in caplog.text  # resumed from the previous checkpoint
    assert steps_of(run_dir) == [0, 1, 2, 3, 4]


def test_no_loadable_checkpoint_refuses_and_keeps_them_all(small_run, tmp_path, capsys):
    run_dir, overrides = copy_small_run(small_run, tmp_path)
    before = sorted(p.name for p in (run_dir / "checkpoints").iterdir())
    for step in ("step_000002", "step_000004"):
        flip_middle(run_dir / "checkpoints" / step / "__0_0.distcp")
    assert main(["train", *overrides]) == 2
    assert "none of the 2 checkpoint(s)" in error_of(capsys)
    assert sorted(p.name for p in (run_dir / "checkpoints").iterdir()) == before
    assert steps_of(run_dir) == [0, 1, 2, 3, 4]


@pytest.mark.parametrize(
    "override, message",
    [
        ("train.seq_len=8", "train.seq_len changed from 16 to 8 since the checkpoint"),
        ("train.global_batch=16", "train.global_batch changed from 8 to 16"),
        ("model.moe.top_k=1", "model.moe.top_k changed from 2 to 1"),
        ("data.val_fraction=0.1", "data.val_fraction changed from 0.02 to 0.1"),
        ("optim.update=muon", "optim.update changed from adamw to muon"),  # AdamW's moments are not Muon's state
    ],
)
def test_resuming_with_other_data_or_shape_is_refused_by_name(small_run, tmp_path, capsys, override, message):
    run_dir, overrides = copy_small_run(small_run, tmp_path)
    metrics = (run_dir / "metrics.jsonl").read_text()
    assert main(["train", *overrides, override]) == 2
    assert message in error_of(capsys)
    assert (run_dir / "metrics.jsonl").read_text() == metrics


def test_resuming_with_another_corpus_is_refused(small_run, tmp_path, capsys):
    from tests.conftest import write_corpus

    run_dir, overrides = copy_small_run(small_run, tmp_path)
    other = write_corpus(tmp_path / "other.jsonl", seed=1)
    assert main(["train", *overrides, f"data.path={other}"]) == 2
    assert "data.tokens changed from" in error_of(capsys)


def test_new_lr_and_more_steps_resume_but_fewer_steps_are_refused(small_run, tmp_path, capsys):
    run_dir, overrides = copy_small_run(small_run, tmp_path)
    assert main(["train", *overrides, "train.steps=3"]) == 2
    assert "at step 4, past train.steps=3" in error_of(capsys)
    assert main(["train", *overrides, "train.steps=5", "optim.lr=3e-3"]) == 0
    assert steps_of(run_dir) == [0, 1, 2, 3, 4, 5]


def test_weights_only_starts_a_new_run_with_other_data_settings(small_run, tmp_path, capsys):
    source, overrides = small_run
    new = [o for o in overrides if not o.startswith("run.dir=")]
    start = [f"checkpoint.load={source / 'checkpoints'}", "checkpoint.load_weights_only=true", "train.steps=1"]
    assert main(["train", *new, f"run.dir={tmp_path / 'a'}", *start, "train.seq_len=8"]) == 0
    assert main(["train", *new, f"run.dir={tmp_path / 'b'}", *start, "model.n_layers=3"]) == 2
    assert "model.n_layers is 3 but checkpoint" in error_of(capsys)


def test_a_finished_run_without_checkpoints_is_not_replaced(small_run, tmp_path, capsys):
    run_dir, overrides = copy_small_run(small_run, tmp_path)
    for path in (run_dir / "checkpoints").iterdir():
        if path.is_dir():
            for f in path.iterdir():
                f.unlink()
            path.rmdir()
        else:
            path.unlink()
    records, config = (run_dir / "metrics.jsonl").read_text(), (run_dir / "config.yaml").read_text()
    changed = [*overrides, "model.dim=64", "checkpoint.interval=1", "train.steps=1"]
    assert main(["train", *changed]) == 2
    assert "run.overwrite=true" in error_of(capsys)
    assert (run_dir / "metrics.jsonl").read_text() == records and (run_dir / "config.yaml").read_text() == config
    assert main(["train", *changed, "run.overwrite=true"]) == 0
    assert steps_of(run_dir) == [0, 1]


def test_paths_that_are_files_are_refused(small_run, tmp_path, capsys):
    _, overrides = small_run
    a_file = tmp_path / "file"
    a_file.write_text("mine\n")
    base = [o for o in overrides if not o.startswith("run.dir=")]
    assert main(["train", *base, f"run.dir={a_file}"]) == 2
    assert "is a file, not a directory" in error_of(capsys)
    assert main(["train", *base, f"run.dir={tmp_path / 'r'}", f"checkpoint.dir={a_file}"]) == 2
    assert "checkpoint.dir" in error_of(capsys)
    assert a_file.read_text() == "mine\n"
    assert not (tmp_path / "r").exists()  # the failed start left no empty run directory


@pytest.mark.skipif(os.geteuid() == 0, reason="root may write into read-only directories")
def test_a_read_only_run_dir_is_refused(small_run, tmp_path, capsys):
    _, overrides = small_run
    locked = tmp_path / "locked"
    locked.mkdir()
    locked.chmod(0o500)
    base = [o for o in overrides if not o.startswith("run.dir=")]
    assert main(["train", *base, f"run.dir={locked}"]) == 2
    assert "cannot be written" in error_of(capsys)


def test_nan_learning_rate_is_refused(capsys):
    assert main(["train", "optim.lr=nan"]) == 2
    assert "optim.lr=nan must be a positive, finite number" in error_of(capsys)


def test_export_refuses_a_yaml_or_directory_out_and_follows_the_umask(small_run, tmp_path, capsys):
    run_dir, _ = small_run
    ckpt = str(run_dir / "checkpoints")
    assert main(["checkpoint", "export", ckpt, "--out", str(tmp_path / "model.yaml")]) == 2
    assert "would be overwritten by the config" in error_of(capsys)
    assert not (tmp_path / "model.yaml").exists()
    assert main(["checkpoint", "export", ckpt, "--out", str(tmp_path)]) == 2
    assert "is a directory" in error_of(capsys)
    old = os.umask(0o022)
    try:
        assert main(["checkpoint", "export", ckpt, "--out", str(tmp_path / "m.safetensors")]) == 0
    finally:
        os.umask(old)
    for name in ("m.safetensors", "m.yaml"):
        assert stat.S_IMODE((tmp_path / name).stat().st_mode) == 0o644


def test_export_refuses_a_corrupt_checkpoint_and_a_failed_read(small_run, tmp_path, capsys, monkeypatch):
    run_dir, _ = copy_small_run(small_run, tmp_path)
    step = run_dir / "checkpoints" / "step_000004"
    out = str(tmp_path / "m.safetensors")

    def failing_load(*args, **kwargs):
        raise CheckpointException("read failed", {})

    monkeypatch.setattr("optimus.checkpoint_export.dcp.load", failing_load)
    assert main(["checkpoint", "export", str(step), "--out", out]) == 2
    assert "cannot be read" in error_of(capsys)
    monkeypatch.undo()
    flip_middle(step / "__0_0.distcp")
    assert main(["checkpoint", "export", str(step), "--out", out]) == 2
    assert "does not match the checksum" in error_of(capsys)


def test_a_failed_read_during_resume_falls_back(small_run, tmp_path, caplog, monkeypatch):
    """DCP's CheckpointException is a BaseException: it must still count as one unloadable checkpoint."""
    import torch.distributed.checkpoint as dcp

    run_dir, overrides = copy_small_run(small_run, tmp_path)
    real_load, calls = dcp.load, []

    def load_failing_once(*args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            raise CheckpointException("read failed", {})
        return real_load(*args, **kwargs)

    monkeypatch.setattr(dcp, "load", load_failing_once)
    with caplog.at_level(logging.WARNING, logger="optimus.checkpoint"):
        assert main(["train", *overrides]) == 0
    assert "step_000004 cannot be loaded" in caplog.text and "step_000002 (step 2;" in caplog.text


def test_memory_that_cannot_fit_is_refused_before_the_run(small_run, tmp_path, capsys):
    from optimus.platform import detect_platform
    from optimus.run_spec import resolve_run
    from optimus.train.memory_check import check_cpu_memory

    def run(cfg):
        return resolve_run(cfg, 1, detect_platform(cfg.machine, 0))

    _, overrides = small_run
    spec = run(load_config(overrides))
    check_cpu_memory(spec, 1, available=2**40)  # fits in a TiB
    with pytest.raises(ConfigError, match="lower train.micro_batch or train.seq_len"):
        check_cpu_memory(spec, 1, available=2**20)
    check_cpu_memory(run(load_config([])), 1, available=8 * 2**30)  # the default run fits a small laptop
    with pytest.raises(ConfigError, match="GiB of memory is available"):  # the case: killed by the kernel
        check_cpu_memory(run(load_config(["train.seq_len=200000"])), 1, available=64 * 2**30)
    base = [o for o in overrides if not o.startswith("run.dir=")]
    assert main(["train", *base, f"run.dir={tmp_path / 'big'}", "train.seq_len=10000000"]) == 2
    assert "GiB of memory is available" in error_of(capsys)
    assert not (tmp_path / "big").exists()


def test_unknown_keys_with_plus_are_refused():
    for override in ("+train.stepz=3", "+foo=1", "+model.moe.topk=1"):
        with pytest.raises(ConfigError, match="Unknown config key"):
            load_config([override])
    assert load_config(["data=tokens", "data.mix=[{path: a, weight: 1}]"]).data.mix[0]["path"] == "a"


# ---- what a run directory holds before a run (issue 55) -----------------------------------------------------


@pytest.mark.parametrize(
    "files",
    [
        ("run_info.json", "config.yaml"),  # the issue's: a project directory with a config of the user's own
        ("checkpoints/latest",),  # a checkpoint directory's pointer without a checkpoint
    ],
)
def test_files_a_run_writes_without_its_metrics_are_refused_unless_overwritten(small_run, tmp_path, capsys, files):
    """Every run writes metrics.jsonl first: without it, files a run would write are someone else's, and the run
    refuses to overwrite them unless run.overwrite=true asks."""
    _, overrides = small_run
    proj = tmp_path / "proj"
    for name in files:
        (proj / name).parent.mkdir(parents=True, exist_ok=True)
        (proj / name).write_text("the user's own\n")
    base = [o for o in overrides if not o.startswith("run.dir=")] + [f"run.dir={proj}", "train.steps=1"]
    with unchanged(tmp_path):
        assert main(["train", *base]) == 2
    err = error_of(capsys)
    named = ", ".join(str(proj / name) if "/" in name else name for name in files)
    assert len(err.splitlines()) == 1 and f"run.dir={proj} holds {named}, which a run would overwrite" in err
    assert "but no metrics.jsonl" in err and "run.overwrite=true to replace them" in err
    assert main(["train", *base, "run.overwrite=true"]) == 0
    assert steps_of(proj) == [0, 1] and "the user's own" not in (proj / files[0]).read_text()


def test_a_run_that_died_before_its_first_step_runs_again(small_run, tmp_path):
    """It left config.yaml and run_info.json beside an empty metrics.jsonl (written first): no run to keep."""
    _, overrides = small_run
    proj = tmp_path / "proj"
    proj.mkdir()
    for name, text in (("metrics.jsonl", ""), ("config.yaml", "model: {}\n"), ("run_info.json", "{}\n")):
        (proj / name).write_text(text)
    base = [o for o in overrides if not o.startswith("run.dir=")] + [f"run.dir={proj}", "train.steps=1"]
    assert main(["train", *base]) == 0
    assert steps_of(proj) == [0, 1] and json.loads((proj / "run_info.json").read_text())["params"]
