"""`optimus plan --predict` end to end: the JSON it prints, its time split, its scaling efficiencies, its
refusals, and the ordering of the layouts measured on this machine (benchmarks/results/predict_local.json)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from optimus.cli import main
from optimus.perf.machine import MachineModel
from optimus.perf.predict import prediction_of, trace_step
from optimus.plan import make_plan
from optimus.recipes import load_config
from tests.conftest import TINY_MODEL

REPO = Path(__file__).resolve().parents[2]
SMALL = [*TINY_MODEL, "train.seq_len=32", "train.global_batch=8", "train.micro_batch=2"]


def predict_json(capsys, *args: str) -> dict:
    assert main(["plan", "--predict", "--json", *args]) == 0
    return json.loads(capsys.readouterr().out)


def test_pipeline_prediction_on_this_machine(capsys):
    # Two pipeline stages on two local ranks: the machine measured here, the 1F1B order checked against the
    # traced ranks' actions, and a split whose parts add up to the step.
    out = predict_json(capsys, "--world", "2", *SMALL, "parallel.nproc=2", "parallel.pp=2")
    assert out["machine"] == "local" and out["world"] == 2
    assert out["traced_ranks"] == [0, 1]
    assert sum(out["time_split"].values()) == pytest.approx(out["step_time_s"], rel=1e-9)
    assert out["time_split"]["pipeline_bubble"] > 0
    assert out["tokens_per_s"] == pytest.approx(8 * 32 / out["step_time_s"])
    assert 0 < out["mfu"] < 1


def test_scaling_across_node_counts(capsys):
    # frontier's machine model at 1 and 2 nodes (8 and 16 ranks, ep 4): strong scaling keeps the batch,
    # weak scaling doubles it; the efficiencies follow from the step times as their definitions say.
    args = ["--nodes", "1,2", "machine=frontier", *SMALL, "train.global_batch=32", "parallel.ep=4"]
    out = predict_json(capsys, *args)
    one, two = out["scaling"]
    assert (one["world"], two["world"]) == (8, 16)
    assert two["weak"]["global_batch"] == 64 and two["strong"]["global_batch"] == 32
    t1, t2s, t2w = one["strong"]["step_time_s"], two["strong"]["step_time_s"], two["weak"]["step_time_s"]
    assert two["strong_efficiency"] == pytest.approx(t1 * 8 / (t2s * 16))
    assert two["weak_efficiency"] == pytest.approx(t1 / t2w)
    assert one["strong_efficiency"] == one["weak_efficiency"] == pytest.approx(1.0)
    assert out["step_time_s"] == t1
    # Each efficiency's range: its values with frontier at the fast and at the slow corner of its ranges at both
    # sizes, and at the recipe's numbers.
    for kind, base, other in [("strong", one["strong"], two["strong"]), ("weak", one["strong"], two["weak"])]:
        (b_fast, b_slow), (fast, slow) = base["corner_steps"], other["corner_steps"]
        worlds = 8 / 16 if kind == "strong" else 1.0  # weak: the batch doubles with the world
        ends = [worlds * b_fast / fast, worlds * b_slow / slow]
        ends.append(two[f"{kind}_efficiency"])
        assert two[f"{kind}_efficiency_range"] == pytest.approx([min(ends), max(ends)])
    # The data-parallel reductions cross the network at 2 nodes: more exposed data-parallel time per step.
    assert two["weak"]["time_split"].get("exposed_data_parallel", 0) > one["weak"]["time_split"].get(
        "exposed_data_parallel", 0
    )


def test_both_utilisation_conventions(capsys):
    # MFU counts the model's FLOPs; HFU adds the forward the backward runs again (recompute_flops_per_token, checked
    # against torch's FLOP counter in tests/train/test_activation_checkpointing.py). Same step, same denominators.
    from optimus.model import count_params_of_config, flops_per_token
    from optimus.parallel.activation_checkpointing import recompute_flops_per_token

    base = ["--world", "8", "machine=frontier", *SMALL, "train.global_batch=16", "parallel.ep=4"]
    plain = predict_json(capsys, *base)
    assert plain["hfu"] == plain["mfu"] and plain["hfu_range"] == plain["mfu_range"]
    full = predict_json(capsys, *base, "train.activation_checkpointing=full")
    cfg = load_config([*SMALL, "train.activation_checkpointing=full"])
    model = flops_per_token(count_params_of_config(cfg.model), cfg.model, 32)
    ratio = 1 + recompute_flops_per_token(cfg.model, "full", 32) / model
    assert ratio > 1.2
    assert full["hfu"] == pytest.approx(full["mfu"] * ratio)
    assert full["hfu_range"] == pytest.approx([m * ratio for m in full["mfu_range"]])
    assert main(["plan", "--predict", *base, "train.activation_checkpointing=full"]) == 0
    text = capsys.readouterr().out
    assert f"HFU {100 * full['hfu']:.1f}% adds the forward that activation checkpointing runs again" in text
    assert "MFU" in text and "counts the model's FLOPs" in text


def test_gradient_buckets_on_the_machine(capsys):
    # ZeRO-2 buckets of 64 KiB on frontier's links are latency-bound; at the size the prediction names, every group
    # is bandwidth-bound or reduces its gradients in one bucket (then there is nothing to advise). ZeRO-1 reduces in
    # the optimizer step: no buckets.
    base = ["--world", "8", "machine=frontier", *SMALL, "train.global_batch=16", "parallel.ep=4"]
    small = predict_json(capsys, *base, "optim.zero=2", "optim.bucket_mb=0.0625")["buckets"]
    assert small["bucket_mb"] == 0.0625 and small["latency_share"] > 0.1
    assert small["advised_mb"] > 0.0625 and small["advised_share"] < small["latency_share"]
    advised = predict_json(capsys, *base, "optim.zero=2", f"optim.bucket_mb={small['advised_mb']}")["buckets"]
    assert advised is None or advised["latency_share"] <= 0.1
    assert predict_json(capsys, *base, "optim.zero=1")["buckets"] is None
    assert main(["plan", "--predict", *base, "optim.zero=2", "optim.bucket_mb=0.0625"]) == 0
    assert f"optim.bucket_mb={small['advised_mb']} would take it to" in capsys.readouterr().out
    # optim.max_collective_numel at 64 KiB of bf16 parameters caps any bucket there: nothing larger is advised.
    capped = predict_json(capsys, *base, "optim.zero=2", "optim.bucket_mb=0.0625", "optim.max_collective_numel=32768")
    assert capped["buckets"]["cap_mb"] == 0.0625 and capped["buckets"]["advised_mb"] is None


@pytest.mark.parametrize(
    "args, words",
    [
        (["plan", "--predict", "--nodes", "1", "machine=nvidia"], "peak_flops"),
        (["plan", "--nodes", "1,2"], "needs --predict"),
        (["plan", "--predict", "--world", "2", "model.moe.capacity_factor=1.25"], "model.moe.capacity_factor=null"),
    ],
)  # fmt: skip
def test_refusals(capsys, args, words):
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and words in err


def test_a_layout_that_does_not_fit_is_said_first_and_predicted_all_the_same(capsys):
    # The all-gather dispatcher (traced: the rows its experts select come from the load model) on a device
    # smaller than optimus plan's peak: that comes first (before the dry runs' progress on stderr with --json),
    # the JSON holds the verdict, the peak and the limit, the step is predicted, and the command exits 1.
    layout = ["machine=frontier", *SMALL, "parallel.ep=2", "parallel.dispatcher=allgather", "machine.memory_gb=0.001"]
    assert main(["plan", "--predict", "--json", "--world", "2", *layout]) == 1
    captured = capsys.readouterr()
    out = json.loads(captured.out)
    assert captured.err.startswith("DOES NOT FIT: world 2, global batch 8: optimus plan puts the busiest rank at")
    peak = make_plan(load_config([*layout, "parallel.nproc=2"]), 2).memory["total_configured"]
    assert (out["fits"], out["peak_bytes"], out["device_bytes"]) == (False, peak, round(0.001 * 2**30))
    assert sum(out["time_split"].values()) == pytest.approx(out["step_time_s"], rel=1e-9)
    # in the text, the first line
    assert main(["plan", "--predict", "--world", "1", *layout[:-3], "machine.memory_gb=0.001"]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].startswith("DOES NOT FIT: world 1") and lines[-4].startswith("predicted step on frontier")
    assert lines[-1].startswith("  interval, low - likely - high (machine.perf.ranges at both ends, and the point)")


def test_predictions_order_the_measured_layouts():
    # Replayed at each run's routing imbalance on the machine numbers measured with them, each operator priced
    # by their roofline (the operator times taken there are not kept; timing them again here would make the
    # replay depend on this machine), the predictions order every two layouts whose measured step times
    # differ by more than a quarter as the measurements do.
    results = json.loads((REPO / "benchmarks" / "results" / "predict_local.json").read_text())
    chosen = ("1 process", "1 process, 2 micro-batches", "2 processes, ep 2")  # one, two micro-batches, EP
    rows = [r for r in results["repeats"][-1] if r["layout"] in chosen]  # the last repeat's runs
    predicted = {}
    for row in rows:
        cfg = load_config([f"parallel.nproc={row['nproc']}", *row["overrides"]])
        traces = trace_step(cfg, row["nproc"], row["imbalance"], progress="none")
        predicted[row["layout"]] = prediction_of(
            cfg, row["nproc"], MachineModel.from_dict({**row["machine_numbers"], "op_threads": 0}), traces
        )
    pairs = 0
    for a in rows:
        for b in rows:
            if a["measured_s"] > 1.25 * b["measured_s"]:
                pairs += 1
                assert predicted[a["layout"]].step_time_s > predicted[b["layout"]].step_time_s, (a, b)
    assert pairs >= 2


def test_report_puts_the_prediction_beside_each_run(tmp_path):
    # Two runs of one recipe on frontier's model (8 and 16 ranks, strong scaling): the report's predicted step
    # is the model's for each run's own config, and its predicted efficiency the report's formula on them.
    import yaml
    from omegaconf import OmegaConf

    from optimus.perf.predict import predict
    from optimus.report import build_report
    from tests.report.test_report import make_run

    overrides = ["machine=frontier", *SMALL, "train.global_batch=32", "parallel.ep=4"]
    runs = []
    for world, step in ((8, 0.5), (16, 0.3)):
        run = make_run(tmp_path, f"n{world}", world, 4, 32, [step] * 4)
        cfg = load_config([*overrides, f"parallel.nproc={world}"])
        (run / "config.yaml").write_text(yaml.safe_dump(OmegaConf.to_container(OmegaConf.structured(cfg))))
        runs.append((run, cfg, world, step))
    rows = build_report([r[0] for r in runs], tmp_path / "report", warmup_steps=1, predict=True)
    predictions = [predict(cfg, world, progress="none") for _, cfg, world, _ in runs]
    expected = [p.step_time_s for p in predictions]
    assert [r["predicted_step_s"] for r in rows] == pytest.approx(expected)
    for row, prediction in zip(rows, predictions):  # frontier's ranges: each run's interval beside its point
        assert row["predicted_step_s_range"] == pytest.approx(prediction.step_time_s_range)
    assert rows[1]["predicted_error"] == pytest.approx(0.3 / expected[1] - 1)
    assert rows[1]["predicted_efficiency"] == pytest.approx(expected[0] * 8 / (expected[1] * 16))
    report = (tmp_path / "report" / "report.md").read_text()
    low, high = (1e3 * s for s in rows[1]["predicted_step_s_range"])
    assert "predicted step ms (interval)" in report and f"{1e3 * expected[1]:.1f} ({low:.1f}-{high:.1f})" in report


def test_stage_costs_are_the_traced_actions_own():
    # Two stages of one MoE layer each (the first with the embedding, the last with the head and loss): every
    # stage's forward and backward, composed from its parts, costs what its traced actions cost replayed alone
    # (to rounding: a part of a kind costs the mean of the traced layers of that kind, which differ by an op).
    from collections import defaultdict

    from optimus.perf.predict import stage_costs
    from optimus.perf.replay import Stream, split_actions
    from tests.perf.test_replay import machine

    cfg = load_config([*SMALL, "parallel.nproc=2", "parallel.pp=2"])
    traces = trace_step(cfg, 2, progress="none")
    costs = stage_costs(cfg, machine(), traces)
    traced = defaultdict(list)
    for result in traces.values():
        for action in split_actions(result["events"])[1]:
            traced[(action.type, action.stage)].append(Stream(machine(), result["rank"]).run(action.events, True).t)
    assert set(traced) == {("F", 0), ("B", 0), ("F", 1), ("B", 1)}
    for key, times in traced.items():
        assert costs[key][0] == pytest.approx(sum(times) / len(times), rel=1e-3), key
    assert costs[("F", 1)][0] > costs[("F", 0)][0]  # the head's matmul and loss
