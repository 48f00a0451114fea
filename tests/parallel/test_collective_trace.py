"""The collective recorder: what it writes for known calls, a real run's traces agree across ranks, and the
cross-rank check names the group, the ranks and the first call of an injected fault."""

from __future__ import annotations

import copy
import json

import pytest
import torch
import torch.distributed as dist
import torch.distributed._functional_collectives as funcol

from optimus.cli import main
from optimus.parallel.collective_trace import CollectiveTrace, mismatches
from optimus.parallel.collectives import _reduce_scatter_tensor
from tests.conftest import TINY_MODEL
from tests.distributed import run_distributed


def _known_calls():
    """Rank r of 2: one call of each kind, with sizes that differ by rank where the op allows it."""
    rank = dist.get_rank()
    pair = dist.new_group([0, 1])
    x = torch.ones(6, 4)  # [6 rows, 4] float32: 96 bytes
    trace = CollectiveTrace()
    with trace:
        dist.all_reduce(x[:2].contiguous(), group=pair)
        send, recv = ([1, 5], [1, 2]) if rank == 0 else ([2, 4], [5, 4])
        out = torch.empty(sum(recv), 4)
        dist.all_to_all_single(out, x, recv, send, group=pair)
        gathered = torch.empty(4, 4, dtype=torch.bfloat16)
        dist.all_gather_into_tensor(gathered, x[:2].to(torch.bfloat16))
        if rank == 0:
            dist.send(x[0].contiguous(), 1)
        else:
            dist.recv(x[0].contiguous(), 0)
        _reduce_scatter_tensor(torch.empty(2, 4), x[:4].contiguous(), group=pair)
        funcol.wait_tensor(funcol.all_reduce(x[:1], "sum", pair))  # DTensor's path: a group name, not a group
        dist.barrier(group=pair)
    return trace.calls


def test_each_call_is_recorded_with_its_group_dtype_bytes_and_splits():
    rank0, rank1 = run_distributed(_known_calls, 2)
    assert [c["op"] for c in rank0] == [
        "all_reduce",
        "all_to_all",
        "all_gather",
        "send",
        "reduce_scatter",
        "all_reduce",
        "barrier",
    ]
    assert [c["op"] for c in rank1] == [
        "all_reduce",
        "all_to_all",
        "all_gather",
        "recv",
        "reduce_scatter",
        "all_reduce",
        "barrier",
    ]
    for calls in (rank0, rank1):
        assert calls[0] | {"phase": None, "group": None} == {
            "op": "all_reduce",
            "group": None,
            "ranks": [0, 1],
            "dtype": "float32",
            "bytes": 32,
            "phase": None,
        }
        assert calls[2]["dtype"] == "bfloat16" and calls[2]["bytes"] == 2 * 4 * 2
        assert calls[3]["ranks"] == [0, 1] and calls[3]["bytes"] == 16  # (sender, receiver)
        assert calls[4]["bytes"] == 4 * 4 * 4 and calls[4]["ranks"] == [0, 1]  # the whole input buffer
        assert calls[5]["bytes"] == 16 and calls[5]["ranks"] == [0, 1]
        assert all(c["phase"] == "step" for c in calls)  # outside any module or labelled block
        # The pair and the world hold the same two ranks but are different groups: kept apart by name.
        assert calls[0]["group"] == calls[1]["group"] != calls[2]["group"]
    assert rank0[1]["splits"] == {"send": [1, 5], "recv": [1, 2]}
    assert rank1[1]["splits"] == {"send": [2, 4], "recv": [5, 4]}
    assert mismatches({0: rank0, 1: rank1}) == []


@pytest.fixture(scope="module")
def pp_ep_run(tmp_path_factory):
    """The first step's collectives of each rank of a real 4-rank run, pp 2 x ep 2, 1F1B, ZeRO-2."""
    run_dir = tmp_path_factory.mktemp("trace") / "run"
    args = [
        "train", *TINY_MODEL, "train.steps=1", "train.global_batch=8", "train.micro_batch=2", "train.seq_len=32",
        "train.eval_sequences=2", "logging.progress=false", "parallel.nproc=4", "parallel.pp=2", "parallel.ep=2",
        "parallel.pp_schedule=1f1b", "optim.zero=2", "profile.collectives=true", "profile.host_syncs=true",
        "model.n_layers=4", "train.dtype=fp32", f"run.dir={run_dir}",
    ]  # fmt: skip
    assert main(args) == 0
    return run_dir


@pytest.fixture(scope="module")
def pp_ep_traces(pp_ep_run):
    return {r: json.loads((pp_ep_run / "collectives" / f"rank{r}.json").read_text()) for r in range(4)}


def test_a_real_runs_ranks_agree_on_every_group(pp_ep_traces, single_threaded):
    assert mismatches(pp_ep_traces) == []


