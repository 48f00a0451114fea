"""Every private torch API Optimus uses (optimus/kernels/torch_private.py) exists in this torch and behaves as used.

torch renames private names without a deprecation; these tests fail by name, saying where Optimus uses the name
and what to update, instead of a training run, a dry run or a profile failing somewhere later. CI runs them on
the oldest torch pyproject.toml allows and on the newest pip resolves.
"""

from __future__ import annotations

import ast
import inspect
import subprocess
import sys
from pathlib import Path

import pytest
import torch

import optimus
from optimus.kernels import torch_private as tp

PRIVATE = tp.PRIVATE_API


def moved(name: str) -> str:
    return PRIVATE[name].moved()


@pytest.mark.parametrize("name", sorted(PRIVATE))
def test_every_private_name_is_where_optimus_looks(name):
    assert tp.found(name), moved(name)


def test_a_missing_class_is_a_stand_in_that_names_it():
    # What a torch without MemTracker gives step_memory.py: subclassing works, using it says what moved.
    stand_in = tp._stand_in("MemTracker")

    class Sub(stand_in):
        pass

    with pytest.raises(tp.PrivateTorchMissing, match=r"mem_tracker\.MemTracker.*optimus/train/step_memory\.py"):
        Sub()
    assert not isinstance(torch.zeros(1), tp._stand_in("FakeTensor"))


# ---- kernels


def _grouped_problem(dtype):
    gen = torch.Generator().manual_seed(0)
    counts = [3, 0, 5, 8]  # an expert without rows
    offsets_E = torch.tensor(counts).cumsum(0).to(torch.int32)
    x_AK = torch.randn(sum(counts), 16, generator=gen).to(dtype)
    w_EKN = torch.randn(len(counts), 16, 24, generator=gen).to(dtype)
    g_AN = torch.randn(sum(counts), 24, generator=gen).to(dtype)
    return counts, offsets_E, x_AK, w_EKN, g_AN


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_mm_on_cpu_equals_a_loop_of_matmuls(dtype):
    """Both forms the torch backend calls: rows grouped by offsets times a weight per group, and the weight
    gradient form [K, A] x [A, N] -> [E, K, N]."""
    assert tp.grouped_mm is not None, moved("grouped_mm")
    counts, offsets_E, x_AK, w_EKN, g_AN = _grouped_problem(dtype)
    bounds = [0, *offsets_E.tolist()]
    y_AN = tp.grouped_mm(x_AK, w_EKN, offs=offsets_E)
    dw_EKN = tp.grouped_mm(x_AK.t(), g_AN, offs=offsets_E)
    x, w, g = x_AK.float(), w_EKN.float(), g_AN.float()
    want_y = torch.cat([x[lo:hi] @ w[e] for e, (lo, hi) in enumerate(zip(bounds[:-1], bounds[1:]))])
    want_dw = torch.stack([x[lo:hi].t() @ g[lo:hi] for lo, hi in zip(bounds[:-1], bounds[1:])])
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    assert y_AN.shape == want_y.shape and dw_EKN.shape == want_dw.shape, moved("grouped_mm")
    assert torch.allclose(y_AN.float(), want_y, rtol=tol, atol=tol * 4), moved("grouped_mm")
    assert torch.allclose(dw_EKN.float(), want_dw, rtol=tol, atol=tol * 4), moved("grouped_mm")
    assert dw_EKN[1].abs().max() == 0  # no rows, zero gradient


def test_grouped_mm_is_the_public_name_where_torch_has_it():
    public = getattr(torch.nn.functional, "grouped_mm", None)
    assert public is not None, (
        f"torch {torch.__version__} has no torch.nn.functional.grouped_mm: Optimus falls back to torch._grouped_mm "
        "(private). Check optimus/kernels/torch_private.py."
    )
    assert tp.grouped_mm is public


