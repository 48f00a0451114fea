"""`optimus plan --dry-run` against the real thing: a 4-rank gloo run of the same small layout issues the same
collectives, rank by rank, and its memory tracker measures the same peak; injected faults are named by the
group check; the host syncs of a step are the design's."""

from __future__ import annotations

import errno
import json
import os
import subprocess
import sys
import warnings

import pytest
import torch

from optimus.cli import main
from optimus.dry_run import dry_run_rank, group_check_ranks, sharding_metadata_apart
from optimus.kernels.torch_private import FakeTensorMode, TorchDispatchMode
from optimus.layout import Layout
from optimus.load_model import ExpertLoad
from optimus.output_dir import not_written
from optimus.parallel.collective_trace import mismatches
from optimus.plan import make_plan
from optimus.recipes import load_config
from tests.builds import fake_process_group
from tests.conftest import TINY_MODEL
from tests.unchanged import unchanged

# One step of the tiny model in fp32 with 2 micro-batches per rank; the layouts of the three kinds.
STEP = [
    *TINY_MODEL, "model.n_layers=4", "train.steps=1", "train.global_batch=8", "train.micro_batch=2",
    "train.seq_len=32", "train.eval_sequences=2", "train.dtype=fp32", "parallel.nproc=4",
]  # fmt: skip
LAYOUTS = {
    "pp2xep2": ["parallel.pp=2", "parallel.ep=2", "optim.zero=2"],
    "tp2xep2": ["parallel.tp=2", "parallel.ep=2"],
    "pp2xtp2": ["parallel.pp=2", "parallel.tp=2", "parallel.sp=true"],
    # two stages per pipeline rank, their forwards and backwards interleaved (MemTracker follows them), and the
    # all-gather dispatcher (its selection of the local experts' rows sized by the load model)
    "pp2xep2 interleaved allgather": [
        "parallel.pp=2",
        "parallel.ep=2",
        "parallel.dispatcher=allgather",
        "parallel.pp_schedule=interleaved_1f1b",
        "parallel.pp_virtual=2",
    ],
    # zero bubble: each backward an input pass (autograd.grad towards the stage's inputs) and a weight pass
    "pp2xep2 zero bubble": [
        "parallel.pp=2",
        "parallel.ep=2",
        "parallel.pp_schedule=interleaved_zb",
        "parallel.pp_virtual=2",
    ],
    # Muon: its exchanges of whole matrices over the dense and expert owners and the tp peers' halves
    "tp2xep2 muon": ["parallel.tp=2", "parallel.ep=2", "optim.update=muon", "optim.zero=2", "optim.bucket_mb=0.01"],
}


def _element_bytes(dtype: str) -> int:
    return torch.empty((), dtype=getattr(torch, dtype)).element_size() if dtype != "none" else 0


def comparable(call: dict) -> dict:
    """What a dry run must reproduce of a real run's call: everything but how many routed token rows an
    exchange carries (real routing decides that, the dry run's load model stands in for it); of those, the
    size of a row. A row is routed when it holds more than one element (a reduce-scatter's blocks are 1-D)."""
    kept = {key: call[key] for key in ("op", "ranks", "dtype", "phase")}
    rows = sum(call["splits"]["send"]) if "splits" in call else 0
    if rows and call["bytes"] % rows == 0 and call["bytes"] // rows > _element_bytes(call["dtype"]):
        kept["row_bytes"] = call["bytes"] // rows
    else:
        kept["bytes"] = call["bytes"]
    return kept


