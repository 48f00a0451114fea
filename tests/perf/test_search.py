"""`optimus plan --search`: the layouts it enumerates, what it drops, the descent's answer against a brute force
over every layout, the keys it holds fixed, and the winner's overrides predicted again through the command line."""

from __future__ import annotations

import itertools
import json
import threading
import time

import pytest

from optimus.cli import main
from optimus.config import ConfigError
from optimus.config_checks import validate
from optimus.job_scripts import check_groups_in_node
from optimus.perf.machine import machine_model
from optimus.perf.predict import check_predictable
from optimus.perf.search import (
    AXES,
    STRUCTURE,
    Search,
    SearchResult,
    Visit,
    axis_values,
    fixed_keys,
    format_search,
    values_of,
    with_values,
)
from optimus.plan import make_plan
from optimus.recipes import load_config
from tests.conftest import TINY_MODEL

# frontier's machine model (8 ranks per node) on one node, the tiny model with 8 experts.
ARGS = ["machine=frontier", *TINY_MODEL, "train.seq_len=32", "train.global_batch=16", "train.micro_batch=1"]
WORLD = 8


def formula_step(cfg) -> float:
    """A step time that each axis moves on its own (a stand-in for the prediction): the brute force's answer is the
    descent's to find."""
    p, o, t = cfg.parallel, cfg.optim, cfg.train
    return (
        1.0 + 0.3 * abs(p.pp - 2) + (0.05 if p.pp_schedule == "interleaved_1f1b" else 0.0) + 0.2 * abs(p.tp - 2)
        + 0.1 * abs(p.ep - 4) + 0.07 * t.micro_batch + (0.0 if o.zero == 2 else 0.04)
        + (0.0 if o.shard_ranks is None else 0.02) + (0.03 if o.overlap_param_gather else 0.0)
        + 0.001 * o.bucket_mb + (0.0 if p.dispatcher == "alltoall" else 0.06) + 0.01 * p.ep_overlap_chunks
        + {"none": 0.0, "selective": 0.5, "full": 1.0}[t.activation_checkpointing]
        + (0.0 if o.sharding == "ep_aware" else 0.01)
    )  # fmt: skip


def fake_prediction(cfg) -> dict:
    step = formula_step(cfg)
    return {"step_time_s": step, "mfu": 0.1 / step, "time_split": {"compute": step}, "step_time_s_range": None}


def search_of(args: list[str], fixed: set[str] = frozenset()) -> Search:
    cfg = load_config(args)
    return Search(cfg, WORLD, machine_model(cfg.machine, WORLD), set(fixed), predict_fn=fake_prediction)


def every_layout(search: Search) -> list[dict]:
    """Every combination of every axis's values (each axis's values from the recipe's layout and from each
    pipeline and tp: the axes whose values depend on them), the valid ones planned."""
    cfg = search.cfg
    values = {axis: [] for axis in AXES}
    for pp_values in axis_values("pipeline", cfg, WORLD):
        for tp_values in axis_values("tp", cfg, WORLD):
            here = with_values(cfg, {**pp_values, **tp_values})
            for axis in AXES:
                for v in axis_values(axis, here, WORLD):
                    if v not in values[axis]:
                        values[axis].append(v)
    layouts = []
    for combo in itertools.product(*values.values()):
        layout = {}
        for v in combo:
            layout.update(v)
        layouts.append(layout)
    return layouts


def test_the_descent_finds_the_brute_forces_fastest_layout():
    search = search_of(ARGS)
    result = search.run(verify=0)
    best = result.ranked()[0]
    # The brute force: every combination planned (the same fit rule), the formula's fastest that fits.
    fitting = [v for v in map(search.planned, every_layout(search)) if v.status in ("fits", "predicted")]
    brute = min(formula_step(with_values(search.cfg, v.values)) for v in fitting)
    assert best.step == pytest.approx(brute)
    assert best.values["parallel.pp"] == 2 and best.values["parallel.tp"] == 2 and best.values["parallel.ep"] == 4
    assert best.values["train.activation_checkpointing"] == "none"
    # Fewer layouts predicted than the brute force planned: the descent's point.
    assert 0 < len(result.ranked()) < len(fitting)


def test_layouts_that_do_not_fit_are_dropped_with_their_peak_and_the_least_checkpointing_that_fits_is_taken():
    # A device of 1.13 MiB: the planner's peaks of the tiny model's layouts (0.6-2.1 MiB) lie on both sides of it.
    search = search_of([*ARGS, "machine.memory_gb=0.0011"])
    result = search.run(verify=0)
    device = 0.0011 * 2**30
    dropped = [v for v in result.visits if v.status == "dropped"]
    assert dropped and result.ranked()
    for visit in dropped:
        assert visit.peak_bytes > device
        # dropped with every checkpointing mode: the last tried, full, over the device too
        assert make_plan(with_values(search.cfg, visit.values), WORLD).memory["total_configured"] > device
    for visit in result.ranked():
        cfg = with_values(search.cfg, visit.values)
        assert make_plan(cfg, WORLD).memory["total_configured"] <= device
        lighter = {"none": [], "selective": ["none"], "full": ["none", "selective"]}
        for mode in lighter[visit.values["train.activation_checkpointing"]]:  # a lighter mode does not fit
            lighter_cfg = with_values(cfg, {"train.activation_checkpointing": mode})
            assert make_plan(lighter_cfg, WORLD).memory["total_configured"] > device


