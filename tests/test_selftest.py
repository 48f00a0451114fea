"""`optimus selftest` and `optimus plan --calibrate` on this CPU: correct kernels pass and their files say what was
measured; a kernel made wrong on purpose (torch backend, and Triton under the interpreter) is named and fails the
command; two gloo processes check and time the collectives; the user's errors are one line."""

from __future__ import annotations

import contextlib
import io
import json
import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
from omegaconf import OmegaConf

from optimus.cli import main
from optimus.config import MachineConfig, MachinePerfConfig, OptimusConfig
from optimus.config_checks import validate_machine_and_data
from optimus.errors import ConfigError
from optimus.kernels import torch_backend
from optimus.parallel import collective_check
from optimus.recipes import load_config
from optimus.selftest import collectives, kernels
from optimus.selftest import report as selftest_report
from optimus.selftest.kernels import kernel_cases
from tests.distributed import run_distributed
from tests.unchanged import unchanged

# A small MoE in fp32 (on a CPU the torch backend's 16-bit products take per-expert kernels instead of
# grouped_mm, which the broken-kernel tests break): 64 tokens, top-2 of 4 experts, 128 rows.
SMALL = ["model.dim=32", "model.moe.n_experts=4", "model.moe.expert_dim=48", "train.micro_batch=1",
         "train.seq_len=64", "train.dtype=fp32"]  # fmt: skip
KERNELS = {
    "permute forward", "permute backward", "expert_swiglu_mlp forward", "expert_swiglu_mlp dgrad",
    "expert_swiglu_mlp wgrad w13", "expert_swiglu_mlp wgrad w2", "combine forward", "combine backward dy",
    "combine backward dw", "grouped_mm forward", "grouped_mm dgrad", "grouped_mm wgrad", "rms_norm forward",
    "rms_norm dgrad", "rms_norm wgrad", "rope forward", "rope backward", "count_ids",
}  # fmt: skip
CASES = {"recipe", "one row", "empty experts", "ragged tiles", "rows on one expert"}
FP32_CPU_TOLERANCE = 1e-5  # optimus/kernels/check.py's rule: matrix products in IEEE fp32
MEASURED = {"gemm_efficiency", "memory_bandwidth_gbs", "kernel_floor_us"}  # by one process


def run(*argv: str) -> tuple[int, str, str]:
    """optimus <argv> in this process: (exit code, stdout, stderr)."""
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = main(list(argv))
    return code, out.getvalue(), err.getvalue()


def measured_keys(machine_yaml: str, command: str) -> set[str]:
    """The keys machine.yaml says `command` measured."""
    return set(re.findall(rf"^\s*(\w+): \S+  # measured by {re.escape(command)} on ", machine_yaml, re.M))


def loaded_machine(path: Path) -> MachineConfig:
    """machine.yaml read as a recipe is (the schema refuses an unknown key) and validated as a config's."""
    merged = OmegaConf.merge(OmegaConf.structured(MachineConfig), OmegaConf.load(path))
    cfg = OptimusConfig(machine=OmegaConf.to_object(merged))
    validate_machine_and_data(cfg)
    return cfg.machine


def drop_last_row_of_each_tile(fn, tile=16):
    """fn, with the last row of every `tile` rows of its output zeroed (a tile loop that stops one row short)."""

    def wrong(*args):
        out = fn(*args)
        keep = torch.ones(out.shape[0], 1, dtype=out.dtype)
        keep[tile - 1 :: tile] = 0
        return out * keep

    return wrong


@pytest.fixture(scope="module")
def selftest_dir(tmp_path_factory):
    """One selftest of the torch backend at SMALL's shapes, its --out and its printed table."""
    out = tmp_path_factory.mktemp("selftest") / "out"
    code, table, err = run("selftest", "--kernels", "torch", "--out", str(out), *SMALL)
    assert code == 0, err
    return out, table