@pytest.fixture(scope="module", params=sorted(LAYOUTS))
def real_and_dry(request, tmp_path_factory):
    """(layout, real run directory, dry-run results by rank) of one small layout: the real run on 4 gloo
    processes, the dry run through the command line (one process for the layout's four ranks)."""
    overrides = [*STEP, *LAYOUTS[request.param]]
    run_dir, dry_dir = tmp_path_factory.mktemp(request.param) / "run", tmp_path_factory.mktemp("dry") / "out"
    args = ["train", *overrides, "logging.progress=false", "profile.collectives=true", "profile.memory=true"]
    assert main([*args, f"run.dir={run_dir}"]) == 0
    ranks = [arg for rank in range(4) for arg in ("--rank", str(rank))]
    dry = [sys.executable, "-m", "optimus", "plan", "--dry-run", "--world", "4", *ranks, "--out", str(dry_dir)]
    done = subprocess.run([*dry, *overrides], capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, done.stderr[-3000:]
    return request.param, run_dir, {r: json.loads((dry_dir / f"rank{r}.json").read_text()) for r in range(4)}


def startup_vote(call: dict) -> bool:
    """The pipeline schedule's first-step vote (a 4-byte int32 send and recv per stage pair), which torch 2.14 and
    later skip on a fake process group, deciding locally what a real group's vote decides."""
    return call["op"] in ("send", "recv") and call["dtype"] == "int32" and call["bytes"] == 4


def test_a_dry_run_issues_the_real_runs_collectives_rank_by_rank(real_and_dry):
    layout, run_dir, dry = real_and_dry
    for rank, result in dry.items():
        real = json.loads((run_dir / "collectives" / f"rank{rank}.json").read_text())
        issued = [comparable(c) for c in result["collectives"] if not startup_vote(c)]
        assert issued == [comparable(c) for c in real if not startup_vote(c)], (layout, rank)
    assert mismatches({rank: r["collectives"] for rank, r in dry.items()}) == []


def test_a_dry_runs_peak_memory_is_the_real_runs_within_5_percent(real_and_dry):
    layout, run_dir, dry = real_and_dry
    for rank, result in dry.items():
        real = json.loads((run_dir / "memory" / f"rank{rank}.json").read_text())
        measured = result["memory"]["peak_bytes"]
        assert abs(measured / real["peak_bytes"] - 1) < 0.05, (layout, rank, measured, real)


@pytest.fixture(scope="module")
def pp_ep_dry():
    cfg = load_config([*STEP, *LAYOUTS["pp2xep2"]])
    return cfg, {rank: dry_run_rank(cfg, 4, rank) for rank in range(4)}


def test_the_host_syncs_of_a_dry_step_are_the_designs(pp_ep_dry):
    """Each rank holds 2 MoE layers and runs 2 micro-batches: the all-to-all's split sizes are read once per
    layer and micro-batch; the step reads one more (the loss and flag reduction, which carries the clipping norm
    and the tokens per expert too), and the pipeline's start-up vote. The experts' row bounds stay on the
    device (fp32 runs torch._grouped_mm here, as a GPU does in bf16)."""
    _, results = pp_ep_dry
    for result in results.values():
        counts = {s["where"].split(":")[0] + " " + s["where"].split(" ")[-1]: s["count"] for s in result["host_syncs"]}
        assert counts.pop("optimus/parallel/alltoall_dispatch.py plan") == 2 * 2
        assert counts.pop("optimus/parallel/pipeline.py step", 1) == 1  # the vote (torch < 2.14 on a fake group)
        assert counts == {"optimus/train/faults.py unpack_step_flags": 1}  # losses, flags, norm, expert load


def _exchange_index(calls: list[dict]) -> int:
    return next(i for i, c in enumerate(calls) if c["op"] == "all_to_all" and c["dtype"] == "float32")


def test_a_wrong_split_on_one_rank_is_named_by_the_group_check(pp_ep_dry, monkeypatch):
    """Rank 1 sends one of its rows for rank 0 to itself instead: its EP group [0, 1] disagrees at the first
    row exchange, and nothing else does."""
    cfg, results = pp_ep_dry
    exchange_rows = ExpertLoad.exchange_rows

    def shifted(self, assignments_C, ep_size, ep_rank):
        send_CP, recv_CP = exchange_rows(self, assignments_C, ep_size, ep_rank)
        if ep_rank == 1 and torch.distributed.get_rank() == 1:
            send_CP[0][0] -= 1
            send_CP[0][1] += 1
        return send_CP, recv_CP

    monkeypatch.setattr(ExpertLoad, "exchange_rows", shifted)
    traces = {rank: r["collectives"] for rank, r in results.items()}
    traces[1] = dry_run_rank(cfg, 4, 1)["collectives"]
    problems = mismatches(traces)
    index = _exchange_index(traces[1])
    in_group = sum(c["group"] == traces[1][index]["group"] for c in traces[1][:index])
    assert len(problems) == 1 and problems[0].startswith(f"group [0, 1]: call {in_group} differs"), problems


def test_a_rank_that_leaves_out_its_expert_counts_is_named_by_the_group_check(pp_ep_dry, monkeypatch):
    """Rank 3 does not add its expert counts to the step's one reduction: the world group names rank 3 and the
    call, whose size differs from the other ranks'."""
    from optimus.model.moe import RouterStats

    cfg, results = pp_ep_dry
    tokens_per_expert = RouterStats.tokens_per_expert
    monkeypatch.setattr(
        RouterStats,
        "tokens_per_expert",
        lambda self: None if torch.distributed.get_rank() == 3 else tokens_per_expert(self),
    )
    traces = {rank: r["collectives"] for rank, r in results.items()}
    traces[3] = dry_run_rank(cfg, 4, 3)["collectives"]
    problems = mismatches(traces)
    assert len(problems) == 1 and problems[0].startswith("group [0, 1, 2, 3]: call "), problems
    assert "differs between ranks" in problems[0] and "in step" in problems[0]
    sizes = {part.split(": ")[0]: part.split(": ")[1] for part in problems[0].split("(")[1].rstrip(")").split("; ")}
    assert sizes["rank 3"] != sizes["rank 0"] == sizes["rank 1"] == sizes["rank 2"]


def test_group_check_ranks_cover_one_group_of_each_kind():
    # world 48 = pp 2 x 24 per stage, tp 2, ep 4: TP [0, 1], EP [0..3], EDP 0, 4, .., 20, DP 0, 2, .., 22,
    # PP [0, 24], and the last rank.
    ranks = group_check_ranks(Layout(world=48, pp=2, tp=2, ep=4))
    assert set(ranks) == {*range(4), *range(0, 24, 4), *range(0, 24, 2), 24, 47}


def test_a_layout_that_does_not_divide_is_refused_before_any_work(capsys):
    code = main(["plan", "--dry-run", "--world", "6", *TINY_MODEL, "parallel.ep=4"])
    assert code == 2
    assert "optimus: error:" in capsys.readouterr().err


def test_the_busiest_expert_under_imbalance_loads_ep_rank_0():
    """--imbalance 3 with 4 experts over ep 2: expert 0 takes 3/4 of the assignments, the others 1/12 each, so
    EP rank 0 (experts 0, 1) receives 3/4 + 1/12 = 5/6 of every rank's rows, and EP rank 1 the rest."""
    cfg = load_config([*STEP, *LAYOUTS["pp2xep2"]])
    assignments = 2 * 32 * 2  # micro_batch x seq_len x top_k
    for rank, share in ((0, 5 / 6), (1, 1 / 6)):
        calls = dry_run_rank(cfg, 4, rank, imbalance=3.0)["collectives"]
        first = calls[_exchange_index(calls)]
        assert first["splits"]["send"] == [round(assignments * 5 / 6), round(assignments / 6)]
        assert first["splits"]["recv"] == [round(assignments * share)] * 2


@pytest.mark.parametrize(
    "ep_rank, n_local, bounds",
    [
        (0, 4, [0, 90, 100, 110, 120]),  # no EP: expert 0 takes 3/4 of the rows, the others 1/12 each
        (0, 2, [0, 108, 120]),  # EP rank 0 of 2 received 3/4 + 1/12 of them: expert 0 holds 9/10 of its rows
        (1, 2, [0, 60, 120]),  # EP rank 1's experts are equally busy
    ],
)
def test_a_dry_runs_expert_rows_follow_the_load(ep_rank, n_local, bounds):
    # The per-expert loops' row bounds (the CPU's expert schedules choose by them) under --imbalance 3.
    from optimus.kernels.host_reads import group_bounds
    from optimus.load_model import LoadAnswers

    reads = LoadAnswers(ExpertLoad(4, 3.0), ep_rank).row_reads()
    assert group_bounds(torch.zeros(n_local, dtype=torch.int32), 120, reads) == bounds


@pytest.mark.parametrize(
    "args, message",
    [
        (["--imbalance", "9"], "--imbalance 9.0 is outside [1, 4]"),
        (["--device", "tpu"], "--device tpu is not supported: use one of cpu, cuda, rocm, xpu"),
        (["--rank", "7"], "--rank 7 is not a rank of a world of 4"),
        (["model.moe.capacity_factor=1.25"], "set model.moe.capacity_factor=null"),
    ],
)
def test_what_a_dry_run_cannot_do_is_refused_in_one_sentence(args, message, capsys, monkeypatch, tmp_path):
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    out = tmp_path / "out"
    with unchanged(tmp_path):
        code = main(["plan", "--dry-run", "--world", "4", *STEP, "parallel.ep=2", "--out", str(out), *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


def test_an_earlier_dry_run_is_replaced_only_with_overwrite(tmp_path, capsys):
    out = tmp_path / "out"
    args = ["plan", "--dry-run", "--world", "4", *STEP, "parallel.ep=2", "--rank", "1", "--out", str(out)]
    assert main(args) == 0
    assert json.loads((out / "rank1.json").read_text())["rank"] == 1
    with unchanged(tmp_path):
        assert main(args) == 2
    assert "--overwrite" in capsys.readouterr().err
    # a file the user put beside the ranks' files is not the dry run's to delete: named, and nothing is written
    (out / "notes.txt").write_text("mine")
    with unchanged(tmp_path):
        assert main([*args, "--overwrite"]) == 2
    assert "(notes.txt), which --overwrite would delete" in capsys.readouterr().err
    (out / "notes.txt").unlink()
    (out / "rank3.json").write_text("{}")  # an earlier dry run's rank: replaced with the rest
    assert main([*args, "--overwrite"]) == 0
    assert sorted(path.name for path in out.iterdir()) == ["dry_run.json", "rank1.json"]


def test_what_an_output_is_made_of_is_told_from_what_a_user_put_there(tmp_path):
    """Every path under an earlier output that matches none of the command's patterns, a directory as a whole
    unless patterns live under it, a link as itself."""
    (tmp_path / "model").mkdir()
    (tmp_path / "model" / "tiny.yaml").write_text("")
    (tmp_path / "model" / "notes.md").write_text("")
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "rank0.json").write_text("")
    (tmp_path / "rank0.json").write_text("")
    (tmp_path / "rank0.json.bak").write_text("")
    (tmp_path / "link").symlink_to(tmp_path / "model")
    written = ("rank[0-9]*.json", "model/*.yaml")
    assert not_written(tmp_path, written) == ["link", "mine/", "model/notes.md", "rank0.json.bak"]


def test_a_dry_run_that_does_not_fit_says_so_first(tmp_path, capsys):
    """A peak above machine.memory_gb: the rank's first line says so, its JSON holds the verdict, the peak and
    the limit, and the command exits 1 with every figure printed and written."""
    out = tmp_path / "out"
    assert main(["plan", "--dry-run", "--world", "1", *STEP, "machine.memory_gb=0.001", "--out", str(out)]) == 1
    lines = capsys.readouterr().out.splitlines()
    assert lines[1].startswith("DOES NOT FIT: rank 0 measured a peak of") and lines[2].startswith("rank 0 of 1")
    memory = json.loads((out / "rank0.json").read_text())["memory"]
    assert memory["fits"] is False and memory["device_bytes"] == round(0.001 * 2**30) < memory["peak_bytes"]
    assert json.loads((out / "dry_run.json").read_text())["does_not_fit"] == [0]


def test_a_muon_dry_run_is_measured_against_the_plans_one_figure():
    """With few activations Muon's step, after the backward, is the peak (its update directions beside the
    state): `optimus plan`'s total counts it (the busiest rank's), and the dry run prints that total.
    Nor does it print the warnings every dry run raised (fake storages' addresses, MemTracker's None outputs)."""
    cfg = load_config([*TINY_MODEL, "optim.update=muon", "train.dtype=fp32", "train.seq_len=32",
                       "train.micro_batch=1", "train.global_batch=2"])  # fmt: skip
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        memory = dry_run_rank(cfg, 1, 0)["memory"]
    assert not [
        str(w.message) for w in caught if "FakeTensor" in str(w.message) or "wrapper-subclass" in str(w.message)
    ]
    plan = make_plan(cfg, 1)
    assert plan.memory["step_bytes"] > plan.activations["configured"]
    assert memory["planned_bytes"] == plan.memory["total_configured"]
    assert 0.9 < memory["peak_bytes"] / memory["planned_bytes"] <= 1.05


def test_a_hierarchical_dry_run_gathers_in_shard_groups_and_is_measured_against_its_plan():
    """optim.shard_ranks=2 at world 8, ep 2: rank 0 gathers its parameters inside its shard groups (dense: ranks
    0, 1 of the stage's 8; experts: 0, 2 of its expert-data-parallel 0, 2, 4, 6), all-reduces each shard over its
    replica groups (0, 2, 4, 6 and 0, 4), and peaks at the plan's figure, which counts the state split over 2."""
    cfg = load_config([*TINY_MODEL, "optim.update=adamw", "train.dtype=fp32", "train.seq_len=32",
                       "train.micro_batch=1", "train.global_batch=8", "parallel.ep=2", "optim.shard_ranks=2",
                       "optim.zero=2"])  # fmt: skip
    result = dry_run_rank(cfg, 8, 0)
    calls = result["collectives"]
    assert {tuple(c["ranks"]) for c in calls if c["op"] == "all_gather"} == {(0, 1), (0, 2)}
    replicas = {tuple(c["ranks"]) for c in calls if c["op"] == "all_reduce"} - {tuple(range(8))}
    assert replicas == {(0, 2, 4, 6), (0, 4)}
    memory = result["memory"]
    assert memory["planned_bytes"] == make_plan(cfg, 8).memory["total_configured"]
    assert 0.9 < memory["peak_bytes"] / memory["planned_bytes"] <= 1.05


def _no_work(monkeypatch):
    """Make the work of a dry run or a prediction (the step, the machine's measurement) fail the test."""

    def work(*args, **kwargs):
        raise AssertionError("the work started before the refusal")

    monkeypatch.setattr("optimus.dry_run.run_dry_runs", work)
    monkeypatch.setattr("optimus.perf.predict.trace_step", work)
    monkeypatch.setattr("optimus.perf.machine.measure_local", work)


DENSE = ["model.moe.n_experts=0"]


@pytest.mark.parametrize(
    "args, message",
    [
        (["--dry-run", "--predict"], "--dry-run and --predict are two commands"),
        (["--dry-run", "--json"], "leave out --json"),
        (["--dry-run", "--rank", "1", "--rank", "1"], "--rank names 1 more than once"),
        (["--dry-run", "--imbalance", "2", *DENSE], "this model has none (model.moe.n_experts=0)"),
        (["--dry-run", "--out", "{tmp}/afile/child"], "is a file"),
        (["--predict", "--nodes", "1,1", "machine=frontier", "train.global_batch=16"], "--nodes names 1 more"),
        (["--predict", "--imbalance", "2", *DENSE], "this model has none (model.moe.n_experts=0)"),
        (["--predict", "--imbalance", "9"], "--imbalance 9.0 is outside [1, 4]"),
        (["--predict", "machine.perf.gemm_efficiency=0"], "machine.perf.gemm_efficiency=0.0 must be"),
        (["--predict", "--out", "{tmp}/out"], "leave out --out"),
        (["--imbalance", "2"], "--imbalance belongs to a dry run or a prediction"),
    ],
)  # fmt: skip
def test_plan_options_are_refused_before_any_work(args, message, tmp_path, capsys, monkeypatch):
    """Options a command does not take, or names twice, and what can be checked before the work (--out's way,
    --imbalance, the machine's numbers) are refused in one sentence before the step is traced or the machine
    measured."""
    _no_work(monkeypatch)
    (tmp_path / "afile").write_text("mine")
    args = [arg.format(tmp=tmp_path) for arg in args]
    world = [] if "--nodes" in args else ["--world", "4"]
    with unchanged(tmp_path):
        code = main(["plan", *world, *STEP, *args])
    err = capsys.readouterr().err
    assert code == 2 and message in err and len(err.strip().splitlines()) == 1, err


@pytest.fixture(params=["ro", "rw"], ids=["read-only file system", "mount point"])
def mounted(request, tmp_path):
    """(a tmpfs mounted in tmp_path, read-only or not, and its options); skipped where mounting is not allowed."""
    where = tmp_path / "mnt"
    where.mkdir()
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"{request.param},size=1m", "tmpfs", str(where)],
                              capture_output=True)  # fmt: skip
    except FileNotFoundError:
        pytest.skip("no mount command here")
    if done.returncode:
        pytest.skip(f"mounting a tmpfs is not allowed here: {done.stderr.decode().strip()}")
    yield where, request.param
    subprocess.run(["umount", str(where)], check=True)