def test_keys_given_on_the_command_line_stay_fixed():
    command_line = ["parallel.tp=1", "+optim.zero=1", "train.activation_checkpointing=full", "experiment=x"]
    fixed = fixed_keys(command_line)
    assert fixed == {"parallel.tp", "optim.zero", "train.activation_checkpointing"}
    search = search_of([*ARGS, "parallel.tp=1", "optim.zero=1", "train.activation_checkpointing=full"], fixed)
    result = search.run(verify=0)
    for visit in result.visits:
        assert visit.values["parallel.tp"] == 1 and visit.values["optim.zero"] == 1
        assert visit.values["train.activation_checkpointing"] == "full"
    assert result.ranked()[0].values["parallel.ep"] == 4  # the free axes still move


def test_a_fixed_key_leaves_its_axis_the_values_that_keep_it():
    """parallel.pp=1 on a recipe with an interleaved schedule: the pipeline axis still sets the schedule (1F1B, one
    stage per rank), so the layouts divide; parallel.pp=2 fixed keeps its three schedules."""
    interleaved = ["parallel.pp_schedule=interleaved_1f1b", "parallel.pp_virtual=2"]
    one = search_of([*ARGS, *interleaved, "parallel.pp=1"], {"parallel.pp"}).run(verify=0)
    assert one.ranked() and {v.values["parallel.pp_schedule"] for v in one.visits if v.status != "invalid"} == {"1f1b"}
    assert all(v.values["parallel.pp"] == 1 for v in one.visits)
    two = search_of([*ARGS, *interleaved, "parallel.pp=2"], {"parallel.pp"}).run(verify=0)
    schedules = {(v.values["parallel.pp_schedule"], v.values["parallel.pp_virtual"]) for v in two.visits}
    assert schedules == {("1f1b", 1), ("interleaved_1f1b", 2), ("interleaved_zb", 2)} and all(
        v.values["parallel.pp"] == 2 for v in two.visits
    )


def test_bucket_sizes_are_tried_where_the_step_has_buckets():
    # ZeRO-1 reduces and gathers in the step, whatever optim.bucket_mb says, unless its gathers overlap the next
    # forward (optim.memory.zero_bucket_bytes).
    cfg = load_config(ARGS)
    assert axis_values("bucket", with_values(cfg, {"optim.zero": 1}), WORLD) == [{"optim.bucket_mb": 32.0}]
    for bucketed in ({"optim.zero": 2}, {"optim.zero": 1, "optim.overlap_param_gather": True}):
        values = axis_values("bucket", with_values(cfg, bucketed), WORLD)
        assert [v["optim.bucket_mb"] for v in values] == [32.0, 128.0, 512.0]


def advising_prediction(cfg) -> dict:
    """fake_prediction with a bucket term that is least at 64 MiB, and, under ZeRO-2, the advice of 64 MiB that a
    prediction gives for the machine's links (optimus.perf.buckets.BucketAdvice)."""
    out = fake_prediction(cfg)
    mb = cfg.optim.bucket_mb
    step = out["step_time_s"] - 0.001 * mb + 0.01 * abs(mb - 64.0) / 64.0
    advice = {"bucket_mb": mb, "group_size": 2, "latency_share": 0.3, "advised_mb": 64, "advised_share": 0.08}
    return {**out, "step_time_s": step, "buckets": advice if cfg.optim.zero == 2 else None}


def test_the_bucket_size_a_prediction_advises_is_tried_beside_the_fixed_sizes():
    cfg = load_config([*ARGS, "optim.zero=2"])
    machine = machine_model(cfg.machine, WORLD)
    result = Search(cfg, WORLD, machine, {"optim.zero"}, predict_fn=advising_prediction).run(verify=0)
    assert {v.values["optim.bucket_mb"] for v in result.ranked()} == {32.0, 64.0, 128.0, 512.0}
    assert result.ranked()[0].values["optim.bucket_mb"] == 64.0
    # Under ZeRO-1 the prediction advises nothing (no bucketed reductions): the recipe's size only.
    cfg1 = load_config([*ARGS, "optim.zero=1"])
    zero1 = Search(cfg1, WORLD, machine, {"optim.zero"}, predict_fn=advising_prediction).run(verify=0)
    assert {v.values["optim.bucket_mb"] for v in zero1.visits} == {cfg1.optim.bucket_mb}
    # A bucket size given on the command line stays, advice or not.
    cfg128 = load_config([*ARGS, "optim.zero=2", "optim.bucket_mb=128"])
    held = Search(cfg128, WORLD, machine, {"optim.zero", "optim.bucket_mb"}, predict_fn=advising_prediction)
    assert {v.values["optim.bucket_mb"] for v in held.run(verify=0).visits} == {128.0}


