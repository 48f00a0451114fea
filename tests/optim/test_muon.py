"""optim.update=muon against one process with torch.optim.Muon and torch.optim.AdamW.

The reference holds every hidden matrix as its own 2-D tensor in nn.Linear's [out, in] orientation (attention
wq, wk, wv, wo; each routed expert's gate, up and down; dense and shared FFN weights) and steps it with
torch.optim.Muon (match_rms_adamw), and steps the embedding, the LM head, the router and the norms with
torch.optim.AdamW; the gradient norm is computed in fp64 and clipping acts on every step. The sharded runs
(tests/optim/test_sharded_optimizer.py's harness) split parameters across buckets and ranks, so matrices straddle
shard boundaries and are gathered whole.
"""

from __future__ import annotations

import dataclasses
from contextlib import contextmanager
from unittest import mock

import pytest
import torch
import torch.optim._muon as torch_muon_module  # the reference's Newton-Schulz function

from optimus.config import ParallelConfig
from optimus.optim import ShardedMuon, lr_at
from optimus.optim.muon import NS_COEFFICIENTS, newton_schulz
from optimus.parallel import build_parallel_state, parallelize_model
from tests.distributed import run_distributed
from tests.optim.test_sharded_optimizer import (
    GLOBAL_MICRO_BATCHES,
    GRAD_CLIP,
    HAS_EP,
    STEPS,
    assemble,
    assert_each_layout_matches,
    assert_matches,
    backward_micro_batches,
    batches,
    fp64_norm,
    local_params,
    loss_of,
    new_model,
    optim_cfg,
    param_groups,
    run_layouts,
)
from tests.trajectories import assert_same_trajectory

ADAMW_ONLY = ("embed.weight", "lm_head.weight", "router.gate.weight")
# Newton-Schulz in torch's bf16 (`BF16`): a 1e-7 difference in a momentum element (the clip factor from an fp32
# norm here and an fp64 one there, another reduction order) can move its bf16 rounding by one unit and the whole
# orthogonalised update of its matrix with it, so over 8 steps the gradient norm is compared within 5e-5 and the
# parameters within 2^-8 (bf16's spacing); measured at most 1.3e-5 and 1.1e-3 (one step alone agrees within
# 4e-9). In fp32 (`optim.muon_ns_dtype=fp32`, the reference running torch's own iteration in fp32) the layouts
# are held to 1e-5 like AdamW's.
ONE_STEP_LR = 1e-2
BF16 = {"norm_tol": 5e-5, "param_tol": 2**-8}
FP32 = {"norm_tol": 1e-5, "param_tol": 1e-5}


def muon_cfg(zero: int = 1, ns_dtype: str = "fp32", **kw):
    return dataclasses.replace(optim_cfg(zero, **kw), update="muon", muon_ns_dtype=ns_dtype)


@contextmanager
def torch_muon_in(ns_dtype: str):
    """torch.optim.Muon with its own Newton-Schulz function run in `ns_dtype`: the function casts its input with
    Tensor.bfloat16, which for fp32 becomes a copy in fp32 while it runs."""
    if ns_dtype == "bf16":
        yield
        return
    original = torch_muon_module._zeropower_via_newtonschulz

    def in_fp32(grad, *args):
        with mock.patch.object(torch.Tensor, "bfloat16", lambda t: t.float().clone()):
            return original(grad, *args)

    with mock.patch.object(torch_muon_module, "_zeropower_via_newtonschulz", in_fp32):
        yield


def hidden_matrices(name: str, p: torch.Tensor) -> list[torch.Tensor]:
    """The [out, in] views of `p` that Muon steps (none for the embedding, head, router and vectors)."""
    if p.dim() < 2 or name.endswith(ADAMW_ONLY):
        return []
    if name.endswith("experts.w13"):  # [E, D, 2F]: gate = first F columns
        f = p.shape[-1] // 2
        return [m for e in range(p.shape[0]) for m in (p[e, :, :f].T, p[e, :, f:].T)]
    if name.endswith("experts.w2"):  # [E, F, D]
        return [p[e].T for e in range(p.shape[0])]
    return [p]


