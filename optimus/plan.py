"""`optimus plan`: predicted memory per device and FLOPs per step of a recipe on a layout, before running it.

Persistent state per device (P_d dense, P_e routed-expert parameters; es = bytes per parameter):

    sharding   parameters         gradients = [full,] owned shard            optimizer state
    none       es (P_d + P_e/EP)  es (P_d + P_e/EP)                          2 es (P_d + P_e/EP) (torch AdamW)
    standard   es (P_d + P_e/EP)  [full +] es (P_d/DP + P_e/world)           s (P_d/DP + P_e/world)
    ep_aware   es (P_d + P_e/EP)  [full +] es (P_d/world + P_e/world)        s (P_d/world + P_e/world)

("full" = a full gradient buffer, es (P_d + P_e/EP), kept by ZeRO-1 and not by ZeRO-2)

with s = 8 bytes per element for fp32 parameters (two fp32 moments) and 12 for bf16
parameters (fp32 master + two moments). The sharded optimizer pads each flat group to
a multiple of (shard ranks x 128 bytes); the planner adds that padding exactly, so its
figures equal the optimizer's `memory_bytes()` (run_info.json, per_rank).

Activations saved for the backward of one micro-batch (t = micro_batch x seq_len tokens
on this rank, a = bytes per activation element: 2 for bf16, 4 for fp32) follow the
per-layer accounting of Korthikanti et al. (2022), redone for this architecture
(pre-norm, GQA, QK-norm, RoPE, SwiGLU, fused SDPA so no S x S scores are kept):

    attention     7 D + 4 D_kv   norm in/out, q/k before and after QK-norm, q/k after RoPE, v,
                                 SDPA output, out-projection input (D_kv = n_kv_heads x head_dim)
    MoE FFN       2 D + K (2 D + 3 F) + 3 F_s   norm in/out; per routed copy: expert input row,
                                 gate|up output (2F), SwiGLU product (F), expert output row;
                                 shared experts F_s = n_shared x F; plus 2 E fp32 router logits/probs
    dense FFN     2 D + 3 F_dense
    head          2 D a + V (a + 8)   final norm in/out, logits, fp32 logits and log-softmax

Under expert parallelism each rank computes K x t routed rows on average (balanced routing;
the busiest rank holds `expert_load_imbalance` times more). With full activation
checkpointing a layer keeps only its input (D per token) and one layer's activations
are alive again during its recompute. Not included: allocator fragmentation, collective
buffers, temporaries of the loss and of the optimizer step.
"""

from __future__ import annotations

import argparse
import json
import sys
from dataclasses import asdict, dataclass

from optimus.config import ConfigError, ModelConfig, OptimusConfig, validate
from optimus.model import ParamCounts, count_params_of_config, flops_per_token, padded_vocab_size
from optimus.optim import resolve_sharding

ALIGN_BYTES = 128  # the sharded optimizer aligns each rank's slice of a bucket to 128 bytes
SCHEMES = ("none", "standard", "ep_aware")
DTYPE_BYTES = {"fp32": 4, "bf16": 2}
GIB = 2**30