def test_grouped_mm_runs_on_fake_tensors():
    """A dry run's bf16 expert GEMMs run on fake tensors (the meta kernel; fp32 is answered by torch_backend)."""
    with tp.FakeTensorMode():
        x_AK, w_EKN = torch.empty(16, 32, dtype=torch.bfloat16), torch.empty(4, 32, 48, dtype=torch.bfloat16)
        offsets_E = torch.empty(4, dtype=torch.int32)
        y_AN = tp.grouped_mm(x_AK, w_EKN, offs=offsets_E)
    assert isinstance(y_AN, tp.FakeTensor) and y_AN.shape == (16, 48), moved("grouped_mm")


# ---- optimizer


def test_fused_adamw_on_cpu_equals_torch_adamw():
    """The fused kernel as optimus/optim/adamw.py calls it (keyword for keyword), where torch lists the CPU as
    having it, against torch.optim.AdamW's single-tensor step."""
    devices = tp._get_fused_kernels_supported_devices()
    assert isinstance(devices, list) and "cuda" in devices, moved("_get_fused_kernels_supported_devices")
    if "cpu" not in devices:
        pytest.skip(f"torch {torch.__version__} has no fused AdamW on CPUs: Optimus takes the single-tensor path")
    assert tp.fused_adamw_ is not None, moved("fused_adamw_")
    gen = torch.Generator().manual_seed(0)
    p, g = torch.randn(64, generator=gen), torch.randn(64, generator=gen)
    m, v = torch.randn(64, generator=gen) * 0.1, torch.rand(64, generator=gen) * 0.1
    ref = p.clone().requires_grad_()
    opt = torch.optim.AdamW([ref], lr=1e-2, betas=(0.9, 0.95), eps=1e-8, weight_decay=0.1, foreach=False)
    opt.state[ref] = {"step": torch.tensor(4.0), "exp_avg": m.clone(), "exp_avg_sq": v.clone()}
    ref.grad = g.clone()
    opt.step()
    step = torch.tensor(5.0)  # the kernel increments it, as adamw.py relies on
    tp.fused_adamw_(
        [p], [g], [m], [v], [], [step],
        lr=1e-2, beta1=0.9, beta2=0.95, weight_decay=0.1, eps=1e-8,
        amsgrad=False, maximize=False, grad_scale=None, found_inf=None,
    )  # fmt: skip
    assert torch.allclose(p, ref.detach(), rtol=1e-5, atol=1e-6), moved("fused_adamw_")


# ---- fake tensors, dispatch modes, trackers


def test_fake_tensor_mode_makes_fake_tensors_of_shapes_alone():
    real = torch.randn(3, 4)
    with tp.FakeTensorMode(allow_non_fake_inputs=True):
        x = torch.empty(6, 4)
        y = (x @ real.t())[2:]
        assert isinstance(x, tp.FakeTensor) and isinstance(y, tp.FakeTensor), moved("FakeTensorMode")
        assert y.shape == (4, 3) and y.storage_offset() == 6, moved("FakeTensor")
        assert y.new_empty(2, 2).shape == (2, 2)


class _Ops(tp.TorchDispatchMode):
    """Records each aten/c10d operator's (namespace, name, argument names) as host_syncs.py and
    collective_trace.py read them."""

    def __init__(self):
        super().__init__()
        self.seen = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        names = [a.name for a in func._schema.arguments]
        self.seen.append((func.namespace, func.overloadpacket.__name__, func._overloadpacket.__name__, names, func))
        return func(*args, **(kwargs or {}))


def test_a_dispatch_mode_sees_aten_ops_and_item_is_local_scalar_dense():
    with _Ops() as ops:
        t = torch.ones(3) * 2
        value = t.sum().item()
    assert value == 6.0
    assert ("aten", "mul", "mul", ["self", "other"]) in [s[:4] for s in ops.seen], moved("TorchDispatchMode")
    assert ops.seen[-1][4] is tp.LOCAL_SCALAR_DENSE, moved("LOCAL_SCALAR_DENSE")


