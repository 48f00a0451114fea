"""What a run writes about its routing and layout: `expert_tokens` per step (counted once per assignment over the
global batch, whatever the layout), the starting evaluation as step 0, run_info.json's `dp` and `edp` as `optimus
plan` counts them, each rank's cores and threads, and no gloo all-to-all notice from tensor parallelism on a CPU.
The layout oracles' comparison (tests/trajectories.py) is checked here on hand-made records."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from optimus.cli import main
from optimus.cpu_runtime import GLOO_ALLTOALL_FALLBACK, available_cores, cpu_list
from optimus.train.metrics import MetricsLog, expert_load_imbalance, wandb_refusal
from tests.conftest import SMALL_MODEL_RUN
from tests.trajectories import assert_same_trajectory, read_metrics, step_records
from tests.unchanged import unchanged

STEPS = 3
RUN = [
    *SMALL_MODEL_RUN, "data=text", "train.micro_batch=2", f"train.steps={STEPS}", f"train.eval_interval={STEPS}",
    "train.eval_sequences=4", "optim.warmup_steps=1", "optim.lr=1e-2", "parallel.timeout_s=60",
]  # fmt: skip
LAYOUTS = {
    "tp=2": ["parallel.nproc=2", "parallel.tp=2"],
    "pp=2": ["parallel.nproc=2", "parallel.pp=2"],  # one MoE layer per stage
}
ASSIGNMENTS = 8 * 16 * 2  # global_batch x seq_len x top_k: each MoE layer's row total


@pytest.fixture(scope="module")
def runs(tmp_path_factory, corpus_file):
    """{layout: (run directory, its stdout + stderr)}: one process in this one, the others through the command."""
    root = tmp_path_factory.mktemp("records")
    env = {**os.environ, "OPTIMUS_CACHE": str(tmp_path_factory.getbasetemp() / "optimus-cache")}
    env["OMP_NUM_THREADS"] = "1"  # two ranks share two cores
    args = [*RUN, f"data.path={corpus_file}"]
    with pytest.MonkeyPatch.context() as mp:  # the function-scoped isolated_cache does not reach here
        mp.setenv("OPTIMUS_CACHE", env["OPTIMUS_CACHE"])
        assert main(["train", *args, f"run.dir={root / 'one'}"]) == 0
    out = {"nproc=1": (root / "one", "")}
    for i, (layout, extra) in enumerate(LAYOUTS.items()):
        run_dir = root / f"run{i}"
        cmd = [sys.executable, "-m", "optimus", "train", *args, *extra, f"run.dir={run_dir}"]
        proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=300)
        assert proc.returncode == 0, proc.stderr[-3000:]
        out[layout] = (run_dir, proc.stdout + proc.stderr)
    return out


def test_expert_tokens_count_every_assignment_of_the_global_batch_once(runs):
    """Every layout's rows add up to the global batch's assignments (a tp rank routes its 1/tp of the tokens,
    a pipeline rank its stage's layers: summed once each), and equal the single process's."""
    reference = read_metrics(runs["nproc=1"][0])
    for layout, (run_dir, _) in runs.items():
        records = step_records(read_metrics(run_dir))
        assert [r["step"] for r in records] == list(range(1, STEPS + 1)), layout
        for r in records:
            assert [sum(row) for row in r["expert_tokens"]] == [ASSIGNMENTS] * 2, (layout, r["step"])
            assert r["expert_load_imbalance"] == pytest.approx(expert_load_imbalance(r["expert_tokens"]))
        result = assert_same_trajectory(read_metrics(run_dir), reference, layout)
        assert result["routing_differs_at"] is None, layout  # tiny fp32 runs: no router score near a tie


def test_run_info_names_dp_and_edp_as_optimus_plan_does(runs):
    from optimus.plan import make_plan
    from optimus.recipes import load_config

    for layout in LAYOUTS:
        info = json.loads((runs[layout][0] / "run_info.json").read_text())
        plan = make_plan(load_config([*RUN, *LAYOUTS[layout]]), 2)
        assert (info["layout"]["dp"], info["layout"]["edp"]) == (plan.dp, plan.edp), layout
        assert info["moe_layers"] == [0, 1]


def test_each_rank_records_its_cores_and_threads(runs):
    info = json.loads((runs["tp=2"][0] / "run_info.json").read_text())
    cores = cpu_list(available_cores())  # the ranks inherit this process's affinity
    assert [(r["cpus"], r["threads"]) for r in info["per_rank"]] == [(cores, 1), (cores, 1)]
    assert len({r["host"] for r in info["per_rank"]}) == 1


def test_a_tensor_parallel_cpu_run_prints_no_gloo_alltoall_notice(runs):
    _, output = runs["tp=2"]
    assert "Finished 3 steps" in output and GLOO_ALLTOALL_FALLBACK not in output


RESHARD = """
import logging, os, sys, tempfile
import torch
import torch.distributed as dist
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor._collective_utils import shard_dim_alltoall

if sys.argv[1] == "quiet":
    from optimus.cpu_runtime import quiet_gloo_alltoall_fallback

    quiet_gloo_alltoall_fallback()
dist.init_process_group("gloo", store=dist.FileStore(os.path.join(tempfile.mkdtemp(), "s"), 1), rank=0, world_size=1)
shard_dim_alltoall(torch.ones(2, 2), 0, 1, init_device_mesh("cpu", (1,)), 0)  # DTensor's Shard(0) -> Shard(1)
logging.getLogger("torch.distributed.tensor._collective_utils").warning("another notice")
dist.destroy_process_group()
"""


@pytest.mark.parametrize("mode", ["loud", "quiet"])
def test_the_filter_drops_dtensors_gloo_notice_and_nothing_else(mode):
    """DTensor's re-sharding on a CPU mesh, in a fresh process (it logs once per process): the notice shows
    without the filter, and with it every other message of that logger still does."""
    proc = subprocess.run([sys.executable, "-c", RESHARD, mode], capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert (GLOO_ALLTOALL_FALLBACK in proc.stderr) == (mode == "loud") and "another notice" in proc.stderr


# ---- the records' writer, and the layout oracles' comparison ---------------------------------------------------


class FakeWandb:
    def __init__(self):
        self.logged = []

    def log(self, values, step):
        self.logged.append((step, values))

    def finish(self):
        self.logged.append("finished")


def test_wandb_gets_one_number_per_layer_and_expert(tmp_path):
    wandb = FakeWandb()
    log = MetricsLog(tmp_path, True, wandb, moe_layer_ids=[1, 3])
    log.log({"step": 0, "tokens": 0, "val_loss": 5.5})
    log.log({"step": 1, "loss": 5.0, "mfu": None, "expert_tokens": [[3, 1], [0, 4]]})
    log.close()
    assert wandb.logged == [
        (0, {"step": 0, "tokens": 0, "val_loss": 5.5}),
        (1, {"step": 1, "loss": 5.0, "expert_tokens/layer_1/expert_0": 3, "expert_tokens/layer_1/expert_1": 1,
             "expert_tokens/layer_3/expert_0": 0, "expert_tokens/layer_3/expert_1": 4}),
        "finished",
    ]  # fmt: skip
    assert read_metrics(tmp_path)[1]["expert_tokens"] == [[3, 1], [0, 4]]  # metrics.jsonl keeps the lists


def records(n_steps: int, flip_at: int | None = None, **off: tuple[int, float]) -> list[dict]:
    """A step-0 evaluation and `n_steps` steps; from `flip_at` on the routing differs, and each `off` key is
    multiplied by its factor from its step on."""
    out = [{"step": 0, "tokens": 0, "val_loss": 6.0}]
    for step in range(1, n_steps + 1):
        r = {"step": step, "loss": 5.0 - 0.1 * step, "lm_loss": 4.9 - 0.1 * step, "aux_loss": 2.0, "z_loss": 0.5,
             "grad_norm": 1.0 + step, "expert_load_imbalance": 1.25, "expert_tokens": [[5, 3], [4, 4]]}  # fmt: skip
        if flip_at is not None and step >= flip_at:
            r["expert_tokens"] = [[4, 4], [4, 4]]
        out.append(r)
    for r in out:
        for key, (from_step, factor) in off.items():
            if key in r and r["step"] >= from_step:
                r[key] *= factor
    return out


def test_the_oracle_is_strict_until_routing_differs_then_checks_the_loss():
    reference = records(5)
    assert assert_same_trajectory(records(5), reference, "same")["routing_differs_at"] is None
    # a flip at step 3 lets the gradient norm part from there on, and is reported
    parted = records(5, flip_at=3, grad_norm=(3, 1.01), expert_load_imbalance=(3, 1.1))
    assert assert_same_trajectory(parted, reference, "flip")["routing_differs_at"] == 3
    # a gradient norm off before the flip, or a loss off after it, is not a flip
    with pytest.raises(AssertionError, match=r"expert_tokens first differ at step 4\): step 3 grad_norm"):
        assert_same_trajectory(records(5, flip_at=4, grad_norm=(3, 1.01)), reference, "early")
    with pytest.raises(AssertionError, match="step 5 loss"):
        assert_same_trajectory(records(5, flip_at=3, loss=(5, 1.001)), reference, "loss")
    with pytest.raises(AssertionError, match="step 0 val_loss"):
        assert_same_trajectory(records(5, flip_at=3, val_loss=(0, 1.01)), reference, "start")


# ---- wandb without credentials (issue 55) ------------------------------------------------------------------


@pytest.fixture
def no_wandb_login(tmp_path, monkeypatch):
    """A user who never ran `wandb login`: no key in the environment, ~/.netrc or wandb's settings; wandb's
    process-wide settings are read afresh (and dropped again after the test)."""
    import wandb

    home = tmp_path / "home"
    home.mkdir()
    for name in ("WANDB_MODE", "WANDB_API_KEY", "WANDB_IDENTITY_TOKEN_FILE", "WANDB_BASE_URL"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.setenv("NETRC", str(home / ".netrc"))
    monkeypatch.setenv("WANDB_CONFIG_DIR", str(home / "wandb"))
    wandb.teardown()
    yield
    wandb.teardown()


def test_wandb_without_credentials_is_refused_before_anything_is_written(no_wandb_login, tmp_path, corpus_file, capsys):
    run_dir = tmp_path / "run"
    args = [*RUN, f"data.path={corpus_file}", "train.steps=1", f"run.dir={run_dir}", "logging.wandb=true"]
    with unchanged(tmp_path):
        assert main(["train", *args]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.splitlines()) == 1
    assert err.startswith("optimus: error: logging.wandb=true, but no W&B API key is configured for ")
    assert "WANDB_MODE=offline" in err and "wandb login" in err and not run_dir.exists()


def test_wandb_is_accepted_with_a_key_or_offline_and_refused_when_missing(no_wandb_login, monkeypatch):
    import wandb

    monkeypatch.setenv("WANDB_API_KEY", "k" * 40)  # its form only: the check never asks the server
    assert wandb_refusal() is None
    wandb.teardown()
    monkeypatch.delenv("WANDB_API_KEY")
    monkeypatch.setenv("WANDB_MODE", "offline")  # needs no key
    assert wandb_refusal() is None
    monkeypatch.setitem(sys.modules, "wandb", None)  # as if it were not installed
    assert "needs the wandb package, which is not installed: pip install wandb" in str(wandb_refusal())