def test_an_out_that_cannot_be_written_is_refused_before_the_dry_run(mounted, tmp_path, capsys, monkeypatch):
    """A read-only file system on the way to --out (as root too), or an --out that is a mount point (replacing
    it renames it): refused before the dry run, not after it."""
    where, options = mounted
    _no_work(monkeypatch)
    out = where / "out" if options == "ro" else where
    with unchanged(tmp_path):
        assert main(["plan", "--dry-run", "--world", "4", *STEP, "parallel.ep=2", "--out", str(out)]) == 2
    err = capsys.readouterr().err
    assert ("read-only file system" if options == "ro" else "is a mount point") in err, err
    assert len(err.strip().splitlines()) == 1


@pytest.mark.parametrize("code, advice", [(errno.ENOSPC, "free space and rerun"), (errno.EBUSY, "choose another")])
def test_a_failed_replacement_gives_the_advice_of_its_cause(code, advice, tmp_path, monkeypatch):
    """A full disk is told to free space; anything else (a mount point that appeared since the check: EBUSY)
    to choose another --out. Either way nothing is left behind."""
    from optimus.config import ConfigError
    from optimus.output_dir import replacing_directory

    def rename(src, dst):
        raise OSError(code, os.strerror(code))

    monkeypatch.setattr("optimus.output_dir.os.rename", rename)
    with unchanged(tmp_path), pytest.raises(ConfigError, match=f"\\({os.strerror(code)}\\).*{advice}"):
        with replacing_directory(tmp_path / "out") as tmp:
            (tmp / "rank0.json").write_text("{}")


