"""`optimus report` on hand-written run directories whose answers are known, and its refusals."""

from __future__ import annotations

import csv
import json
import math

import pytest
import yaml
from omegaconf import OmegaConf

from optimus.cli import main
from optimus.config import OptimusConfig
from optimus.report import ReportError, build_report
from tests.unchanged import unchanged

SEQ_LEN = 100


def make_run(root, name, world, ep, global_batch, step_times, *, timers=None, config=None, device="Test GPU",
             peak=1e12, flops_per_token=1e6, legacy=False, device_type="cuda", per_rank=()):  # fmt: skip
    """A run directory as `optimus train` writes it (metrics.jsonl starting with the step-0 evaluation);
    `legacy` logs tokens_per_s only (no step_time_s)."""
    run = root / name
    run.mkdir()
    cfg = OmegaConf.to_container(OmegaConf.structured(OptimusConfig()))
    cfg["train"].update(global_batch=global_batch, seq_len=SEQ_LEN)
    cfg["parallel"].update(nproc=world, ep=ep)
    cfg["run"]["dir"] = str(run)
    for key, value in (config or {}).items():
        section, field = key.split(".")
        cfg[section][field] = value
    (run / "config.yaml").write_text(yaml.safe_dump(cfg))
    tokens = global_batch * SEQ_LEN
    info = {
        "flops_per_token": flops_per_token,
        "layout": {"world": world, "dp": world, "ep": ep, "edp": world // ep, "accum": 1},
        "device": {"type": device_type, "name": device, "backend": "nccl", "peak_flops": peak},
        "kernels": "torch",
        "tokens_per_step": tokens,
        "per_rank": list(per_rank),
    }
    (run / "run_info.json").write_text(json.dumps(info))
    lines = [json.dumps({"step": 0, "tokens": 0, "val_loss": 5.0})]
    for step, t in enumerate(step_times, start=1):
        record = {"step": step, "loss": 1.0, "tokens": step * tokens, "tokens_per_s": tokens / t}
        if not legacy:
            record["step_time_s"] = t
        record.update(timers[step - 1] if timers else {})
        lines.append(json.dumps(record))
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")
    return run


def test_single_run_arithmetic(tmp_path):
    # Step 1 (10 s) is warm-up; measured: 1, 2, 3, 4 s of 10 x 100 = 1000 tokens each.
    run = make_run(tmp_path, "a", 1, 1, 10, [10.0, 1.0, 2.0, 3.0, 4.0], peak=1e9)
    (row,) = build_report([run], tmp_path / "out", mode="strong", warmup_steps=1)
    assert row["steps_measured"] == 4
    assert row["tokens_per_s"] == pytest.approx(4000 / 10)
    assert row["tokens_per_s_per_device"] == pytest.approx(400)
    assert row["tflops_per_device"] == pytest.approx(400 * 1e6 / 1e12)
    assert row["mfu"] == pytest.approx(400 * 1e6 / 1e9)
    assert row["step_time_mean_s"] == pytest.approx(2.5)
    assert row["step_time_std_s"] == pytest.approx(math.sqrt(5 / 3))  # sample std of 1, 2, 3, 4
    assert row["step_time_p50_s"] == pytest.approx(2.5)
    assert row["step_time_p90_s"] == pytest.approx(3.7)  # 3 + 0.7 x (4 - 3)
    assert row["efficiency"] == pytest.approx(1.0) and row["breakdown_s"] == {}


def test_strong_scaling_efficiency(tmp_path):
    base = make_run(tmp_path, "n1", 1, 1, 16, [9.0, 2.0, 2.0, 2.0])
    two = make_run(tmp_path, "n2", 2, 2, 16, [9.0, 1.25, 1.25, 1.25])
    four = make_run(tmp_path, "n4", 4, 2, 16, [9.0, 0.8, 0.8, 0.8], legacy=True)  # from tokens_per_s
    rows = build_report([four, base, two], tmp_path / "out", warmup_steps=1)  # auto: equal global batch -> strong
    assert [r["devices"] for r in rows] == [1, 2, 4]
    assert [r["speedup"] for r in rows] == pytest.approx([1.0, 2.0 / 1.25, 2.0 / 0.8])
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 2.0 / (1.25 * 2), 2.0 / (0.8 * 4)])
    assert json.loads((tmp_path / "out" / "report.json").read_text())["mode"] == "strong"