def test_host_syncs_names_aten_ops_that_exist():
    """host_syncs.py recognises value reads by aten op names (some private, like `_unique2`): each must exist."""
    from optimus import host_syncs

    missing = [name for name in sorted(host_syncs._SYNCING_OPS) if not hasattr(torch.ops.aten, name)]
    assert not missing, f"torch {torch.__version__} has no aten op(s) {missing}: update optimus/host_syncs.py"


def test_mod_tracker_names_the_module_and_the_pass():
    inner = torch.nn.Linear(4, 4)
    outer = torch.nn.Sequential(inner)
    seen = []
    inner.register_forward_pre_hook(lambda m, i: seen.append(("forward", set(tracker.parents), tracker.is_bw)))
    inner.register_full_backward_hook(lambda m, gi, go: seen.append(("backward", set(tracker.parents), tracker.is_bw)))
    tracker = tp.ModTracker()
    with tracker:
        outer(torch.randn(2, 4, requires_grad=True)).sum().backward()
        fqn = tracker.get_known_fqn(inner)
    assert fqn == "Sequential.0", moved("ModTracker")
    assert ("forward", {"Global", "Sequential", "Sequential.0"}, False) in seen, moved("ModTracker")
    assert any(phase == "backward" and "Sequential.0" in parents and is_bw for phase, parents, is_bw in seen), moved(
        "ModTracker"
    )


def test_mem_tracker_calls_the_methods_optimus_overrides():
    """optimus/train/step_memory.py overrides MemTracker's `_track`, `_update_peak_stats` and its module hooks
    (`_pre_fw_hook`, `_post_fw_hook`, `_pre_bw_hook`, `_post_bw_hook`) and reads `_curr_mem_snap`, `_peak_mem`,
    `_peak_mem_snap`, `_mod_tracker`, `memory_tracking`, `_ac_mod` and `_in_ac`: a rename would leave its
    overrides silently unused."""
    from optimus.kernels.torch_private import _TOTAL_KEY, MemTracker

    overridden = {"_track": ["reftype", "t"], "_update_peak_stats": ["peak_state"],
                  "_pre_fw_hook": ["module", "inputs"], "_post_fw_hook": ["module", "inputs", "outputs"],
                  "_pre_bw_hook": ["module", "args"], "_post_bw_hook": ["module", "args"]}  # fmt: skip
    for method, params in overridden.items():
        assert list(inspect.signature(getattr(MemTracker, method)).parameters)[1:] == params, moved("MemTracker")
    assert {"memory_tracking", "_ac_mod", "_in_ac"} <= set(vars(MemTracker())), moved("MemTracker")
    calls = []

    class Recording(MemTracker):
        def _track(self, reftype, t):
            calls.append("_track")
            super()._track(reftype, t)

        def _update_peak_stats(self, peak_state):
            calls.append("_update_peak_stats")
            assert all(_TOTAL_KEY in snap for snap in self._curr_mem_snap.values()), moved("_TOTAL_KEY")
            super()._update_peak_stats(peak_state)

        def _pre_fw_hook(self, module, inputs):
            calls.append("_pre_fw_hook")
            assert self._mod_tracker.get_known_fqn(module)
            super()._pre_fw_hook(module, inputs)

    model = torch.nn.Linear(8, 8)
    tracker = Recording()
    tracker.track_external(model)
    with tracker:
        model(torch.randn(4, 8)).sum().backward()
    assert {"_track", "_update_peak_stats", "_pre_fw_hook"} <= set(calls), moved("MemTracker")
    assert tracker._peak_mem and tracker._peak_mem_snap, moved("MemTracker")
    peak = tracker.get_tracker_snapshot("peak")
    assert all("Total" in snap and snap["Total"] > 0 for snap in peak.values())