def test_the_winners_buckets_are_weighed_against_the_machine():
    # Under the winner's overrides the search prints what the prediction says of its
    # buckets on the machine's links (optimus.perf.buckets), and nothing where the winner has no bucketed reductions.
    cfg = load_config(ARGS)
    buckets = {"bucket_mb": 32.0, "group_size": 96, "latency_share": 0.15, "advised_mb": 64, "advised_share": 0.06}
    values = {"optim.zero": 2, "optim.bucket_mb": 32.0}
    visit = Visit(values, "predicted", peak_bytes=2**30, prediction={**fake_prediction(cfg), "buckets": buckets})
    result = SearchResult(world=WORLD, nodes=None, machine="frontier", structures=1, visits=[visit])
    lines = format_search(result, cfg)
    assert lines[-2:] == [
        "  optim.zero=2 optim.bucket_mb=32",
        "  gradient buckets: optim.bucket_mb=32, whose reduce-scatter over 96 ranks spends 15% of its time on the "
        "links' fixed costs; optim.bucket_mb=64 would take it to 6% (each group under 10% or in one bucket; check "
        "the memory with optimus plan)",
    ]
    visit.prediction["buckets"] = None
    assert format_search(result, cfg)[-1] == "  optim.zero=2 optim.bucket_mb=32"


def test_invalid_layouts_are_those_the_config_checks_refuse():
    search = search_of(ARGS)
    for visit in search.structures():
        cfg = with_values(search.cfg, visit.values)
        if visit.status == "invalid":
            with pytest.raises(ConfigError):
                check_groups_in_node(cfg)
                validate(cfg, WORLD)
                check_predictable(cfg)
        else:
            assert make_plan(cfg, WORLD).world == WORLD
    structural = [k for axis in STRUCTURE for k in AXES[axis]]
    assert len({tuple(v.values[k] for k in structural) for v in search.structures()}) == len(search.structures())


def test_a_layout_whose_dry_run_does_not_fit_is_dropped_and_the_next_verified(monkeypatch):
    """The planner's peak is an estimate: the fastest layout's dry run measures more than the device (as the
    DeepSeek-V3-scale recipe's did, 70.4 GB planned at 67.6 on a 68.7 GB tile), so it leaves the ranking with its
    measured peak and the next fastest is verified, until `verify` layouts fit."""
    measured = []

    def dry_run(cfg, world, device):
        fits = len(measured) >= 2  # the two fastest do not fit
        measured.append(formula_step(cfg))
        return {"rank": 0, "peak_bytes": 2**40 if not fits else 2**20, "planned_bytes": 2**20, "fits": fits,
                "device_bytes": 2**30}  # fmt: skip

    monkeypatch.setattr("optimus.perf.search.verified_peak", dry_run)
    search = search_of(ARGS)
    before = [v.step for v in search_of(ARGS).run(verify=0).ranked()]
    result = search.run(verify=2)
    assert measured == pytest.approx(before[:4])  # the fastest four verified, in order: two dropped, two fit
    assert [v.step for v in result.ranked()] == pytest.approx(before[2:])
    dropped = [v for v in result.visits if v.status == "dropped" and v.verified]
    assert [v.step for v in dropped] == pytest.approx(before[:2]) and all(v.peak_bytes == 2**40 for v in dropped)
    assert all(v.verified["fits"] for v in result.ranked()[:2])


