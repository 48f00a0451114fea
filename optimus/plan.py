"""`optimus plan`: predicted memory per device and FLOPs per step of a recipe on a layout, before running it.

Persistent state per device (P_d dense, P_e routed-expert parameters, EP experts split
over the EP group; es / gs = bytes per parameter / gradient element, from train.dtype and
optim.grad_dtype), computed by the optimizer's own layout code
(optimus.optim.sharded.rank_state_bytes), so the figures equal what a run reports in
run_info.json (per_rank):

    sharding   owner ranks (dense, expert)   parameters          optimizer-owned shard N_o
    none       1, 1                          es (P_d + P_e/EP)   P_d + P_e/EP
    standard   DP, DP                        es (P_d + P_e/EP)   P_d/DP + P_e/world
    ep_aware   world, DP                     es (P_d + P_e/EP)   P_d/world + P_e/world

    gradients  ZeRO-1: gs x full local size (+ gs N_o when the owner ranks are > 1);
               ZeRO-2: gs N_o (the full gradient exists only during the last backward)
    master     4 N_o when parameters are bf16, else 0
    moments    8 N_o (two fp32 Adam moments)

Each flat group is padded to a multiple of (owner ranks x 128 bytes), counted exactly.

Activations saved for the backward of one micro-batch (t = micro_batch x seq_len tokens
on this rank, a = bytes per activation element: 2 for bf16, 4 for fp32), per token, counted
from what autograd actually saves with the torch kernels (fused SDPA: no S x S scores;
tests/train/test_activation_checkpointing.py measures them, and the peak, within 5%):

    norms         6 D a          both pre-norms: input, normalised input, output
    attention     (5 D + 4 D_kv) a + 4 n_heads   q/k before and after QK-norm, q/k/v and output of
                                 SDPA with its fp32 log-sum-exp, out-projection input
                                 (3 D + 2 D_kv without QK-norm; D_kv = n_kv_heads x head_dim)
    dense FFN     4 F_dense a    gate and up outputs, SiLU output, their product
    MoE FFN       router: 8 E + 28 K bytes (fp32 logits and probabilities, ids, row ids, weights;
                                 + 4 D for the router's fp32 input copy in bf16 runs)
                  2 K D a        the exchanged rows: expert inputs and expert outputs
                  4 K F a        the routed experts' SwiGLU (as the dense FFN, per routed copy)
                  4 F_s a        shared experts, F_s = n_shared x F
    head          3 D a + V (a + 4) + 16   final norm, logits, fp32 log-probabilities, ids

The peak is the larger of: everything kept plus the logits' gradient (4 V, + a V in bf16) as the
backward starts, and, for each block, what it and the blocks before it keep plus its largest
recomputed region, alive again during its backward.
train.activation_checkpointing (optimus/train/activation_checkpointing.py) removes parts:
selective drops attention (recomputing one layer's); full keeps only the input (D a) of a dense
block and drops attention, the expert SwiGLU and shared experts of an MoE block (the norms,
router and exchanged rows stay, since the exchange is never re-run). Under expert parallelism
each rank computes K x t routed rows on average (balanced routing; the busiest rank holds
`expert_load_imbalance` times more). Not included: allocator fragmentation and cached blocks,
collective buffers, temporaries of the optimizer step, and the different buffers of the Triton
kernels.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

import torch

from optimus.config import ConfigError, ModelConfig, OptimusConfig, qk_norm_mode, validate
from optimus.model import ParamCounts, count_params_of_config, flops_per_token, padded_vocab_size
from optimus.optim import SCHEMES, StateBytes, rank_state_bytes, resolve_sharding
from optimus.platform import resolve_dtype

DTYPE_BYTES = {"fp32": 4, "bf16": 2}
GIB = 2**30
STATE_KEYS = ("param_bytes", "grad_bytes", "master_bytes", "optim_state_bytes")  # persistent bytes per rank


def planned_dtype(cfg: OptimusConfig) -> str:
    """`train.dtype` as a run on `machine` resolves it: auto is bf16 on GPUs, and on CPUs with bf16 units."""
    device = cfg.machine.device
    if device == "auto":
        device = "xpu" if hasattr(torch, "xpu") and torch.xpu.is_available() else "cpu"
        device = "cuda" if torch.cuda.is_available() else device
    return resolve_dtype(cfg.train.dtype, device)


def state_bytes(cfg: OptimusConfig, scheme: str, counts: ParamCounts, world: int) -> StateBytes:
    """Persistent bytes of one rank under `scheme`, from the optimizer's own buffer layout."""
    es, gs = DTYPE_BYTES[planned_dtype(cfg)], DTYPE_BYTES[cfg.optim.grad_dtype]
    ep = cfg.parallel.ep
    return rank_state_bytes(scheme, counts.dense, counts.expert // ep, world, world // ep, es, gs, cfg.optim.zero)


def _layer_activations(m: ModelConfig, a: int) -> dict[str, int]:
    """Bytes per token that each part of a block keeps for the backward (see the module docstring)."""
    d, moe = m.dim, m.moe
    d_kv = m.n_kv_heads * (m.dim // m.n_heads)
    qk = 0 if qk_norm_mode(m.qk_norm) == "none" else 1
    k, f = moe.top_k, moe.expert_dim
    router_input = 4 * d if a != 4 else 0  # the router's fp32 copy of its input, in bf16 runs only
    return {
        "norms": 6 * d * a,  # both pre-norms: input, normalised input, output
        "attention": ((3 + 2 * qk) * d + (2 + 2 * qk) * d_kv) * a + 4 * m.n_heads,
        "dense_ffn": 4 * m.ffn_dim * a,
        "router": router_input + 8 * moe.n_experts + 8 * k + 20 * k,  # fp32 logits/probs, ids, row ids, weights
        "expert_rows": 2 * k * d * a,  # the exchanged rows: expert inputs and expert outputs
        "expert_mlp": 4 * k * f * a,
        "shared": 4 * moe.n_shared_experts * f * a,
        "block_input": d * a,
    }


def _block_activations(part: dict[str, int], is_moe: bool, checkpointing: str) -> tuple[int, int]:
    """(bytes per token a block keeps, bytes per token alive again while its largest region is recomputed)."""
    ffn = ("router", "expert_rows", "expert_mlp", "shared") if is_moe else ("dense_ffn",)
    kept = part["norms"] + part["attention"] + sum(part[name] for name in ffn)
    if checkpointing == "selective":
        return kept - part["attention"], part["attention"]
    if checkpointing == "full" and not is_moe:
        return part["block_input"], kept  # the whole block runs again
    if checkpointing == "full":
        regions = (part["attention"], part["expert_mlp"], part["shared"])  # one at a time, never the exchange
        return kept - sum(regions), max(regions)
    return kept, 0


def activation_bytes(
    m: ModelConfig, micro_batch: int, seq_len: int, act_bytes: int, checkpointing: str, recompute: bool = True
) -> int:
    """Peak bytes of activations for the backward of one micro-batch on one rank under
    `train.activation_checkpointing=checkpointing` (see the module docstring); without `recompute`,
    only what the forward keeps for the backward."""
    part = _layer_activations(m, act_bytes)
    n_dense = m.first_k_dense if m.moe.n_experts else m.n_layers
    blocks = [_block_activations(part, i >= n_dense, checkpointing) for i in range(m.n_layers)]
    vocab = padded_vocab_size(m.vocab_size)
    head = 3 * m.dim * act_bytes + vocab * (act_bytes + 4) + 16  # norm, logits, fp32 log-probs, ids
    kept = sum(block_kept for block_kept, _ in blocks) + head
    if not recompute:
        return micro_batch * seq_len * kept
    # The backward starts with everything kept plus the logits' gradient (fp32, and its cast in bf16);
    # block i is recomputed once the blocks after it and the head have freed theirs.
    peak = kept + vocab * (4 + (act_bytes if act_bytes != 4 else 0))
    below = 0
    for block_kept, block_recomputed in blocks:
        below += block_kept
        peak = max(peak, below + block_recomputed)
    return micro_batch * seq_len * peak


@dataclass
class Plan:
    model: str
    world: int
    dp: int
    ep: int
    sharding: str
    zero: int
    param_dtype: str  # also the compute dtype
    grad_dtype: str
    params: dict
    state: dict  # scheme -> StateBytes as a dict
    activations: dict  # micro-batch activations with / without checkpointing
    flops: dict
    memory: dict

    def as_dict(self) -> dict:
        return asdict(self)


def make_plan(cfg: OptimusConfig, world: int, counts: ParamCounts | None = None) -> Plan:
    validate(cfg, world)
    m, t, ep = cfg.model, cfg.train, cfg.parallel.ep
    counts = counts or count_params_of_config(m)
    state = {s: state_bytes(cfg, s, counts, world).rounded() for s in SCHEMES}
    compute = planned_dtype(cfg)
    act = {
        "micro_batch": t.micro_batch,
        "no_checkpointing": activation_bytes(m, t.micro_batch, t.seq_len, DTYPE_BYTES[compute], "none"),
        "selective": activation_bytes(m, t.micro_batch, t.seq_len, DTYPE_BYTES[compute], "selective"),
        "checkpointing": activation_bytes(m, t.micro_batch, t.seq_len, DTYPE_BYTES[compute], "full"),
        "configured": activation_bytes(m, t.micro_batch, t.seq_len, DTYPE_BYTES[compute], t.activation_checkpointing),
    }
    per_token = flops_per_token(counts, m, t.seq_len)
    per_step = per_token * t.global_batch * t.seq_len
    peak = cfg.machine.peak_flops
    flops = {
        "per_token": per_token,
        "per_step": per_step,
        "per_device_per_step": per_step / world,
        "peak_per_device": peak,
        "step_time_at_peak_s": per_step / world / peak if peak else None,
    }
    sharding = resolve_sharding(cfg.optim.sharding, world)
    chosen = sum(state[sharding][k] for k in STATE_KEYS)
    device = cfg.machine.memory_gb * GIB if cfg.machine.memory_gb else None
    memory = {"device_bytes": device}
    for key in ("no_checkpointing", "checkpointing", "configured"):
        total = chosen + act[key]
        memory[f"total_{key}"] = total
        memory[f"fits_{key}"] = None if device is None else total <= device
    return Plan(
        m.name, world, world // ep, ep, sharding, cfg.optim.zero, compute, cfg.optim.grad_dtype,
        counts.as_dict(), state, act, flops, memory,
    )  # fmt: skip


def _gib(n: float | None) -> str:
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def _fits(value: bool | None) -> str:
    return {None: "unknown (set machine.memory_gb)", True: "fits", False: "DOES NOT FIT"}[value]


def format_plan(plan: Plan) -> str:
    p, f, mem = plan.params, plan.flops, plan.memory
    lines = [
        f"model {plan.model}: {p['total'] / 1e9:.3f}B parameters ({p['active'] / 1e9:.3f}B active), "
        f"dense {p['dense'] / 1e9:.3f}B, experts {p['expert'] / 1e9:.3f}B",
        f"layout: world {plan.world} = DP {plan.dp} x EP {plan.ep}; params and compute {plan.param_dtype}, "
        f"grads {plan.grad_dtype}, fp32 master and moments, ZeRO-{plan.zero}",
        "",
        f"{'per device':<22}{'params':>12}{'grads':>12}{'fp32 master':>14}{'moments':>12}{'total':>12}",
    ]
    for scheme, s in plan.state.items():
        mark = " <- optim.sharding" if scheme == plan.sharding else ""
        total = sum(s[k] for k in STATE_KEYS)
        lines.append(
            f"  sharding={scheme:<11}{_gib(s['param_bytes']):>12}{_gib(s['grad_bytes']):>12}"
            f"{_gib(s['master_bytes']):>14}{_gib(s['optim_state_bytes']):>12}{_gib(total):>12}{mark}"
        )
    act = plan.activations
    lines += [
        "",
        f"activations per micro-batch ({act['micro_batch']} sequences), train.activation_checkpointing="
        f"none {_gib(act['no_checkpointing'])}, selective {_gib(act['selective'])}, full {_gib(act['checkpointing'])}",
        f"device memory {_gib(mem['device_bytes'])}: "
        f"{_gib(mem['total_no_checkpointing'])} -> {_fits(mem['fits_no_checkpointing'])}; "
        f"with full checkpointing {_gib(mem['total_checkpointing'])} -> {_fits(mem['fits_checkpointing'])}",
        "",
        f"FLOPs: {f['per_token']:.4g} per token, {f['per_step']:.4g} per step, {f['per_device_per_step']:.4g} "
        "per device per step"
        + (f"; {f['step_time_at_peak_s']:.3g} s per step at 100% MFU" if f["step_time_at_peak_s"] else ""),
    ]
    return "\n".join(lines)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(
        prog="optimus plan",
        description="Predict per-device memory (parameters, gradients, optimizer state for each sharding scheme, "
        "activations with and without checkpointing) and FLOPs per step for a recipe on a layout.",
    )
    where = p.add_mutually_exclusive_group()
    where.add_argument("--nodes", type=int, help="nodes of machine.ranks_per_node ranks each")
    where.add_argument("--world", type=int, help="total ranks (default: parallel.nproc)")
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for `optimus train`")
    return p


def world_size(cfg: OptimusConfig, nodes: int | None, world: int | None) -> int:
    from optimus.job_scripts import check_ep_in_node

    check_ep_in_node(cfg)  # the rule `optimus launch` applies: an EP group inside one node of the machine
    if nodes is not None:
        if nodes < 1:
            raise ConfigError(f"--nodes {nodes} must be at least 1.")
        if not cfg.machine.ranks_per_node:
            raise ConfigError(
                f"machine={cfg.machine.name} does not say how many ranks run per node: "
                "pass --world instead of --nodes, or set machine.ranks_per_node."
            )
        return nodes * cfg.machine.ranks_per_node
    if world is not None and world < 1:
        raise ConfigError(f"--world {world} must be at least 1.")
    return world if world is not None else cfg.parallel.nproc


def main(argv: list[str]) -> int:
    from optimus.recipes import load_config

    opts = _parser().parse_intermixed_args(argv)
    cfg = load_config(opts.overrides)
    plan = make_plan(cfg, world_size(cfg, opts.nodes, opts.world))
    sys.stdout.write((json.dumps(plan.as_dict(), indent=2) if opts.json else format_plan(plan)) + "\n")
    return 0