def test_a_real_runs_trace_holds_the_exchanges_the_layout_implies(pp_ep_traces):
    """pp 2 x ep 2 over 4 ranks: stage s holds layers 2s, 2s+1 and ranks (2s, 2s+1) are its EP pair. With 2
    micro-batches per rank and dropless all-to-all dispatch, each MoE layer exchanges per micro-batch one
    count block, then dispatch and combine in the forward and their adjoints in the backward."""
    accum = 8 // 2 // 2  # global batch / micro-batch / data-parallel ranks (ep folds into data parallelism)
    for rank, calls in pp_ep_traces.items():
        stage, pair = rank // 2, [2 * (rank // 2), 2 * (rank // 2) + 1]
        # ZeRO-2: the stage's dense gradients are reduced during the backward (on gloo a reduce-scatter is an
        # all-to-all of the blocks, collectives.reduce_scatter_sum) over the stage's two ranks, and the updated
        # shards are gathered in the optimizer step: the reduction's input is the gather's output.
        (gather,) = [c for c in calls if c["op"] == "all_gather"]
        assert gather["phase"] == "optimizer" and gather["ranks"] == pair
        reduces = [c for c in calls if c["op"] == "all_to_all" and c["bytes"] == 2 * gather["bytes"]]
        assert len(reduces) == 1 and reduces[0]["phase"].startswith("backward")
        for layer in (2 * stage, 2 * stage + 1):
            exchanges = [c for c in calls if c["op"] == "all_to_all" and f"layers.{layer}." in c["phase"]]
            exchanges = [c for c in exchanges if c not in reduces]
            assert all(c["ranks"] == pair for c in exchanges)
            assert sum(c["dtype"] == "int64" for c in exchanges) == accum
            assert sum(c["phase"].startswith("forward") and c["dtype"] == "float32" for c in exchanges) == 2 * accum
            assert sum(c["phase"].startswith("backward") for c in exchanges) == 2 * accum
        peer = rank + 2 if stage == 0 else rank - 2
        # Activations forward and gradients back: one each way per micro-batch, to the other stage's same slot
        # (the first step also exchanges a few int32 bytes: the stages' handshake).
        sends = [c for c in calls if c["op"] == "send" and c["dtype"] == "float32"]
        recvs = [c for c in calls if c["op"] == "recv" and c["dtype"] == "float32"]
        assert len(sends) == len(recvs) == accum
        assert all(c["ranks"] == [rank, peer] for c in sends) and all(c["ranks"] == [peer, rank] for c in recvs)


def _first_exchange(calls: list[dict]) -> int:
    return next(i for i, c in enumerate(calls) if c["op"] == "all_to_all" and c["dtype"] != "int64")


@pytest.mark.parametrize("fault", ["skipped", "reordered", "wrong size", "wrong split"])
def test_an_injected_fault_is_named_by_group_ranks_and_call(pp_ep_traces, fault):
    traces = copy.deepcopy(pp_ep_traces)
    calls = traces[1]
    index = _first_exchange(calls)
    if fault == "skipped":
        del calls[index]
    elif fault == "reordered":  # the exchange issued before the count block that precedes it
        calls[index - 1], calls[index] = calls[index], calls[index - 1]
        index -= 1
    elif fault == "wrong size":
        calls[index]["bytes"] += 4
    else:
        calls[index]["splits"]["send"][0] += 1
    problems = mismatches(traces)
    assert len(problems) == 1, problems
    assert problems[0].startswith(f"group [0, 1]: call {index - sum(c['ranks'] != [0, 1] for c in calls[:index])} ")
    assert "rank 1:" in problems[0] or "not issued by ranks [1]" in problems[0]


def test_the_host_syncs_of_a_real_step_include_the_designs_one_per_layer_and_micro_batch(pp_ep_run):
    """The all-to-all's split sizes are the one host sync the design needs: once per MoE layer and
    micro-batch (the backward reuses the forward's splits). Each rank holds 2 MoE layers and runs 2
    micro-batches; the other syncs of the step are listed by line, each counted at least once."""
    for rank in range(4):
        syncs = json.loads((pp_ep_run / "host_syncs" / f"rank{rank}.json").read_text())
        counts = {s["where"].split(":")[0] + " " + s["where"].split(" ")[-1]: s["count"] for s in syncs}
        assert counts["optimus/parallel/alltoall_dispatch.py plan"] == 2 * 2
        assert counts["optimus/train/faults.py unpack_step_flags"] == 1  # losses, flags, clipping norm, expert load
        assert "optimus/optim/grad_norm.py global_grad_norm" not in counts
        assert all(s["count"] >= 1 for s in syncs)
        # Routing, sorting by expert and regrouping the received rows read nothing back (the counts are a
        # scatter-add of known length, the row total is known on the host).
        assert not [w for w in counts if w.startswith(("optimus/model/", "optimus/kernels/counting")) or "regroup" in w]
