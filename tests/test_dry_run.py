"""`optimus plan --dry-run` against the real thing: a 4-rank gloo run of the same small layout issues the same
collectives, rank by rank, and its memory tracker measures the same peak; injected faults are named by the
group check; the host syncs of a step are the design's."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
import torch

from optimus.cli import main
from optimus.dry_run import dry_run_rank, group_check_ranks
from optimus.load_model import ExpertLoad
from optimus.parallel.collective_trace import mismatches
from optimus.recipes import load_config
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
    layer and micro-batch; each other read is named and happens once per step (the loss and flag reduction,
    the clipping norm, the tokens per expert, the pipeline's start-up vote). The experts' row bounds stay on the
    device (fp32 runs torch._grouped_mm here, as a GPU does in bf16)."""
    _, results = pp_ep_dry
    for result in results.values():
        counts = {s["where"].split(":")[0] + " " + s["where"].split(" ")[-1]: s["count"] for s in result["host_syncs"]}
        assert counts.pop("optimus/parallel/alltoall_dispatch.py plan") == 2 * 2
        assert counts.pop("optimus/parallel/pipeline.py step", 1) == 1  # the vote (torch < 2.14 on a fake group)
        assert counts == {
            "optimus/train/faults.py unpack_step_flags": 1,
            "optimus/optim/grad_norm.py global_grad_norm": 1,
            "optimus/train/metrics.py expert_tokens": 1,
        }


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


def test_a_skipped_collective_on_one_rank_is_named_by_the_group_check(pp_ep_dry, monkeypatch):
    """Rank 3 does not reduce the step's expert counts: the world group names rank 3 and the call."""
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
    assert "is not issued by ranks [3]" in problems[0] and "all_reduce in step" in problems[0]


def test_group_check_ranks_cover_one_group_of_each_kind():
    # world 48 = pp 2 x 24 per stage, tp 2, ep 4: TP [0, 1], EP [0..3], EDP 0, 4, .., 20, DP 0, 2, .., 22,
    # PP [0, 24], and the last rank.
    ranks = group_check_ranks(48, pp=2, tp=2, ep=4)
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
    from optimus.load_model import using

    with using(ExpertLoad(4, 3.0), ep_rank):
        assert group_bounds(torch.zeros(n_local, dtype=torch.int32), 120) == bounds


@pytest.mark.parametrize(
    "args, message",
    [
        (["--imbalance", "9"], "--imbalance 9.0 is outside [1, 4]"),
        (["--device", "cuda"], "--device cuda needs a GPU"),
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
    assert main([*args, "--overwrite"]) == 0