def muon_reference(n_micro_batches: int = GLOBAL_MICRO_BATCHES, ns_dtype: str = "fp32") -> dict:
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        with torch_muon_in(ns_dtype):
            return _muon_reference(n_micro_batches, ns_dtype)
    finally:
        torch.set_num_threads(threads)


class TorchMuonAdamW:
    """The reference's optimizers over `model`: torch.optim.Muon on a 2-D copy of every hidden matrix, and
    torch.optim.AdamW on the other parameters."""

    def __init__(self, model, cfg, lr: float):
        self.named = list(model.named_parameters())
        views = {n: hidden_matrices(n, p.detach()) for n, p in self.named}
        self.leaves = {n: [v.clone().requires_grad_() for v in vs] for n, vs in views.items() if vs}
        self.muon = torch.optim.Muon(
            [leaf for ls in self.leaves.values() for leaf in ls], lr=lr, weight_decay=cfg.weight_decay,
            momentum=cfg.muon_momentum, nesterov=True, adjust_lr_fn="match_rms_adamw",
        )  # fmt: skip
        rest = [(n, p) for n, p in self.named if n not in self.leaves]
        self.adamw = torch.optim.AdamW(
            param_groups(rest, cfg.weight_decay), lr=lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps
        )

    @torch.no_grad()
    def step(self, lr: float) -> float:
        """Clip the accumulated gradients by their fp64 norm, step both optimizers, copy the matrices back;
        returns the norm."""
        norm = fp64_norm(p for _, p in self.named)
        for _, p in self.named:
            p.grad.mul_(min(1.0, GRAD_CLIP / (norm + 1e-6)))
        for n, p in self.named:
            for leaf, grad in zip(self.leaves.get(n, []), hidden_matrices(n, p.grad)):
                leaf.grad = grad.clone()
        for opt in (self.muon, self.adamw):
            for group in opt.param_groups:
                group["lr"] = lr
            opt.step()
            opt.zero_grad()
        for n, p in self.named:
            for leaf, view in zip(self.leaves.get(n, []), hidden_matrices(n, p)):
                view.copy_(leaf)
        return norm


def _muon_reference(n_micro_batches: int, ns_dtype: str) -> dict:
    model, cfg = new_model(), muon_cfg(ns_dtype=ns_dtype)
    optimizers = TorchMuonAdamW(model, cfg, cfg.lr)
    losses, norms = [], []
    for step, micro_batches in enumerate(batches()[:, :n_micro_batches]):
        total = backward_micro_batches(model, micro_batches)
        norms.append(optimizers.step(lr_at(step, cfg, STEPS)))
        model.zero_grad()
        losses.append(total / n_micro_batches)
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in model.named_parameters()}}


@pytest.fixture(scope="module")
def muon_refs() -> dict[tuple[int, str], dict]:
    """The reference's runs by (micro-batches, Newton-Schulz dtype)."""
    keys = [(4, "fp32"), (GLOBAL_MICRO_BATCHES, "fp32"), (GLOBAL_MICRO_BATCHES, "bf16")]
    out = {(n, dtype): muon_reference(n, dtype) for n, dtype in keys}
    assert min(min(r["norms"]) for r in out.values()) > GRAD_CLIP, "the test needs clipping to act on every step"
    return out