class _EmptyShapes(TorchDispatchMode):
    """The shapes of the tensors made by empty_strided while active (DTensor's shape propagation makes its
    global-shape tensors with it)."""

    def __init__(self):
        super().__init__()
        self.shapes: list[tuple[int, ...]] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.empty_strided.default:
            self.shapes.append(tuple(args[0]))
        return func(*args, **(kwargs or {}))


def test_dtensors_shape_propagation_is_not_part_of_a_dry_step(monkeypatch):
    """DTensor learns an operator's output shape by running it on global-shape tensors in the fake mode it finds
    active. A real run has none: they live in a fake mode of their own. In a dry run the step's fake mode is
    active, and its recorders saw them (MemTracker counted 3.3 GiB of them at frontier-1t's peak), unless
    sharding_metadata_apart runs the propagation apart. Here it runs once more, as the dry run's recorders would
    meet it: in the step's fake mode, under a recorder that sees every empty_strided."""
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.tensor import DTensor, Shard

    from optimus.kernels.torch_private import ShardingPropagator

    propagate = ShardingPropagator._propagate_tensor_meta_non_cached
    calls = []
    monkeypatch.setattr(ShardingPropagator, "_propagate_tensor_meta_non_cached",
                        lambda self, schema: calls.append((self, schema)) or propagate(self, schema))  # fmt: skip
    with fake_process_group(4, 0):
        mesh = init_device_mesh("cpu", (4,))  # (outside the fake mode: a mesh reads its ranks back)
        with FakeTensorMode():
            x = DTensor.from_local(torch.randn(8, 24), mesh, [Shard(1)], run_check=False)  # [8, 96] global
            w = DTensor.from_local(torch.randn(24, 40), mesh, [Shard(0)], run_check=False)  # [96, 40] global
            x @ w
            monkeypatch.undo()
            propagator, schema = next((p, s) for p, s in calls if s.op is torch.ops.aten.mm.default)
            with _EmptyShapes() as seen:
                propagator._propagate_tensor_meta_non_cached(schema)
            with _EmptyShapes() as seen_apart, sharding_metadata_apart():
                propagator._propagate_tensor_meta_non_cached(schema)
    assert {(8, 96), (96, 40)} <= set(seen.shapes)  # what the recorders met before
    assert seen_apart.shapes == []