def test_weak_scaling_efficiency_and_outputs(tmp_path):
    phases = {"time_forward_s": 0.5, "time_dispatch_comm_s": 0.25, "time_backward_s": 1.0}
    base = make_run(tmp_path, "n1", 1, 1, 8, [5.0, 2.0, 2.0], timers=[phases] * 3)
    two = make_run(tmp_path, "n2", 2, 2, 16, [5.0, 2.5, 2.5], timers=[phases] * 3)
    rows = build_report([base, two], tmp_path / "out", warmup_steps=1)  # auto: growing batch -> weak
    # tokens/s per device: 800 / 2 s = 400 and 1600 / 2.5 s / 2 = 320.
    assert [r["tokens_per_s_per_device"] for r in rows] == pytest.approx([400, 320])
    assert [r["efficiency"] for r in rows] == pytest.approx([1.0, 0.8])
    assert rows[1]["breakdown_s"] == pytest.approx(
        {"forward": 0.5, "dispatch_comm": 0.25, "backward": 1.0, "other": 2.5 - 1.75}
    )
    out = tmp_path / "out"
    for name in ("report.md", "report.csv", "report.json", "efficiency.png", "throughput.png", "breakdown.png"):
        assert (out / name).stat().st_size > 0, name
    table = list(csv.DictReader(open(out / "report.csv")))
    assert [float(r["efficiency"]) for r in table] == pytest.approx([1.0, 0.8])
    assert float(table[1]["time_other_s"]) == pytest.approx(0.75)
    assert "Weak scaling" in (out / "report.md").read_text()


def test_layout_names_pipeline_and_tensor_parallelism(tmp_path):
    """pp and tp appear in the tables and the CSV as run_info.json gives them; runs without them count as 1."""
    base = make_run(tmp_path, "n1", 1, 1, 8, [5.0, 2.0, 2.0])
    split = make_run(tmp_path, "n8", 8, 2, 64, [5.0, 2.0, 2.0])
    info = json.loads((split / "run_info.json").read_text())
    info["layout"].update(pp=2, tp=2, dp=2, edp=2)  # 8 = pp 2 x dp 2 x tp 2; experts: edp 2 x ep 2 per stage
    (split / "run_info.json").write_text(json.dumps(info))
    rows = build_report([base, split], tmp_path / "out", warmup_steps=1)
    assert [(r["pp"], r["tp"], r["dp"], r["ep"], r["edp"]) for r in rows] == [(1, 1, 1, 1, 1), (2, 2, 2, 2, 2)]
    table = list(csv.DictReader(open(tmp_path / "out" / "report.csv")))
    assert [(r["pp"], r["tp"], r["edp"]) for r in table] == [("1", "1", "1"), ("2", "2", "2")]
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| 8 | pp2 tp2 dp2 ep2 |" in report and "| 1 | dp1 ep1 |" in report


def test_dp_is_the_data_parallel_degree_also_in_runs_written_before_edp(tmp_path):
    """Before run_info.json named `edp`, its `dp` held the expert-data-parallel degree world / (pp x ep); the
    report gives every run optimus plan's dp, world / (pp x tp), and the edp beside it."""
    from optimus.plan import make_plan
    from optimus.recipes import load_config

    old = make_run(tmp_path, "old", 4, 2, 16, [1.0, 1.0, 1.0])
    info = json.loads((old / "run_info.json").read_text())
    info["layout"] = {"world": 4, "dp": 2, "ep": 2, "accum": 1}  # as optimus train wrote it then
    (old / "run_info.json").write_text(json.dumps(info))
    (row,) = build_report([old], tmp_path / "out", warmup_steps=1)
    plan = make_plan(load_config(["parallel.ep=2", "train.micro_batch=2"]), 4)
    assert (row["dp"], row["edp"]) == (plan.dp, plan.edp) == (4, 2)