def test_newton_schulz_batches_torchs_iteration():
    """Bit for bit torch's own function in bf16; in fp32, torch's function made to run in fp32 (torch_muon_in)."""
    g = torch.Generator().manual_seed(3)
    for shape in ((48, 24), (24, 48), (32, 32)):
        mats = torch.randn(3, *shape, generator=g)
        strided = mats.transpose(-2, -1).contiguous().transpose(-2, -1)
        for ns_dtype, dtype in (("bf16", torch.bfloat16), ("fp32", torch.float32)):
            with torch_muon_in(ns_dtype):
                want = torch.stack(
                    [torch_muon_module._zeropower_via_newtonschulz(m, NS_COEFFICIENTS, 5, 1e-7) for m in mats]
                )
            got = newton_schulz(strided, 5, NS_COEFFICIENTS, dtype)
            assert got.dtype == want.dtype == dtype
            torch.testing.assert_close(
                got, want, rtol=0 if ns_dtype == "bf16" else 1e-5, atol=0 if ns_dtype == "bf16" else 1e-6
            )


def one_step(layouts: list[tuple]) -> list[dict]:
    """Body: for each (scheme, optimizer config), one step of the whole global batch at lr 1e-2 from the same start;
    this rank's parameters after it."""
    out = []
    for scheme, cfg in layouts:
        ps = build_parallel_state(1)
        model = new_model()
        parallelize_model(model, ps, ParallelConfig())
        accum = GLOBAL_MICRO_BATCHES // ps.world_size
        opt = ShardedMuon(model, cfg, ps, GRAD_CLIP, scheme, micro_batches=accum)
        for mb in batches()[0, ps.rank * accum : (ps.rank + 1) * accum]:
            (loss_of(model, mb, accum) / accum).backward()
        opt.step(ONE_STEP_LR)
        out.append({"params": local_params(model)})
    return out


def one_step_reference(ns_dtype: str) -> dict[str, torch.Tensor]:
    model = new_model()
    for mb in batches()[0]:
        (loss_of(model, mb, GLOBAL_MICRO_BATCHES) / GLOBAL_MICRO_BATCHES).backward()
    with torch_muon_in(ns_dtype):
        TorchMuonAdamW(model, muon_cfg(ns_dtype=ns_dtype), ONE_STEP_LR).step(ONE_STEP_LR)
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("world, ns_dtype, tol", [(1, "bf16", 1e-6), (2, "bf16", 2e-3), (2, "fp32", 1e-6)])
def test_one_step_equals_torch_muon(world, ns_dtype, tol):
    """One step, before rounding differences compound. One process: every parameter within 1e-6 of the reference's.
    Two ranks (every scheme and ZeRO stage, buckets small enough that matrices straddle them and the ranks): the
    gradients are summed in another order, and in bf16 a momentum element one fp32 unit apart can round to another
    bf16 value in Newton-Schulz; measured, that moves a matrix's update by up to 1.3% (3e-4 of the matrix), while a
    wrong matrix (w13 taken whole instead of gate and up) puts it 5e-2 off: within 2e-3 there. In fp32: 1e-6."""
    if world == 1:
        layouts = [("none", muon_cfg(1, ns_dtype))]
    else:
        cfgs = {1: muon_cfg(1, ns_dtype, max_numel=3000), 2: muon_cfg(2, ns_dtype, bucket_mb=0.01)}
        layouts = [(scheme, cfgs[zero]) for scheme in ("none", "standard", "ep_aware") for zero in (1, 2)]
    want = one_step_reference(ns_dtype)
    per_rank = run_distributed(one_step, world, layouts)
    for i, (scheme, cfg) in enumerate(layouts):
        got = assemble([r[i] for r in per_rank])
        for name, ref_p in want.items():
            err = float((got[name] - ref_p).norm() / ref_p.norm())
            assert err < tol, f"{scheme} zero={cfg.zero}: {name} relative error {err:.1e}"


def test_one_process_matches_torch_muon(muon_refs):
    """scheme none on one rank, Newton-Schulz in torch's bf16: the sharded optimizer's Muon and AdamW split against
    torch's two optimizers as they come (BF16's tolerances)."""
    per_rank = run_distributed(run_layouts, 1, [(1, "none", muon_cfg(1, "bf16"))])
    assert_matches([r[0] for r in per_rank], muon_refs[GLOBAL_MICRO_BATCHES, "bf16"], **BF16)