def test_a_correct_backend_passes_and_every_result_is_written(selftest_dir):
    out, table = selftest_dir
    assert sorted(p.name for p in out.iterdir()) == ["machine.yaml", "selftest.json"]
    report = json.loads((out / "selftest.json").read_text())
    assert report["ok"] and report["failures"] == []
    rows = report["kernels"]["results"]
    assert {row["kernel"] for row in rows} == KERNELS and {row["case"] for row in rows} == CASES
    assert len(rows) == len(KERNELS) * len(CASES)  # every kernel on every case: none skipped on a 2-core CPU
    for row in rows:
        want = 0.0 if row["kernel"] == "count_ids" else FP32_CPU_TOLERANCE
        assert row["ok"] and row["dtype"] in ("float32", "int64") and row["tolerance"] == want
        assert 0 <= row["error"] <= row["tolerance"], row
    rates = report["rates"]
    assert rates["gemm_shape"] == [64, 32, 3 * 48]  # [micro_batch x seq_len, dim] x [dim, 3 x expert_dim]
    assert rates["gemm_dtype"] == "fp32" and rates["gemm_flops_per_s"] > 0 and rates["peak_source"] == "cpu-probe"
    assert rates["gemm_fraction_of_peak"] == pytest.approx(rates["gemm_flops_per_s"] / rates["peak_flops"])
    assert rates["memory_bandwidth_bytes_per_s"] > 0 and 0 < rates["kernel_floor_s"] < 1e-3
    assert "none measured: one process" in report["collectives"]["none"]
    assert report["versions"]["torch"] == torch.__version__ and report["device"]["type"] == "cpu"
    for line in ("kernels: torch backend in fp32", "grouped_mm wgrad", "GEMM fp32 [64, 32] x [32, 144]",
                 "collectives: none measured", "optimus selftest: passed"):  # fmt: skip
        assert line in table, table


def test_machine_yaml_is_a_recipe_of_the_measured_numbers(selftest_dir):
    out, _ = selftest_dir
    report = json.loads((out / "selftest.json").read_text())
    text = (out / "machine.yaml").read_text()
    assert text.startswith("# @package machine\n")
    assert measured_keys(text, "optimus selftest") == MEASURED
    machine = loaded_machine(out / "machine.yaml")
    rates = report["rates"]
    four_digits = lambda x: float(f"{x:.4g}")  # noqa: E731
    assert machine.perf.gemm_efficiency == four_digits(min(1.0, rates["gemm_fraction_of_peak"]))
    assert machine.perf.memory_bandwidth_gbs == four_digits(rates["memory_bandwidth_bytes_per_s"] / 1e9)
    assert machine.perf.kernel_floor_us == four_digits(rates["kernel_floor_s"] * 1e6)
    # fp32 products on a CPU: the probed fp32 peak is the model's fp32 peak, and its bf16 peak is probed too (the
    # model's peak_flops); machine=local's name would make the model measure on the spot instead of reading these
    assert machine.perf.peak_flops_fp32 == four_digits(rates["peak_flops"])
    assert machine.peak_flops == four_digits(rates["bf16_peak"]["flops_per_s"]) > 0
    assert machine.name == "calibrated" and machine.device == "cpu" and machine.ranks_per_node == 1
    assert machine.perf.node_gbs is None and machine.perf.node_latency_us is None  # one process: no link
    # each measured number's range (for --predict's interval): +-10% around it, at most 1 for a fraction
    for key in ("gemm_efficiency", "memory_bandwidth_gbs", "kernel_floor_us"):
        value = getattr(machine.perf, key)
        high = min(1.1 * value, 1.0) if key == "gemm_efficiency" else 1.1 * value
        assert machine.perf.ranges[key] == pytest.approx([0.9 * value, high], rel=1e-3), key