@dataclass
class StateBytes:
    param_bytes: int
    grad_bytes: int
    optim_state_bytes: int
    padding_bytes: int

    @property
    def total(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_state_bytes


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple


def state_bytes(
    scheme: str, dense: int, expert_local: int, world: int, ep: int, param_bytes: int = 4, zero: int = 1
) -> StateBytes:
    """Persistent bytes of one rank: parameters, gradients, optimizer state (`dense`, `expert_local` = elements)."""
    es = param_bytes
    if scheme == "none":
        local = dense + expert_local
        return StateBytes(local * es, local * es, 2 * local * es, 0)
    if scheme not in SCHEMES:
        raise ConfigError(f"optim.sharding={scheme!r} is not supported: set it to one of {', '.join(SCHEMES)}.")
    dp = world // ep
    state_per_elem = 8 + (4 if es != 4 else 0)  # two fp32 moments (+ fp32 master for low-precision params)
    shard_ranks = {"dense": world if scheme == "ep_aware" else dp, "expert": dp}
    out = StateBytes(0, 0, 0, 0)
    padding = 0.0
    for kind, numel in (("dense", dense), ("expert", expert_local)):
        if numel == 0:
            continue
        w = shard_ranks[kind]
        padded = round_up(numel, w * max(1, ALIGN_BYTES // es))
        shard = padded // w
        full_buffers = 2 if zero == 1 else 1  # ZeRO-1 keeps a full gradient buffer beside the parameters
        out.param_bytes += padded * es
        out.grad_bytes += shard * es + (padded * es if zero == 1 else 0)
        out.optim_state_bytes += shard * state_per_elem
        padding += (padded - numel) * (full_buffers * es + (es + state_per_elem) / w)
    out.padding_bytes = int(-(-padding // 1))
    return out


def activation_bytes(m: ModelConfig, micro_batch: int, seq_len: int, act_bytes: int, checkpointing: bool) -> int:
    """Bytes of activations kept for the backward of one micro-batch on one rank (see the module docstring)."""
    t, a, d = micro_batch * seq_len, act_bytes, m.dim
    d_kv = m.n_kv_heads * (m.dim // m.n_heads)
    attn = 7 * d + 4 * d_kv
    moe = m.moe
    n_moe = m.n_layers - m.first_k_dense if moe.n_experts else 0
    n_dense = m.n_layers - n_moe
    moe_layer = t * (
        (attn + 2 * d + moe.top_k * (2 * d + 3 * moe.expert_dim) + 3 * moe.n_shared_experts * moe.expert_dim) * a
        + 8 * moe.n_experts
    )
    dense_layer = t * (attn + 2 * d + 3 * m.ffn_dim) * a
    head = t * (2 * d * a + padded_vocab_size(m.vocab_size) * (a + 8))
    if not checkpointing:
        return n_moe * moe_layer + n_dense * dense_layer + head
    largest_layer = max(moe_layer if n_moe else 0, dense_layer if n_dense else 0)
    return m.n_layers * t * d * a + largest_layer + head


@dataclass
class Plan:
    model: str
    world: int
    dp: int
    ep: int
    sharding: str
    zero: int
    param_dtype: str
    compute_dtype: str
    params: dict
    state: dict  # scheme -> StateBytes as a dict
    activations: dict  # micro-batch activations with / without checkpointing
    flops: dict
    memory: dict

    def as_dict(self) -> dict:
        return asdict(self)


def make_plan(cfg: OptimusConfig, world: int, param_dtype: str = "fp32", counts: ParamCounts | None = None) -> Plan:
    validate(cfg, world)
    if param_dtype not in DTYPE_BYTES:
        raise ConfigError(f"--param-dtype {param_dtype} is not supported: choose fp32 or bf16.")
    m, t, ep = cfg.model, cfg.train, cfg.parallel.ep
    counts = counts or count_params_of_config(m)
    es = DTYPE_BYTES[param_dtype]
    expert_local = counts.expert // ep
    state = {s: asdict(state_bytes(s, counts.dense, expert_local, world, ep, es, cfg.optim.zero)) for s in SCHEMES}
    compute = "bf16" if t.dtype in ("bf16", "auto") else "fp32"  # auto means bf16 on accelerators
    act = {
        "micro_batch": t.micro_batch,
        "no_checkpointing": activation_bytes(m, t.micro_batch, t.seq_len, DTYPE_BYTES[compute], False),
        "checkpointing": activation_bytes(m, t.micro_batch, t.seq_len, DTYPE_BYTES[compute], True),
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
    chosen = sum(state[sharding][k] for k in ("param_bytes", "grad_bytes", "optim_state_bytes"))
    device = cfg.machine.memory_gb * GIB if cfg.machine.memory_gb else None
    memory = {"device_bytes": device}
    for key in ("no_checkpointing", "checkpointing"):
        total = chosen + act[key]
        memory[f"total_{key}"] = total
        memory[f"fits_{key}"] = None if device is None else total <= device
    return Plan(
        m.name, world, world // ep, ep, sharding, cfg.optim.zero, param_dtype, compute,
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
        f"layout: world {plan.world} = DP {plan.dp} x EP {plan.ep}; params {plan.param_dtype}, "
        f"compute {plan.compute_dtype}, ZeRO-{plan.zero}",
        "",
        f"{'per device':<22}{'params':>12}{'grads':>12}{'optim state':>14}{'total':>12}",
    ]
    for scheme, s in plan.state.items():
        mark = " <- optim.sharding" if scheme == plan.sharding else ""
        total = s["param_bytes"] + s["grad_bytes"] + s["optim_state_bytes"]
        lines.append(
            f"  sharding={scheme:<11}{_gib(s['param_bytes']):>12}{_gib(s['grad_bytes']):>12}"
            f"{_gib(s['optim_state_bytes']):>14}{_gib(total):>12}{mark}"
        )
    act = plan.activations
    lines += [
        "",
        f"activations per micro-batch ({act['micro_batch']} sequences): {_gib(act['no_checkpointing'])}, "
        f"{_gib(act['checkpointing'])} with activation checkpointing",
        f"device memory {_gib(mem['device_bytes'])}: "
        f"{_gib(mem['total_no_checkpointing'])} -> {_fits(mem['fits_no_checkpointing'])}; "
        f"with checkpointing {_gib(mem['total_checkpointing'])} -> {_fits(mem['fits_checkpointing'])}",
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
    p.add_argument("--param-dtype", choices=sorted(DTYPE_BYTES), default="fp32",
                   help="dtype the parameters are stored in (default fp32: the trainer keeps fp32 parameters and "
                        "computes in train.dtype under autocast)")  # fmt: skip
    p.add_argument("--json", action="store_true", help="print the plan as JSON")
    p.add_argument("overrides", nargs="*", help="Hydra overrides, as for `optimus train`")
    return p


def world_size(cfg: OptimusConfig, nodes: int | None, world: int | None) -> int:
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
    from optimus.cli import load_config

    opts = _parser().parse_intermixed_args(argv)
    cfg = load_config(opts.overrides)
    plan = make_plan(cfg, world_size(cfg, opts.nodes, opts.world), opts.param_dtype)
    sys.stdout.write((json.dumps(plan.as_dict(), indent=2) if opts.json else format_plan(plan)) + "\n")
    return 0