def test_dp2_schemes_match_torch_muon(muon_refs):
    """Every scheme x ZeRO stage on two ranks, with buckets small enough that matrices straddle them (the layout
    tests run Newton-Schulz in fp32, against torch's own iteration in fp32, within 1e-5)."""
    cfgs = {1: muon_cfg(1, max_numel=3000), 2: muon_cfg(2, bucket_mb=0.01)}
    layouts = [(1, scheme, cfgs[zero]) for scheme in ("none", "standard", "ep_aware") for zero in (1, 2)]
    per_rank = run_distributed(run_layouts, 2, layouts)
    references = [muon_refs[GLOBAL_MICRO_BATCHES, "fp32"]] * len(layouts)
    labels = [f"{scheme} zero={cfg.zero}" for _, scheme, cfg in layouts]
    assert_each_layout_matches(per_rank, references, labels, **FP32)


@pytest.mark.skipif(not HAS_EP, reason="needs the expert-parallel dispatcher (optimus.parallel.expert_parallel)")
def test_world4_expert_parallel_matches_torch_muon(muon_refs):
    """ep 2 and 4, both dispatchers, ep_aware and standard, 1 or 2 micro-batches per rank."""
    layouts = [
        (ep, scheme, muon_cfg(zero, bucket_mb=0.02), torch.float32, None, None, dispatcher, n_mb)
        for ep, dispatcher, scheme, zero, n_mb in (
            (2, "alltoall", "ep_aware", 1, 4), (2, "allgather", "ep_aware", 2, GLOBAL_MICRO_BATCHES),
            (4, "alltoall", "standard", 2, 4), (4, "alltoall", "ep_aware", 2, GLOBAL_MICRO_BATCHES),
            (1, "alltoall", "ep_aware", 1, GLOBAL_MICRO_BATCHES),
        )
    ]  # fmt: skip
    per_rank = run_distributed(run_layouts, 4, layouts, timeout_s=600)
    assert_each_layout_matches(
        per_rank,
        [muon_refs[n_mb, "fp32"] for *_, n_mb in layouts],
        [
            f"ep={ep} {dispatcher} {scheme} zero={cfg.zero} accum={n_mb // 4}"
            for ep, scheme, cfg, *_, dispatcher, n_mb in layouts
        ],
        **FP32,
    )


@pytest.mark.skipif(not HAS_EP, reason="needs the expert-parallel dispatcher (optimus.parallel.expert_parallel)")
def test_hierarchical_sharding_matches_torch_muon(muon_refs):
    """optim.shard_ranks=2 on 4 ranks: each unit's owner is chosen in its shard group of 2 (the flat buffer's world),
    whose exchanges stay inside it; dense and experts split 2 x 2 (ep 1), or the dense group alone (ep 2)."""
    layouts = [
        (ep, "ep_aware", muon_cfg(zero, bucket_mb=0.02), torch.float32, None, None, "alltoall", n_mb, 2)
        for ep, zero, n_mb in ((1, 2, GLOBAL_MICRO_BATCHES), (2, 1, 4))
    ]
    per_rank = run_distributed(run_layouts, 4, layouts, timeout_s=600)
    assert_each_layout_matches(
        per_rank,
        [muon_refs[n_mb, "fp32"] for *_, n_mb, _ in layouts],
        [f"ep={ep} zero={cfg.zero} accum={n_mb // 4} shard_ranks=2" for ep, _, cfg, *_, n_mb, _ in layouts],
        **FP32,
    )


def test_resharded_resume_matches_torch_muon(muon_refs):
    """Halfway, a fresh model and optimizer with another bucket layout continue from the merged state."""
    first, then = muon_cfg(1, max_numel=3000), muon_cfg(2, bucket_mb=0.01)
    per_rank = run_distributed(run_layouts, 2, [(1, "ep_aware", first, torch.float32, None, then)])
    assert_matches([r[0] for r in per_rank], muon_refs[GLOBAL_MICRO_BATCHES, "fp32"], **FP32)