def test_runs_may_differ_in_ignored_and_allowed_keys(tmp_path):
    a = make_run(
        tmp_path, "a", 2, 1, 16, [1.0, 1.0, 1.0], config={"logging.wandb": True, "parallel.dispatcher": "allgather"}
    )
    b = make_run(tmp_path, "b", 2, 2, 16, [1.0, 1.0, 1.0], config={"checkpoint.keep": 7, "profile.timers": True})
    assert len(build_report([a, b], tmp_path / "out", mode="strong")) == 2


@pytest.mark.parametrize(
    "mode,other,words",
    [
        ("strong", dict(global_batch=32), "train.global_batch"),
        ("weak", dict(global_batch=32, config={"model.dim": 512}), "model.dim"),
        ("weak", dict(global_batch=64), "batches per device"),
        ("strong", dict(config={"optim.sharding": "standard"}), "optim.sharding"),
        ("strong", dict(device="Other GPU"), "device.name"),
    ],
)
def test_mismatched_runs_are_refused(tmp_path, mode, other, words):
    a = make_run(tmp_path, "a", 1, 1, 16, [1.0, 1.0, 1.0])
    kwargs = {"global_batch": 16 if mode == "strong" else 32, **other}
    b = make_run(tmp_path, "b", 2, 2, kwargs.pop("global_batch"), [1.0, 1.0, 1.0], **kwargs)
    with pytest.raises(ReportError, match=words) as err:
        build_report([a, b], tmp_path / "out", mode=mode)
    message = str(err.value)
    assert str(a) in message and str(b) in message and message.count(". ") == 0  # one sentence


def test_cli_errors_are_one_line(tmp_path, capsys):
    a = make_run(tmp_path, "a", 1, 1, 16, [1.0, 1.0])
    (tmp_path / "empty").mkdir()
    assert main(["report", str(a), str(tmp_path / "empty"), "--out", str(tmp_path / "out")]) == 2
    assert "has no config.yaml" in capsys.readouterr().err
    assert main(["report", str(a), "--out", str(tmp_path / "out"), "--warmup-steps", "2"]) == 2
    assert "none is left after --warmup-steps 2" in capsys.readouterr().err
    assert main(["report", str(a), "--out", str(tmp_path / "out"), "--warmup-steps", "1"]) == 0


@pytest.mark.parametrize(
    "damage, words",
    [
        (lambda run: (run / "config.yaml").write_text("train: [unclosed"), "config.yaml is not valid YAML"),
        (lambda run: (run / "config.yaml").write_text("- a list\n"), "does not hold a config mapping"),
        (lambda run: (run / "run_info.json").write_text("[1, 2]"), "not a JSON object"),
        (lambda run: (run / "run_info.json").write_text('{"layout": {}}'), "has no number at layout.world"),
        (lambda run: (run / "metrics.jsonl").write_text('{"step": 1}\n'), "line 1 is not a step record"),
        (lambda run: (run / "metrics.jsonl").write_text("3\n"), "line 1 is not a step record"),
    ],
)
def test_a_malformed_run_directory_is_one_sentence(tmp_path, capsys, damage, words):
    run = make_run(tmp_path, "a", 1, 1, 16, [1.0, 1.0, 1.0])
    damage(run)
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 2
    err = capsys.readouterr().err
    assert words in err and "Traceback" not in err


def _edit_step_2(run, **fields):
    """Set fields of the record of step 2, line 3 of metrics.jsonl (after the step-0 evaluation and step 1)."""
    lines = (run / "metrics.jsonl").read_text().splitlines()
    lines[2] = json.dumps({**json.loads(lines[2]), **fields})
    (run / "metrics.jsonl").write_text("\n".join(lines) + "\n")


