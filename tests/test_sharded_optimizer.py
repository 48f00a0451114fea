"""Sharded AdamW (ep_aware / standard, ZeRO-1 / ZeRO-2) against one process with torch's AdamW.

Every layout trains a tiny MoE model for 10 steps on fixed random token batches,
each rank taking its micro-batches as the data contract says (the global batch
cut into micro-batches in order, rank r takes [r*A, (r+1)*A)). The reference is
one process, same init, every micro-batch accumulated, clip_grad_norm_ and
torch.optim.AdamW. Clipping triggers on every step.
"""

from __future__ import annotations

import importlib.util
import math

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F

from optimus.config import ModelConfig, MoEConfig, OptimConfig, ParallelConfig
from optimus.model import Transformer
from optimus.optim import ShardedAdamW, lr_at
from optimus.optim.replicated import param_groups
from optimus.parallel import build_parallel_state, parallelize_model
from tests.distributed import run_distributed

STEPS, SEQ, MICRO, GLOBAL_MICRO_BATCHES = 10, 16, 2, 8
GRAD_CLIP = 0.2  # below every step's norm, so clipping always acts
MODEL = ModelConfig(
    n_layers=2, dim=32, n_heads=4, n_kv_heads=2, vocab_size=128, ffn_dim=64,
    moe=MoEConfig(n_experts=4, top_k=2, expert_dim=32, aux_loss_coef=0.01, z_loss_coef=0.001),
)  # fmt: skip
HAS_EP = importlib.util.find_spec("optimus.parallel.expert_parallel") is not None


def optim_cfg(zero: int, bucket_mb: float = 32.0, max_numel: int = 256 * 1024 * 1024) -> OptimConfig:
    return OptimConfig(
        lr=3e-3, warmup_steps=3, weight_decay=0.1, zero=zero, bucket_mb=bucket_mb, max_collective_numel=max_numel
    )


def batches() -> torch.Tensor:
    """[steps, micro-batches of the global batch, micro_batch, seq + 1] token windows."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(0, MODEL.vocab_size, (STEPS, GLOBAL_MICRO_BATCHES, MICRO, SEQ + 1), generator=g)


def new_model(dtype: torch.dtype = torch.float32) -> Transformer:
    model = Transformer(MODEL, kernels="torch")
    model.init_weights(torch.Generator().manual_seed(0))
    return model.to(dtype)


def loss_of(model: Transformer, batch_BS1: torch.Tensor) -> torch.Tensor:
    out = model(batch_BS1[:, :-1])
    lm = F.cross_entropy(out.logits_BSV.flatten(0, 1).float(), batch_BS1[:, 1:].reshape(-1))
    return lm + MODEL.moe.aux_loss_coef * out.aux_loss + MODEL.moe.z_loss_coef * out.z_loss


def reference(skip_steps: tuple[int, ...] = ()) -> dict:
    """One process: all micro-batches accumulated, clip_grad_norm_, torch.optim.AdamW; `skip_steps` get no update."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # tiny matrices: more threads only contend with the ranks of the tests
    try:
        return _reference(skip_steps)
    finally:
        torch.set_num_threads(threads)


def _reference(skip_steps: tuple[int, ...]) -> dict:
    model, cfg = new_model(), optim_cfg(1)
    named = list(model.named_parameters())
    opt = torch.optim.AdamW(param_groups(named, cfg.weight_decay), lr=cfg.lr, betas=(cfg.beta1, cfg.beta2), eps=cfg.eps)
    losses, norms = [], []
    for step, micro_batches in enumerate(batches()):
        total = 0.0
        for mb in micro_batches:
            loss = loss_of(model, mb)
            (loss / GLOBAL_MICRO_BATCHES).backward()
            total += loss.item()
        norms.append(torch.nn.utils.clip_grad_norm_(model.parameters(), GRAD_CLIP).item())
        for group in opt.param_groups:
            group["lr"] = lr_at(step, cfg, STEPS)
        if step not in skip_steps:
            opt.step()
        opt.zero_grad()
        losses.append(total / GLOBAL_MICRO_BATCHES)
    return {"losses": losses, "norms": norms, "params": {n: p.detach().clone() for n, p in named}}