@pytest.mark.parametrize("fault", ["a tile's last row dropped", "a transposed weight"])
def test_a_broken_torch_kernel_fails_the_selftest_and_is_named(fault, monkeypatch, tmp_path):
    real = torch_backend.grouped_mm
    if fault == "a transposed weight":  # read with the strides of its transpose: same shape, wrong values
        monkeypatch.setattr(torch_backend, "grouped_mm", lambda x, w, bounds: real(x, w.mT.reshape(w.shape), bounds))
    else:
        monkeypatch.setattr(torch_backend, "grouped_mm", drop_last_row_of_each_tile(real))
    code, table, err = run("selftest", "--kernels", "torch", "--out", str(tmp_path / "out"), *SMALL)
    assert code == 1
    report = json.loads((tmp_path / "out" / "selftest.json").read_text())
    failed = {row["kernel"] for row in report["kernels"]["results"] if not row["ok"]}
    # the expert MLP's and the grouped GEMM's products go through grouped_mm; permute and combine do not
    assert {"grouped_mm forward", "expert_swiglu_mlp forward"} <= failed
    assert not any(kernel.startswith(("permute", "combine", "count_ids")) for kernel in failed)
    lines = err.strip().splitlines()
    assert lines == [f"optimus selftest: {sentence}" for sentence in report["failures"]]
    assert any(line.startswith("optimus selftest: the torch kernel grouped_mm forward in float32 at recipe: 128 rows")
               for line in lines)  # fmt: skip
    assert all("relative to the reference (tolerance 1.0e-05); use kernels=triton" in line for line in lines)
    assert "optimus selftest: FAILED" in table and "FAILED" in table.split("grouped_mm forward")[1].splitlines()[0]


@pytest.mark.skipif(os.environ.get("TRITON_INTERPRET") != "1", reason="the Triton interpreter (no GPU here)")
def test_a_broken_triton_kernel_fails_the_selftest_and_is_named(monkeypatch):
    pytest.importorskip("triton")
    from optimus.kernels import triton_kernels

    monkeypatch.setattr(triton_kernels, "grouped_gemm", drop_last_row_of_each_tile(triton_kernels.grouped_gemm))
    # fp32 only (the interpreter computes bf16 dots wrongly), at tiny widths (it runs each program in Python)
    tiny = ["model.dim=24", "model.n_heads=4", "model.n_kv_heads=2", "model.moe.n_experts=4",
            "model.moe.expert_dim=40", "train.micro_batch=1", "train.seq_len=16", "train.dtype=fp32"]  # fmt: skip
    code, table, err = run("selftest", "--kernels", "triton", *tiny)
    assert code == 1
    lines = err.strip().splitlines()
    failed = {line.split(" in float32")[0].removeprefix("optimus selftest: the triton kernel ") for line in lines}
    # the grouped GEMM's kernel serves grouped_mm (its dgrad on the weight's transposed view) and the expert MLP's
    # down projection; permute and combine have kernels of their own
    assert {"grouped_mm forward", "expert_swiglu_mlp forward"} <= failed
    assert not any(kernel.startswith(("permute", "combine", "count_ids")) for kernel in failed)
    assert all(line.endswith("use kernels=torch.") for line in lines) and "kernels: triton backend in fp32" in table


def test_a_case_that_would_not_fit_a_quarter_of_the_free_memory_is_skipped_and_said(monkeypatch):
    cases = {case.name: case for case in kernel_cases(load_config(SMALL))}
    # a quarter of the free memory holds the one-row case and not the recipe's 128 rows
    monkeypatch.setattr(kernels, "free_bytes", lambda device: 4 * kernels.case_bytes(cases["one row"], torch.float32))
    checked = kernels.check_kernels("torch", list(cases.values()), torch.float32, torch.device("cpu"))
    ran = {row["case"] for row in checked["results"]}
    assert "one row" in ran and "recipe" not in ran and "rows on one expert" not in ran
    assert {skip["case"].split(":")[0] for skip in checked["skipped"]} == CASES - ran
    lines = selftest_report._kernel_lines({**checked, "setting": "torch", "dtype": "fp32", "none": None}, 1)
    assert any(line.startswith("  skipped recipe: 128 rows x 32 -> 48, 4 experts (needs about") for line in lines)


def test_a_case_that_runs_out_of_memory_anyway_is_skipped_and_said(monkeypatch):
    cases = {case.name: case for case in kernel_cases(load_config(SMALL))}
    real = kernels.check_backend

    def out_of_memory_at_the_recipes_shape(backend, checked, *args):
        if checked[0].name == "recipe":
            raise torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 2.00 GiB")
        return real(backend, checked, *args)

    monkeypatch.setattr(kernels, "check_backend", out_of_memory_at_the_recipes_shape)
    checked = kernels.check_kernels("torch", list(cases.values()), torch.float32, torch.device("cpu"))
    assert {row["case"] for row in checked["results"]} == CASES - {"recipe"}
    assert [skip["case"].split(":")[0] for skip in checked["skipped"]] == ["recipe"]
    lines = selftest_report._kernel_lines({**checked, "setting": "torch", "dtype": "fp32", "none": None}, 1)
    skipped = "  skipped recipe: 128 rows x 32 -> 48, 4 experts (ran out of memory: needs about"
    assert any(line.startswith(skipped) for line in lines)