def _edit_info(run, section, **fields):
    info = json.loads((run / "run_info.json").read_text())
    (info[section] if section else info).update(fields)
    (run / "run_info.json").write_text(json.dumps(info))


NAN = float("nan")  # json.dumps writes it as NaN, which json.loads reads back


@pytest.mark.parametrize(
    "damage, where",
    [
        (lambda run: _edit_step_2(run, step_time_s=0), "metrics.jsonl line 3 has step_time_s=0,"),
        (lambda run: _edit_step_2(run, step_time_s=-1.5), "metrics.jsonl line 3 has step_time_s=-1.5,"),
        (lambda run: _edit_step_2(run, step_time_s="fast"), "metrics.jsonl line 3 has step_time_s='fast',"),
        (lambda run: _edit_step_2(run, step_time_s=NAN), "metrics.jsonl line 3 has step_time_s=nan,"),
        (lambda run: _edit_step_2(run, step_time_s=None, tokens_per_s=-5), "line 3 has tokens_per_s=-5,"),
        (lambda run: _edit_step_2(run, time_forward_s="x"), "metrics.jsonl line 3 has time_forward_s='x',"),
        (lambda run: _edit_step_2(run, step=-2), "metrics.jsonl line 3 has step=-2,"),
        (lambda run: _edit_info(run, "layout", world=0), "run_info.json has layout.world=0,"),
        (lambda run: _edit_info(run, "layout", pp=0), "run_info.json has layout.pp=0,"),
        (lambda run: _edit_info(run, "layout", pp="two"), "run_info.json has layout.pp='two',"),
        (lambda run: _edit_info(run, "layout", world=NAN), "run_info.json has layout.world=nan,"),
        (lambda run: _edit_info(run, "layout", world=4, tp=3), "run_info.json has layout.world=4, which pp x tp"),
        (lambda run: _edit_info(run, None, tokens_per_step=-100), "run_info.json has tokens_per_step=-100,"),
        (lambda run: _edit_info(run, "device", peak_flops=-1), "run_info.json has device.peak_flops=-1,"),
        (lambda run: _edit_info(run, None, per_rank=cpu_ranks(1, "many")), "run_info.json has per_rank[0]="),
        (lambda run: (run / "config.yaml").write_text("train: {global_batch: 0}\n"), "config.yaml has train.global"),
    ],
)
def test_a_damaged_number_is_one_sentence_naming_file_line_and_field(tmp_path, capsys, damage, where):
    """Numbers a user edited or a disk damaged: each used to be a ZeroDivisionError, a ValueError from float()
    or matplotlib, or a report with negative tokens/s."""
    run = make_run(tmp_path, "a", 2, 2, 16, [1.0, 1.0, 1.0], device_type="cpu", per_rank=cpu_ranks(2, 1, "0-3"))
    damage(run)
    with unchanged(tmp_path):
        assert main(["report", str(run), "--out", str(tmp_path / "out"), "--warmup-steps", "0"]) == 2
    err = capsys.readouterr().err
    assert where in err and err.count("\n") == 1 and "rerun" in err


def test_a_run_given_twice_is_reported_once(tmp_path, capsys):
    one = make_run(tmp_path, "one", 1, 1, 16, [1.0, 2.0, 2.0])
    two = make_run(tmp_path, "two", 2, 2, 16, [1.0, 1.0, 1.0])
    again = tmp_path / "two" / ".." / "two"
    assert main(["report", str(one), str(two), str(again), "--out", str(tmp_path / "out"), "--warmup-steps", "1"]) == 0
    assert f"{again} is the run {two} given again: it is reported once." in capsys.readouterr().out
    runs = json.loads((tmp_path / "out" / "report.json").read_text())["runs"]
    assert [r["path"] for r in runs] == [str(one), str(two)] and runs[1]["efficiency"] == pytest.approx(1.0)