def test_pipeline_stages_match_one_process_through_optimus_train(tmp_path, corpus_file, single_threaded):
    """pp = 2 (1F1B, ep = 2, ZeRO-2) under `optimus train optim.update=muon`: each stage's sharder gathers and
    orthogonalises its own matrices; one process's trajectory (tests/trajectories.py; Newton-Schulz in fp32)."""
    from tests.parallel.test_pipeline import COMMON
    from tests.trajectories import step_records, train_layouts

    runs = {
        "nproc=1": [],
        "pp=2 ep=2 zero=2": ["parallel.nproc=4", "parallel.pp=2", "parallel.ep=2", "optim.zero=2",
                             "optim.bucket_mb=0.01"],
    }  # fmt: skip
    args = [
        *COMMON,
        "optim.update=muon",
        "optim.muon_ns_dtype=fp32",
        "optim.lr=3e-3",
        "data=text",
        f"data.path={corpus_file}",
    ]
    metrics, infos = train_layouts(tmp_path, runs, args)
    reference = metrics["nproc=1"]
    assert len({round(m["loss"], 6) for m in step_records(reference)}) == len(step_records(reference))  # it moves
    assert infos["pp=2 ep=2 zero=2"]["optim_update"] == "muon"
    assert_same_trajectory(metrics["pp=2 ep=2 zero=2"], reference, "pp=2 ep=2 zero=2")


def test_tensor_parallel_matches_one_process_through_optimus_train(tmp_path, corpus_file, single_threaded):
    """tp = 2 under `optimus train optim.update=muon`, with a dense first layer (w1/w3/w2 split too): each split
    matrix's owner gathers its tp peer's half, orthogonalises the whole and keeps its own half. Alone (one owner
    per group), and with dp 2 x ep 2, ZeRO-2 and buckets small enough that matrices straddle owners (both
    exchanges). One process's trajectory (tests/trajectories.py; Newton-Schulz in fp32)."""
    from optimus.plan import make_plan
    from optimus.recipes import load_config
    from tests.parallel.test_pipeline import COMMON
    from tests.trajectories import step_records, train_layouts

    runs = {
        "nproc=1": [],
        "tp=2 sp": ["parallel.nproc=2", "parallel.tp=2"],
        "tp=2 ep=2 no sp, zero=2": ["parallel.nproc=4", "parallel.tp=2", "parallel.ep=2", "parallel.sp=false",
                                    "optim.zero=2", "optim.bucket_mb=0.01"],
    }  # fmt: skip
    args = [*COMMON, "model.first_k_dense=1", "optim.update=muon", "optim.muon_ns_dtype=fp32", "optim.lr=3e-3",
            "data=text",
            f"data.path={corpus_file}"]  # fmt: skip
    metrics, infos = train_layouts(tmp_path, runs, args)
    reference = metrics.pop("nproc=1")
    assert len({round(m["loss"], 6) for m in step_records(reference)}) == len(step_records(reference))  # it moves
    for layout, run in metrics.items():
        assert infos[layout]["optim_update"] == "muon"
        assert_same_trajectory(run, reference, layout)
    # the tp peers' halves travel: four ranks report what their exchanges and tp gathers received
    assert all(r["gather_received_bytes"] > 0 for r in infos["tp=2 ep=2 no sp, zero=2"]["per_rank"])
    for layout, info in infos.items():  # `optimus plan` sizes the busiest rank of the real layout
        cfg = load_config([*args, *runs[layout]])
        planned = make_plan(cfg, cfg.parallel.nproc).update
        for key in ("step_work_bytes", "gather_received_bytes"):
            assert max(r[key] for r in info["per_rank"]) == planned[key], (layout, key)