def test_a_value_that_divides_only_with_another_micro_batch_is_tried_with_the_nearest_one():
    """PP 2 zero bubble at TP 2 with micro-batches of 4: TP 1 doubles the data-parallel ranks, leaving each rank 4
    sequences, one micro-batch of 4, fewer than the 2 the schedule needs. The step here is fastest at TP 1 with
    micro-batches of 2 and slower for every single change from the start, so a descent that skipped TP 1 would stop
    at the start; it tries TP 1 with micro-batches of 2 (the nearest that divides, smaller first) instead."""
    four_layers = [arg if not arg.startswith("model.n_layers=") else "model.n_layers=4" for arg in ARGS[:-1]]
    start = [*four_layers, "parallel.pp=2", "parallel.pp_schedule=interleaved_zb", "parallel.pp_virtual=2",
             "parallel.tp=2", "train.micro_batch=4"]  # fmt: skip

    def predict(cfg):
        p, t = cfg.parallel, cfg.train
        step = {(2, 4): 1.0, (1, 2): 0.8}.get((p.tp, t.micro_batch), 1.1)
        step += 0.0 if (p.pp, p.pp_schedule) == (2, "interleaved_zb") else 0.5
        return {"step_time_s": step, "mfu": 0.1 / step, "time_split": {"compute": step}, "step_time_s_range": None}

    cfg = load_config(start)
    search = Search(cfg, WORLD, machine_model(cfg.machine, WORLD), set(), predict_fn=predict)
    with pytest.raises(ConfigError, match="micro-batches"):
        validate(with_values(cfg, {"parallel.tp": 1}), WORLD)
    best = search.run(verify=0).ranked()[0]
    assert (best.values["parallel.tp"], best.values["train.micro_batch"], best.step) == (1, 2, 0.8)
    fixed = Search(cfg, WORLD, machine_model(cfg.machine, WORLD), {"train.micro_batch"}, predict_fn=predict)
    assert fixed.run(verify=0).ranked()[0].step == 1.0  # with the micro-batch fixed, TP 1 does not divide


def test_a_prediction_ended_by_the_searchs_stop_is_not_reported_as_failed():
    """A stop reaches the search while two predictions run (here: the first one's thread raises it); the other's
    tracing process then ends with the command (the forkserver reports its exit as "exit code 255"), which is the
    stop, not the layout's failure."""
    lines: list[str] = []
    search = search_of(ARGS)
    search.jobs, search.say = 2, lines.append
    both_started = threading.Barrier(2, timeout=10.0)

    def predict(cfg):
        if both_started.wait() == 0:  # one of the two
            raise KeyboardInterrupt  # the stop, as the search's main thread receives it
        assert search.stopping.wait(10.0)
        raise RuntimeError("the dry runs for the prediction failed: exit code 255")

    search._predict = predict
    visits = [v for v in search.structures() if v.status == "fits"][:2]
    assert len(visits) == 2
    with pytest.raises(KeyboardInterrupt):
        search.predicted(visits)
    deadline = time.monotonic() + 10.0
    while not lines and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(lines) == 1 and lines[0].endswith("prediction stopped with the search"), lines
    assert all(v.status == "fits" for v in visits)


def test_search_prints_the_winner_whose_overrides_predict_the_same_step(capsys):
    # The real prediction, with every axis but the bucket's and the dispatcher's fixed on the command line.
    fixed = ["parallel.pp=1", "parallel.tp=1", "parallel.ep=4", "optim.sharding=ep_aware", "optim.shard_ranks=null",
             "optim.overlap_param_gather=false", "optim.zero=2", "train.activation_checkpointing=none"]  # fmt: skip
    assert main(["plan", "--search", "--world", "8", "--json", "--verify", "1", "--jobs", "2", *ARGS, *fixed]) == 0
    out = json.loads(capsys.readouterr().out)
    ranked = out["ranked"]
    # The descent tried every bucket size and every dispatch (not every pair: each axis from the best so far).
    assert {r["values"]["optim.bucket_mb"] for r in ranked} == {32.0, 128.0, 512.0}
    dispatch = {(r["values"]["parallel.dispatcher"], r["values"]["parallel.ep_overlap_chunks"]) for r in ranked}
    assert dispatch == {("alltoall", 1), ("alltoall", 2), ("allgather", 1)}
    assert all(r["values"]["parallel.ep"] == 4 and r["values"]["optim.zero"] == 2 for r in ranked)
    steps = [r["prediction"]["step_time_s"] for r in ranked]
    assert steps == sorted(steps)
    winner = out["winner"]
    assert winner["verified"]["peak_bytes"] > 0 and winner["verified"]["fits"] is True
    assert main(["plan", "--predict", "--json", "--world", "8", *ARGS, *winner["overrides"]]) == 0
    again = json.loads(capsys.readouterr().out)
    assert again["step_time_s"] == pytest.approx(winner["prediction"]["step_time_s"], rel=1e-9)
    assert values_of(load_config([*ARGS, *winner["overrides"]])) == winner["values"]


@pytest.mark.parametrize(
    ("args", "words"),
    [
        (["--search", "--top", "0"], "--top 0 must be at least 1"),
        (["--top", "3"], "--top belongs to `optimus plan --search`"),
        (["--search", "--predict"], "--predict and --search are two commands"),
        (["--search", "--rank", "0"], "--search runs its own predictions"),
        (["--search", "--world", "2", "machine=local"], "machine=local times each traced operator"),
        (["--search", "--world", "8", "machine=frontier", "parallel.pp=3"], "no layout of the search is valid"),
    ],
)
def test_refusals(capsys, args, words):
    assert main(["plan", *args, *TINY_MODEL]) == 2
    assert words in capsys.readouterr().err