def train_sharded(
    ep: int, scheme: str, cfg: OptimConfig, dtype=torch.float32, poison_rank: int | None = None, resume_cfg=None
) -> dict:
    """Body run on every rank: 10 steps of the layout; returns this rank's slice of the model and the curves.

    `poison_rank` makes that rank's step-0 loss NaN. `resume_cfg`: halfway, rebuild model and optimizer
    with this config and continue from the merged state_dict of every rank (a reshard when buckets differ).
    """
    ps = build_parallel_state(ep)
    model = new_model(dtype)
    parallelize_model(model, ps, ParallelConfig(ep=ep))
    opt = ShardedAdamW(model, cfg, ps, GRAD_CLIP, scheme)
    accum = GLOBAL_MICRO_BATCHES // ps.world_size
    losses, norms = [], []
    for step, micro_batches in enumerate(batches()):
        if resume_cfg is not None and step == STEPS // 2:
            model, opt = resume(model, opt, ps, ep, dtype, resume_cfg, scheme)
        mine = micro_batches[ps.rank * accum : (ps.rank + 1) * accum]
        total = torch.zeros(())
        for i, mb in enumerate(mine):
            opt.set_last_micro_batch(i == accum - 1)
            loss = loss_of(model, mb)
            if poison_rank == ps.rank and step == 0:
                loss = loss * float("nan")
            (loss / accum).backward()
            total += loss.detach().float()
            if cfg.zero == 2:  # reductions start in the hooks of the last backward only, and take the grads away
                launched = [g.next_launch for g in opt.groups.values()]
                assert launched == ([len(g.flat.buckets) for g in opt.groups.values()] if i == accum - 1 else [0, 0])
                assert all((p.grad is None) == (i == accum - 1) for p in model.parameters())
        dist.all_reduce(total)
        norms.append(opt.step(lr_at(step, cfg, STEPS)))
        opt.zero_grad()
        losses.append(total.item() / GLOBAL_MICRO_BATCHES)
    return {"losses": losses, "norms": norms, "params": local_params(model), "memory": opt.memory_bytes()}


def resume(model, opt, ps, ep, dtype, cfg, scheme):
    """A fresh model and optimizer (another bucket layout) that continue from the saved state of every rank."""
    states = [None] * ps.world_size
    dist.all_gather_object(states, opt.state_dict())
    merged = {"step": states[0]["step"], "shards": {k: v for s in states for k, v in s["shards"].items()}}
    fresh = new_model(dtype)
    parallelize_model(fresh, ps, ParallelConfig(ep=ep))
    fresh.load_state_dict(model.state_dict())
    new_opt = ShardedAdamW(fresh, cfg, ps, GRAD_CLIP, scheme)
    new_opt.load_state_dict(merged)
    return fresh, new_opt


def local_params(model: Transformer) -> dict:
    """name -> (fp32 tensor, first global expert index or None for dense)."""
    out = {}
    for name, p in model.named_parameters():
        module_name, _, _ = name.rpartition(".")
        offset = getattr(model.get_submodule(module_name), "expert_offset", None) if ".experts." in name else None
        out[name] = (p.detach().float().numpy().copy(), offset)  # numpy: tensors would go back through shared memory
    return out


def assemble(rank_results: list[dict]) -> dict:
    """Full parameters from every rank's slices (experts concatenated in global expert order)."""
    pieces: dict[str, dict] = {}
    for res in rank_results:
        for name, (tensor, offset) in res["params"].items():
            pieces.setdefault(name, {})[offset] = torch.from_numpy(tensor)
    return {
        n: by_off[None] if None in by_off else torch.cat([by_off[k] for k in sorted(by_off)])
        for n, by_off in pieces.items()
    }


def run_layouts(layouts: list[tuple]) -> list[list[dict]]:
    """Body: several (ep, scheme, cfg, ...) layouts in one process group, to pay the spawn once."""
    return [train_sharded(*layout) for layout in layouts]


def rel(a: float, b: float) -> float:
    return abs(a - b) / max(abs(b), 1e-12)