def test_a_dense_model_has_no_expert_kernels_to_check():
    code, table, err = run("selftest", "--kernels", "torch", *SMALL, "model.moe.n_experts=0")
    assert code == 0, err
    assert "kernels: none: a dense model" in table
    assert "GEMM fp32 [64, 32] x [32, 1024]" in table  # the dense FFN's width (model.ffn_dim of the tiny recipe)


def test_two_processes_check_and_time_every_collective_on_gloo(tmp_path):
    out = tmp_path / "out"
    done = subprocess.run(
        [sys.executable, "-m", "optimus", "selftest", "--nproc", "2", "--kernels", "torch", "--out", str(out), *SMALL],
        capture_output=True, text=True, timeout=300,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    report = json.loads((out / "selftest.json").read_text())
    assert {row["rank"] for row in report["kernels"]["results"]} == {0, 1}  # each process checks its device
    c = report["collectives"]
    assert (c["backend"], c["group"], c["processes"]) == ("gloo", "WORLD", 2)
    assert [kind["name"] for kind in c["kinds"]] == [k.name for k in collectives.KINDS]
    # nccl-tests' bus bandwidth for 2 ranks: an all-reduce's link carries the whole buffer, a send too, the others
    # half of it
    factor = {"all_reduce": 1.0, "send/recv": 1.0}
    for kind in c["kinds"]:
        assert kind["ok"] and kind["failures"] == [] and len(kind["seconds"]) == len(c["sizes_bytes"]) == 3
        want = [factor.get(kind["name"], 0.5) * size / t / 1e9 for size, t in zip(c["sizes_bytes"], kind["seconds"])]
        assert kind["bus_gbs"] == pytest.approx(want)
        assert kind["latency_us"] == pytest.approx(kind["seconds"][0] * 1e6)
    all_reduce = c["kinds"][0]["seconds"]
    machine = loaded_machine(out / "machine.yaml")
    # optimus.perf.costs prices a 2-rank all-reduce of S bytes as S / bandwidth + 2 latencies
    assert machine.perf.node_latency_us == float(f"{all_reduce[0] / 2 * 1e6:.4g}")
    small, large = c["sizes_bytes"][0], c["sizes_bytes"][-1]
    if all_reduce[-1] > all_reduce[0]:  # the bandwidth that adds the time the larger size took
        bandwidth = (large - small) / (all_reduce[-1] - all_reduce[0]) / 1e9
    else:  # noise: the larger no slower than the smaller
        bandwidth = large / all_reduce[-1] / 1e9
    assert machine.perf.node_gbs == float(f"{bandwidth:.4g}") and machine.ranks_per_node == 2
    # the ranks' wake-up cost and variability (optimus.perf.rank_sync), written where the fit is above 0
    sync = c["sync"]
    assert sync["sync_cost_s"] >= 0 and sync["rank_variability"] >= 0
    fitted = {"sync_cost_us": sync["sync_cost_s"] > 0, "rank_variability": 0 < sync["rank_variability"] < 0.99}
    assert measured_keys((out / "machine.yaml").read_text(), "optimus selftest") == MEASURED | {
        "node_gbs",
        "node_latency_us",
    } | {key for key, written in fitted.items() if written}
    assert machine.perf.sync_cost_us == (float(f"{sync['sync_cost_s'] * 1e6:.4g}") if fitted["sync_cost_us"] else None)
    assert "collectives: gloo, WORLD group of 2 processes, fp32" in done.stdout


def test_a_collective_that_computes_wrong_values_is_named_and_not_timed(monkeypatch):
    store = dist.HashStore()
    dist.init_process_group("gloo", store=store, rank=0, world_size=1)
    try:
        wrong = collectives.Kind("all_to_all with uneven splits", lambda *a: False,
                                 collective_check._USE_ALLGATHER, collectives._all_to_all, lambda n: 0.5)  # fmt: skip
        monkeypatch.setattr(collectives, "KINDS", (collectives.KINDS[0], wrong))
        result = collectives.run_collectives(torch.device("cpu"), torch.bfloat16)
    finally:
        dist.destroy_process_group()
    all_reduce, all_to_all = result["kinds"]
    assert all_reduce["ok"] and len(all_reduce["seconds"]) == 3
    assert not all_to_all["ok"] and all_to_all["seconds"] == [] and all_to_all["bus_gbs"] == []
    assert all_to_all["failures"] == [
        f"all_to_all with uneven splits in {dtype} over the WORLD group returned wrong values on the gloo backend; "
        "use parallel.dispatcher=allgather (an all-gather and a reduce-scatter instead of the all-to-all)."
        for dtype in ("bfloat16", "float32")
    ]


def test_plan_calibrate_writes_the_same_machine_yaml_and_replaces_only_its_own(selftest_dir, tmp_path):
    out = tmp_path / "out"
    out.mkdir()
    (out / "machine.yaml").write_text("# an earlier calibration\n")
    with unchanged(out):
        code, _, err = run("plan", "--calibrate", "--out", str(out), *SMALL)
    assert code == 2 and "already exists" in err and "--overwrite" in err and len(err.strip().splitlines()) == 1
    code, table, err = run("plan", "--calibrate", "--out", str(out), "--overwrite", *SMALL)
    assert code == 0, err
    assert sorted(p.name for p in out.iterdir()) == ["machine.yaml", "operators.json"] and "kernels:" not in table
    calibrated = (out / "machine.yaml").read_text()
    from_selftest = (selftest_dir[0] / "machine.yaml").read_text()
    measured = measured_keys(from_selftest, "optimus selftest") | {"operator_times"}  # the step's, timed
    assert measured_keys(calibrated, "optimus plan --calibrate") == measured
    key_lines = lambda text: [line.split(":")[0] for line in text.splitlines() if not line.startswith("#")]  # noqa: E731
    assert key_lines(calibrated) == key_lines(from_selftest)
    assert loaded_machine(out / "machine.yaml").perf.gemm_efficiency > 0
    # One process measures no link, and one rank needs none: the file predicts a world of one.
    layout = ["--world", "1", *SMALL, "train.global_batch=1", "machine.memory_gb=64"]
    code, printed, err = run("plan", "--predict", "--json", *layout, f"machine.calibration={out / 'machine.yaml'}")
    assert code == 0, err
    low, high = json.loads(printed)["step_time_s_range"]
    assert low < json.loads(printed)["step_time_s"] < high  # the timed operators' +-10% among the ranges


def test_a_calibration_round_trip_predicts_with_its_numbers(tmp_path):
    """`optimus plan --calibrate` on two gloo processes, then `--predict machine.calibration=DIR/machine.yaml`: the
    prediction runs on the file's numbers (the measured link, the ranks' wake-up cost and variability where
    measured) with their ranges, its point inside its interval, and a machine.* override still wins."""
    out = tmp_path / "cal"
    code, table, err = run("plan", "--calibrate", "--out", str(out), "--nproc", "2", *SMALL)
    assert code == 0, err
    text = (out / "machine.yaml").read_text()
    assert {"node_gbs", "node_latency_us"} <= measured_keys(text, "optimus plan --calibrate")
    machine = loaded_machine(out / "machine.yaml")
    layout = ["--world", "2", *SMALL, "train.global_batch=4", f"machine.calibration={out / 'machine.yaml'}"]
    code, printed, err = run("plan", "--predict", "--json", *layout, "machine.memory_gb=64")
    assert code == 0, err
    prediction = json.loads(printed)
    numbers = prediction["machine_numbers"]
    assert prediction["machine"] == "calibrated" and numbers["ranks_per_node"] == 2
    assert numbers["node"]["bandwidth"] == pytest.approx(machine.perf.node_gbs * 1e9)
    assert numbers["gemm_efficiency"] == machine.perf.gemm_efficiency
    assert numbers["sync_cost"] == pytest.approx((machine.perf.sync_cost_us or 0) * 1e-6)
    assert numbers["rank_variability"] == (machine.perf.rank_variability or 0)
    assert prediction["device_bytes"] == 64 * 2**30  # the command line's override, after the file's null
    low, high = prediction["step_time_s_range"]
    assert low < prediction["step_time_s"] < high  # the measured numbers' +-10% ranges
    # The step's operators, timed by the calibration, price this step's (the same but for the global batch).
    timed = json.loads((out / "operators.json").read_text())
    assert timed["measured"]["distinct"] >= len(timed["seconds"]) >= 0.9 * timed["measured"]["distinct"]
    matched, distinct = map(int, re.match(r"(\d+) of the (\d+) distinct", numbers["sources"]["priced"]).groups())
    assert matched >= 0.9 * distinct
    # Every timed operator twice as long: the compute grows by what the timed operators gave it, at most doubling.
    doubled = tmp_path / "doubled.json"
    doubled.write_text(json.dumps({**timed, "seconds": {sig: 2 * s for sig, s in timed["seconds"].items()}}))
    code, printed, err = run("plan", "--predict", "--json", *layout, f"machine.perf.operator_times={doubled}")
    assert code == 0, err
    compute, compute_doubled = prediction["time_split"]["compute"], json.loads(printed)["time_split"]["compute"]
    assert 1.5 * compute < compute_doubled <= 2 * compute * (1 + 1e-9)


def test_a_step_no_dry_run_traces_is_calibrated_without_its_operators(tmp_path):
    """A capacity limit's drops depend on values, so no dry run traces that step: the rates are calibrated, and
    one line says why no operator was timed."""
    out = tmp_path / "cal"
    code, _, err = run("plan", "--calibrate", "--out", str(out), *SMALL, "model.moe.capacity_factor=1.25")
    assert code == 0, err
    assert err.strip().splitlines() == [
        "optimus plan --calibrate: no operators timed: --calibrate traces dropless routing only (which tokens a "
        "capacity limit drops depends on values): set model.moe.capacity_factor=null."
    ]
    assert [p.name for p in out.iterdir()] == ["machine.yaml"]
    assert loaded_machine(out / "machine.yaml").perf.operator_times is None


def test_a_calibration_file_that_is_not_there_is_one_line(tmp_path):
    code, _, err = run("plan", "model=tiny", f"machine.calibration={tmp_path / 'machine.yaml'}")
    assert code == 2 and len(err.strip().splitlines()) == 1
    assert f"machine.calibration={tmp_path / 'machine.yaml'} is not a file: run `optimus plan --calibrate" in err


@pytest.mark.parametrize(
    "args, message",
    [
        (["selftest", "--kernels", "cuda"], "--kernels cuda is not a kernel backend: use one of auto, torch, triton."),
        (["selftest", "--device", "gpu"], "--device gpu: name cpu, cuda or xpu"),
        (["selftest", "model.moe.top_kk=2"], "Unknown config key 'model.moe.top_kk'"),
        (["selftest", "--device", "cpu", "--nproc", "0"], "--nproc 0 must be at least 1."),
        (["plan", "--calibrate", *SMALL], "--calibrate writes DIR/machine.yaml: name the directory with --out DIR."),
        (["plan", "--calibrate", "--json", "--out", "x"], "--calibrate measures this node and writes DIR/machine.yaml"),
        (["plan", "--calibrate", "--world", "0", "--out", "x"], "--world 0 must be at least 1."),
        (["plan", "--calibrate", "--out", "x", "model=tiny", "parallel.tp=2"],
         "(--calibrate times the operators of the recipe's step, by default at this node's 1 processes: name the "
         "layout's size with --nodes N or --world N)."),
        (["plan", "--dry-run", "--calibrate"], "--calibrate measures this node"),
        (["plan", "--nproc", "2"], "--nproc belongs to `optimus plan --calibrate`"),
    ],
)  # fmt: skip
def test_user_errors_are_one_line_before_any_work(args, message, tmp_path, monkeypatch):
    def work(*args, **kwargs):
        raise AssertionError("the work started before the refusal")

    monkeypatch.setattr("optimus.commands.selftest.selftest_rank", work)
    monkeypatch.chdir(tmp_path)
    code, _, err = run(*args)
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def _rank_1_of_2(monkeypatch) -> None:
    from optimus.ranks import RankInfo

    info = RankInfo(rank=1, local_rank=1, world_size=2, local_world_size=2, master_addr="127.0.0.1", master_port=1,
                    launcher="torchrun")  # fmt: skip
    monkeypatch.setattr("optimus.ranks.discover", lambda: info)
    monkeypatch.setattr("optimus.commands.selftest.discover", lambda: info)


def test_under_a_launcher_only_rank_0_traces_and_the_others_refuse_a_layout_as_it_would(tmp_path, monkeypatch):
    # A node's processes started by a launcher: rank 1 neither traces the step (rank 0 sends it the operators,
    # below) nor waits for a rank 0 that refused the layout: it says the same sentence.
    def trace(*args, **kwargs):
        raise AssertionError("rank 1 traced the step")

    _rank_1_of_2(monkeypatch)
    monkeypatch.setattr("optimus.commands.plan._step_operators", trace)
    monkeypatch.chdir(tmp_path)
    code, _, err = run("plan", "--calibrate", "--out", "x", "model=tiny", "parallel.tp=4")
    assert code == 2 and len(err.strip().splitlines()) == 1, err
    assert "parallel.tp=4 does not divide" in err and "by default at this node's 2 processes" in err


def _operators_each_rank_times() -> tuple:
    from optimus.commands.selftest import Job, with_operators_of_rank0

    mine = (("sig-a", "sig-b"), "the step") if dist.get_rank() == 0 else ((), None)
    job = Job(load_config([]), None, None, "fp32", signatures=mine[0], step=mine[1])
    shared = with_operators_of_rank0(job)
    return shared.signatures, shared.step


def test_rank_0s_operators_reach_every_rank():
    assert run_distributed(_operators_each_rank_times, 2) == [(("sig-a", "sig-b"), "the step")] * 2


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_a_device_this_node_lacks_is_one_line():
    code, _, err = run("selftest", "--device", "cuda")
    assert code == 2 and err.strip() == (
        "optimus: error: --device cuda: torch sees no cuda device here: use --device cpu, or leave it out."
    )


def test_an_earlier_selftest_is_replaced_only_with_overwrite(selftest_dir):
    out, _ = selftest_dir
    with unchanged(out):
        code, _, err = run("selftest", "--out", str(out), *SMALL)
        assert code == 2 and "already exists: choose another --out, or pass --overwrite" in err
        code, _, err = run("plan", "--calibrate", "--overwrite", "--out", str(out), *SMALL)
        assert code == 2 and "holds files that a calibration's output is not made of (selftest.json)" in err


def test_a_loaded_machines_measured_variability_stays_a_number_the_checks_take():
    """A rank's variability fitted on cores that other work shares may come out near or above a whole step: its
    range stops below 1 (the machine checks refuse 1 and above), and a fit at or above that cap is not written."""
    from optimus.config_checks import _check_perf_range
    from optimus.selftest.report import _collective_values, _range_lines

    line = _range_lines({}, {"perf.rank_variability": (0.95, "a fit", True)}, "here")[1]
    low, high = (float(b) for b in re.search(r"\[(.*), (.*)\]", line).groups())
    assert (low, high) == (pytest.approx(0.855), 0.99)
    _check_perf_range(MachinePerfConfig(rank_variability=0.95), "rank_variability", [low, high])
    with pytest.raises(ConfigError, match="keep it below 1"):
        _check_perf_range(MachinePerfConfig(rank_variability=0.95), "rank_variability", [low, 1.045])
    # a fit between the cap and 1: no range below the cap holds it, so it is not written
    collectives = {"processes": 2, "backend": "gloo", "sync": {"sync_cost_s": 0.0, "rank_variability": 0.995}}
    assert "perf.rank_variability" not in _collective_values(collectives)
    collectives["sync"]["rank_variability"] = 0.5
    assert _collective_values(collectives)["perf.rank_variability"][0] == 0.5