def test_current_graph_task_id_says_whether_a_backward_runs():
    seen = []
    x = torch.ones(2, requires_grad=True)
    y = x * 3
    y.register_hook(lambda grad: seen.append(tp.current_graph_task_id()))
    y.sum().backward()
    assert tp.current_graph_task_id() == -1, moved("current_graph_task_id")
    assert seen and seen[0] != -1, moved("current_graph_task_id")


def test_is_view():
    stack = torch.zeros(4, 3)
    assert tp.is_view(stack[1]) and not tp.is_view(stack[1].clone()) and not tp.is_view(stack)


def test_the_dtensor_logger_is_where_the_gloo_message_comes_from():
    """platform.py filters one message of DTensor's private module by its logger's name."""
    from optimus.cpu_runtime import GLOO_ALLTOALL_FALLBACK

    module = pytest.importorskip(tp.DTENSOR_COLLECTIVE_LOGGER, reason=moved("DTENSOR_COLLECTIVE_LOGGER"))
    assert GLOO_ALLTOALL_FALLBACK in inspect.getsource(module), moved("DTENSOR_COLLECTIVE_LOGGER")


# ---- distributed internals

_FAKE_GROUP = """
import torch.distributed as dist
from optimus.kernels.torch_private import FakeStore, resolve_process_group

dist.init_process_group("fake", store=FakeStore(), rank=3, world_size=8)
world = dist.group.WORLD
assert resolve_process_group(world.group_name) is world
assert (dist.get_rank(), dist.get_world_size()) == (3, 8)
dist.destroy_process_group()
print("ok")
"""


def test_fake_process_group_and_group_names_resolve():
    """What a dry run does first (a fake group of 8 ranks, as rank 3) and what the collective trace does with
    each functional collective's group name. In a process of its own: a process has one default group."""
    done = subprocess.run([sys.executable, "-c", _FAKE_GROUP], capture_output=True, text=True, timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", (
        f"{moved('FakeStore')}\n{moved('resolve_process_group')}\n{done.stderr[-2000:]}"
    )


def test_the_elastic_launcher_keeps_its_processes_where_ranks_py_reads_them():
    from torch.multiprocessing import ProcessContext

    assert "processes" in inspect.signature(ProcessContext.__init__).parameters, moved("process_context")


# ---- no private torch name outside torch_private.py

_TORCH_NAMES = {"torch", "dist"}  # `import torch.distributed as dist`


def _private_uses(path: Path) -> set[str]:
    """Private torch modules imported and private attributes of `torch.` / `dist.` chains in one source file."""
    found = set()
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.ImportFrom) and node.module and node.module.split(".")[0] == "torch":
            parts = node.module.split(".") + [alias.name for alias in node.names]
            if any(p.startswith("_") and not p.startswith("__") for p in parts):
                found.add(f"from {node.module} import {', '.join(a.name for a in node.names)}")
        elif isinstance(node, ast.Import):
            found.update(f"import {a.name}" for a in node.names if a.name.startswith("torch") and "._" in a.name)
        elif isinstance(node, ast.Attribute):
            chain, base = [node.attr], node.value
            while isinstance(base, ast.Attribute):
                chain.append(base.attr)
                base = base.value
            if isinstance(base, ast.Name) and base.id in _TORCH_NAMES:
                chain = [base.id, *reversed(chain)]
                if any(p.startswith("_") and not p.startswith("__") for p in chain[1:]):
                    found.add(".".join(chain))
    # A chain's prefixes are attributes too: keep the longest.
    return {u for u in found if not any(other != u and other.startswith(u + ".") for other in found)}


def test_private_torch_names_are_used_through_torch_private_only():
    root = Path(optimus.__file__).parent
    uses = set()
    for path in sorted(root.rglob("*.py")):
        if path.name != "torch_private.py":
            rel = path.relative_to(root.parent).as_posix()
            uses.update((rel, use) for use in _private_uses(path))
    new = sorted(uses)
    assert not new, (
        "private torch API used outside optimus/kernels/torch_private.py (add it there, with its public "
        f"alternative, and import it from there): {new}"
    )