def assert_matches(rank_results: list[dict], ref: dict, tol: float = 1e-5) -> None:
    for res in rank_results:
        for step, (loss, norm) in enumerate(zip(res["losses"], res["norms"])):
            assert rel(loss, ref["losses"][step]) < tol, f"step {step}: loss {loss} vs {ref['losses'][step]}"
            assert rel(norm, ref["norms"][step]) < tol, f"step {step}: grad norm {norm} vs {ref['norms'][step]}"
    params = assemble(rank_results)
    assert params.keys() == ref["params"].keys()
    for name, ref_p in ref["params"].items():
        err = (params[name] - ref_p).norm() / ref_p.norm()
        assert err < tol, f"{name}: relative error {err:.2e} after {STEPS} steps"


@pytest.fixture(scope="module")
def ref() -> dict:
    result = reference()
    assert min(result["norms"]) > GRAD_CLIP, "the test needs clipping to act on every step"
    return result


SCHEME_ZERO = [("ep_aware", 1), ("ep_aware", 2), ("standard", 1), ("standard", 2)]


def test_dp2_matches_single_process(ref):
    # ZeRO-2 with tiny buckets and ZeRO-1 with a tiny collective limit: many buckets, parameters split across them.
    cfgs = {1: optim_cfg(1, max_numel=3000), 2: optim_cfg(2, bucket_mb=0.01)}
    layouts = [(1, scheme, cfgs[zero]) for scheme, zero in SCHEME_ZERO]
    per_rank = run_distributed(run_layouts, 2, layouts)
    for i in range(len(layouts)):
        assert_matches([r[i] for r in per_rank], ref)


@pytest.mark.skipif(not HAS_EP, reason="needs the expert-parallel dispatcher (optimus.parallel.expert_parallel)")
def test_world4_ep_layouts_match_single_process(ref):
    layouts = [(ep, scheme, optim_cfg(zero, bucket_mb=0.02)) for ep in (2, 4) for scheme, zero in SCHEME_ZERO]
    per_rank = run_distributed(run_layouts, 4, layouts, timeout_s=240)
    for i, layout in enumerate(layouts):
        try:
            assert_matches([r[i] for r in per_rank], ref)
        except AssertionError as err:
            raise AssertionError(f"layout ep={layout[0]} {layout[1]} zero={layout[2].zero}: {err}") from err


def test_bf16_params_track_fp32(ref):
    """bf16 parameters with an fp32 master shard follow the fp32 run loosely (bf16 weights, grads and reductions)."""
    per_rank = run_distributed(run_layouts, 2, [(1, "ep_aware", optim_cfg(2), torch.bfloat16)])
    res = per_rank[0][0]
    for step in range(STEPS):
        assert rel(res["losses"][step], ref["losses"][step]) < 1e-3
        assert rel(res["norms"][step], ref["norms"][step]) < 1e-2
    params = assemble([r[0] for r in per_rank])
    diff = torch.cat([(params[n] - p).flatten() for n, p in ref["params"].items()])
    assert diff.norm() / torch.cat([p.flatten() for p in ref["params"].values()]).norm() < 2e-2
    for name, ref_p in ref["params"].items():  # routed experts drift most: bf16 rounding flips some routes
        assert (params[name] - ref_p).norm() / ref_p.norm() < 0.1, name
    # fp32 master + two fp32 moments: 12 bytes per owned element, half of the model per rank.
    formula = 12 * sum(p.numel() for p in ref["params"].values()) / 2
    assert formula <= res["memory"]["optim_state_bytes"] <= formula + res["memory"]["padding_bytes"]


def test_non_finite_grad_skips_the_step_on_every_rank():
    """A NaN loss on one rank: every rank gets a NaN norm and no update; then it matches a reference that skipped it."""
    per_rank = run_distributed(run_layouts, 2, [(1, "ep_aware", optim_cfg(2), torch.float32, 1)])
    ref = reference(skip_steps=(0,))
    for res in per_rank:
        assert math.isnan(res[0]["norms"][0]) and math.isnan(res[0]["losses"][0])
        res[0]["norms"][0], res[0]["losses"][0] = ref["norms"][0], ref["losses"][0]
    assert_matches([r[0] for r in per_rank], ref)


def test_state_dict_resumes_in_another_bucket_layout(ref):
    """Halfway through, state_dict of every rank -> fresh model and optimizer with other buckets -> same end point."""
    layouts = [(1, "ep_aware", optim_cfg(1), torch.float32, None, optim_cfg(2, bucket_mb=0.005))]
    per_rank = run_distributed(run_layouts, 2, layouts)
    assert_matches([r[0] for r in per_rank], ref)