def test_an_out_that_is_a_file_is_one_sentence(tmp_path, capsys):
    run = make_run(tmp_path, "a", 1, 1, 16, [1.0, 1.0, 1.0])
    (tmp_path / "out").write_text("")
    assert main(["report", str(run), "--out", str(tmp_path / "out")]) == 2
    assert "choose another --out" in capsys.readouterr().err


def test_an_earlier_report_is_replaced_only_with_overwrite(tmp_path, capsys):
    timed = make_run(tmp_path, "timed", 1, 1, 16, [1.0, 1.0, 1.0], timers=[{"time_forward_s": 0.5}] * 3)
    plain = make_run(tmp_path, "plain", 1, 1, 16, [1.0, 1.0, 1.0])
    out = tmp_path / "out"
    assert main(["report", str(timed), "--out", str(out)]) == 0
    (out / "notes.txt").write_text("the user's own file")
    capsys.readouterr()
    with unchanged(tmp_path):
        assert main(["report", str(plain), "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert "already holds a report (report.md" in err and "--overwrite" in err and "Traceback" not in err

    assert main(["report", str(plain), "--out", str(out), "--overwrite"]) == 0
    assert str(plain) in (out / "report.md").read_text() and str(timed) not in (out / "report.md").read_text()
    names = sorted(p.name for p in out.iterdir())  # the old breakdown.png goes with the report it belonged to
    assert names == ["efficiency.png", "notes.txt", "report.csv", "report.json", "report.md", "throughput.png"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["out", "plain", "timed"]  # no temporary left


def cpu_ranks(n: int, threads: int, cpus: str = "0-1", host: str = "box") -> list[dict]:
    return [{"host": host, "cpus": cpus, "threads": threads} for _ in range(n)]


def test_a_cpu_run_whose_ranks_shared_cores_gets_no_efficiency(tmp_path, capsys):
    """On 2 cores: one rank with 2 threads and 2 ranks with 1 each fit; 4 ranks with 1 each share cores. The
    4-rank run would show 125% efficiency; the report says instead that its ranks shared cores."""
    kwargs = dict(device_type="cpu", device="Test CPU")
    one = make_run(tmp_path, "n1", 1, 1, 16, [9.0, 2.0, 2.0], per_rank=cpu_ranks(1, 2), **kwargs)
    two = make_run(tmp_path, "n2", 2, 1, 16, [9.0, 1.25, 1.25], per_rank=cpu_ranks(2, 1), **kwargs)
    four = make_run(tmp_path, "n4", 4, 1, 16, [9.0, 0.4, 0.4], per_rank=cpu_ranks(4, 1), **kwargs)
    assert main(["report", str(one), str(two), str(four), "--out", str(tmp_path / "out"), "--warmup-steps", "1"]) == 0
    rows = json.loads((tmp_path / "out" / "report.json").read_text())["runs"]
    assert [r["efficiency"] for r in rows[:2]] == pytest.approx([1.0, 2.0 / (1.25 * 2)])
    assert rows[2]["efficiency"] is None and rows[2]["speedup"] is None
    assert rows[2]["shared_cores"] == "its 4 ranks ran 4 threads on the 2 cores of box"
    out = capsys.readouterr().out
    assert "Ranks shared cores: n4: its 4 ranks ran 4 threads on the 2 cores of box" in out
    report = (tmp_path / "out" / "report.md").read_text()
    assert "| shared cores |" in report and "- Ranks shared cores: n4:" in report and "125.0%" not in report
    assert [r["efficiency"] for r in csv.DictReader(open(tmp_path / "out" / "report.csv"))][2] == ""


def test_a_base_run_that_shared_cores_gives_no_efficiency_to_any(tmp_path):
    crowded = make_run(tmp_path, "n1", 1, 1, 16, [9.0, 2.0, 2.0], device_type="cpu", per_rank=cpu_ranks(1, 4))
    two = make_run(tmp_path, "n2", 2, 1, 16, [9.0, 1.0, 1.0], device_type="cpu", per_rank=cpu_ranks(2, 1))
    rows = build_report([crowded, two], tmp_path / "out", warmup_steps=1)
    assert [r["efficiency"] for r in rows] == [None, None] and rows[1]["shared_cores"] is None
    assert "| - (base shared cores) |" in (tmp_path / "out" / "report.md").read_text()


@pytest.mark.parametrize(
    "device_type, per_rank",
    [
        ("cpu", cpu_ranks(1, 2, "0-3") + cpu_ranks(1, 2, "4-7")),  # pinned to their own cores
        ("cpu", cpu_ranks(2, 4, "0-7", "a") + cpu_ranks(2, 4, "0-7", "b")),  # two hosts of 8 cores
        ("cuda", cpu_ranks(2, 64, "0-7")),  # a GPU run's CPU threads mostly wait
        ("cpu", []),  # written before run_info.json recorded cores and threads
    ],
)
def test_ranks_that_fit_their_cores_are_not_flagged(tmp_path, device_type, per_rank):
    base = make_run(tmp_path, "n1", 1, 1, 16, [9.0, 2.0, 2.0], device_type=device_type, per_rank=per_rank[:1])
    run = make_run(tmp_path, "n2", len(per_rank) or 2, 1, 16, [9.0, 1.0, 1.0], device_type=device_type,
                   per_rank=per_rank)  # fmt: skip
    rows = build_report([base, run], tmp_path / "out", warmup_steps=1)
    assert [r["shared_cores"] for r in rows] == [None, None] and rows[1]["efficiency"] is not None


def test_predict_leaves_out_only_the_run_it_cannot_predict(tmp_path, capsys, monkeypatch):
    """A run the performance model refuses (here a two-stage pipeline, by a stand-in for the dry run's check of
    what it can trace: every parallel layout of this version can be traced) beside one it can: the report keeps
    the other's prediction and says in one line why this one has none, where it used to refuse the whole
    report."""
    import optimus.dry_run
    from optimus.config import ConfigError
    from optimus.recipes import load_config
    from tests.conftest import TINY_MODEL

    def refuse_pipelines(cfg, what="A dry run"):
        if cfg.parallel.pp > 1:
            raise ConfigError(f"{what} cannot trace parallel.pp={cfg.parallel.pp} here: set parallel.pp=1.")

    monkeypatch.setattr(optimus.dry_run, "check_dry_run_config", refuse_pipelines)
    common = ["machine=frontier", *TINY_MODEL, "model.n_layers=4", "train.seq_len=32", "train.global_batch=16",
              "train.micro_batch=2", "parallel.ep=4"]  # fmt: skip
    for name, world, layout in (("n4", 4, []), ("n8", 8, ["parallel.pp=2"])):
        run = make_run(tmp_path, name, world, 4, 16, [0.5] * 4)
        cfg = load_config([*common, *layout, f"parallel.nproc={world}"])
        (run / "config.yaml").write_text(yaml.safe_dump(OmegaConf.to_container(OmegaConf.structured(cfg))))
    out = tmp_path / "out"
    assert main(["report", str(tmp_path / "n4"), str(tmp_path / "n8"), "--out", str(out), "--predict"]) == 0
    lines = [line for line in capsys.readouterr().out.splitlines() if "no prediction" in line]
    assert len(lines) == 1 and lines[0].startswith("no prediction for n8: --predict ")  # predict's own sentence
    base, refused = json.loads((out / "report.json").read_text())["runs"]
    assert base["predicted_step_s"] > 0 and base["predicted_efficiency"] == pytest.approx(1.0)
    assert refused["predicted_step_s"] is refused["predicted_error"] is refused["predicted_efficiency"] is None
    assert f"- No prediction for n8: {lines[0].split(': ', 1)[1]}" in (out / "report.md").read_text()
