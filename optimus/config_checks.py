"""What a configuration must satisfy beyond its types: the relations between keys (top_k <= n_experts, a batch
that divides, a layout whose degrees divide the world, ...), checked once per run by `validate`.

Every check raises `ConfigError` with one sentence that names the key and what to change. The schema itself,
and the values each key may take, are optimus.config; the names of the kernel backends and of the EP
dispatchers are where those are implemented.
"""

from __future__ import annotations

from typing import Any

from optimus.config import (
    ACTIVATION_CHECKPOINTING,
    INTERLEAVED_SCHEDULES,
    PP_SCHEDULES,
    QK_NORMS,
    RANGED_PERF_KEYS,
    SHARDING_SCHEMES,
    TORCH_DTYPES,
    UPDATE_RULES,
    MachinePerfConfig,
    ModelConfig,
    MoEConfig,
    OptimConfig,
    OptimusConfig,
    ParallelConfig,
    padded_vocab_size,
    qk_norm_mode,
)
from optimus.errors import ConfigError, check_choice
from optimus.kernels import BACKENDS as KERNEL_BACKENDS
from optimus.layout import Layout, experts_per_rank
from optimus.optim import resolve_sharding
from optimus.parallel.expert_parallel import dispatcher_class


def _divides(divisor: int, divisor_key: str, total: int, total_key: str, fix: str) -> None:
    if total % divisor:
        raise ConfigError(f"{divisor_key}={divisor} does not divide {total_key}={total}: {fix}")


def _positive(value: float, key: str) -> None:
    if not 0 < value < float("inf"):  # also refuses nan and inf
        raise ConfigError(f"{key}={value} must be a positive, finite number.")


def _non_negative(value: float, key: str, zero: str = "") -> None:
    """0 (which means `zero`, when given) or a positive, finite number; nan and inf are refused."""
    if not 0 <= value < float("inf"):
        meaning = f" ({zero})" if zero else ""
        number = "whole number" if isinstance(value, int) else "finite number"
        raise ConfigError(f"{key}={value} must be 0{meaning} or a positive {number}.")


def _positive_or_null(value: float | None, key: str, null: str) -> None:
    if value is not None and not 0 < value < float("inf"):
        raise ConfigError(f"{key}={value} must be a positive, finite number, or null {null}.")


def validate_model(m: ModelConfig) -> None:
    for key in ("n_layers", "dim", "n_heads", "n_kv_heads", "vocab_size"):
        _positive(getattr(m, key), f"model.{key}")
    check_choice(qk_norm_mode(m.qk_norm), "model.qk_norm", QK_NORMS)
    _positive(m.rope_theta, "model.rope_theta")
    _positive(m.norm_eps, "model.norm_eps")
    _positive(m.init_std, "model.init_std")
    if m.embed_init_std is not None:
        _positive(m.embed_init_std, "model.embed_init_std")
    _divides(m.n_heads, "model.n_heads", m.dim, "model.dim", "choose n_heads that divides dim.")
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(
            f"model.dim / model.n_heads = {m.dim // m.n_heads} is odd: RoPE needs an even head dimension."
        )
    _divides(m.n_kv_heads, "model.n_kv_heads", m.n_heads, "model.n_heads", "choose n_kv_heads that divides n_heads.")
    if not 0 <= m.first_k_dense <= m.n_layers:
        raise ConfigError(f"model.first_k_dense={m.first_k_dense} must lie between 0 and model.n_layers={m.n_layers}.")
    moe = m.moe
    if moe.n_experts < 0:
        raise ConfigError(f"model.moe.n_experts={moe.n_experts} must be 0 (dense) or positive.")
    if moe.n_experts == 0:
        _positive(m.ffn_dim, "model.ffn_dim")
        return
    check_choice(moe.router, "model.moe.router", ("softmax", "sigmoid"))
    _positive(moe.expert_dim, "model.moe.expert_dim")
    if not 1 <= moe.top_k <= moe.n_experts:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} must lie between 1 and model.moe.n_experts={moe.n_experts}: "
            "lower top_k or add experts."
        )
    _positive_or_null(moe.capacity_factor, "model.moe.capacity_factor", "for dropless routing")
    if moe.n_shared_experts < 0:
        raise ConfigError(f"model.moe.n_shared_experts={moe.n_shared_experts} must be 0 or positive.")
    if m.first_k_dense:
        _positive(m.ffn_dim, "model.ffn_dim")
    _validate_balancing(moe)


def _validate_balancing(moe: MoEConfig) -> None:
    check_choice(moe.aux_loss_scope, "model.moe.aux_loss_scope", ("micro_batch", "global"))
    check_choice(moe.aux_loss_layers, "model.moe.aux_loss_layers", ("mean", "pooled"))
    for key in ("aux_loss_coef", "seq_aux_loss_coef", "z_loss_coef"):
        if getattr(moe, key) is not None:  # aux_loss_coef: null = the router's default (moe_aux_loss_coef)
            _non_negative(getattr(moe, key), f"model.moe.{key}", "off")
    _non_negative(moe.bias_update_rate, "model.moe.bias_update_rate", "no bias updates")
    _positive(moe.routed_scaling_factor, "model.moe.routed_scaling_factor")
    _positive(moe.n_groups, "model.moe.n_groups")
    fix = "choose a number of groups that divides the number of experts."
    _divides(moe.n_groups, "model.moe.n_groups", moe.n_experts, "model.moe.n_experts", fix)
    if not 1 <= moe.topk_groups <= moe.n_groups:
        raise ConfigError(
            f"model.moe.topk_groups={moe.topk_groups} must lie between 1 and model.moe.n_groups={moe.n_groups}."
        )
    reachable = moe.topk_groups * (moe.n_experts // moe.n_groups)
    if moe.top_k > reachable:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} exceeds the {reachable} experts of model.moe.topk_groups={moe.topk_groups} "
            "groups: raise topk_groups or lower top_k."
        )


def validate(cfg: OptimusConfig, world_size: int = 1) -> None:
    """Check relations between keys; `world_size` is the number of ranks of the job."""
    validate_model(cfg.model)
    t, p = cfg.train, cfg.parallel
    check_choice(t.dtype, "train.dtype", ("auto", *TORCH_DTYPES))
    check_choice(t.activation_checkpointing, "train.activation_checkpointing", ACTIVATION_CHECKPOINTING)
    check_choice(cfg.kernels, "kernels", KERNEL_BACKENDS)
    dispatcher_class(p.dispatcher)  # refuses a name no dispatcher has
    check_choice(cfg.optim.sharding, "optim.sharding", ("auto", *SHARDING_SCHEMES))
    check_choice(cfg.optim.grad_dtype, "optim.grad_dtype", tuple(TORCH_DTYPES))
    check_choice(cfg.data.name, "data", ("builtin", "text", "hf", "tokens"))
    for key in ("steps", "global_batch", "micro_batch", "seq_len", "eval_interval", "eval_sequences", "log_interval"):
        _positive(getattr(t, key), f"train.{key}")
    _non_negative(t.seed, "train.seed")  # the data order's seed sequence takes no negative numbers
    _non_negative(t.max_skipped_steps, "train.max_skipped_steps", "stop at the first non-finite step")
    _non_negative(t.grad_clip, "train.grad_clip", "no clipping")
    validate_optim(cfg.optim)
    validate_machine_and_data(cfg)
    validate_profile(cfg)
    _positive(p.nproc, "parallel.nproc")
    _positive(p.ep, "parallel.ep")
    _positive(p.timeout_s, "parallel.timeout_s")
    if not (isinstance(p.ep_overlap_chunks, int) and p.ep_overlap_chunks >= 1):
        raise ConfigError(f"parallel.ep_overlap_chunks={p.ep_overlap_chunks} must be a whole number, 1 or more.")
    if p.ep_overlap_chunks > 1 and p.dispatcher != "alltoall":
        raise ConfigError(
            f"parallel.ep_overlap_chunks={p.ep_overlap_chunks} needs parallel.dispatcher=alltoall: set it to 1 "
            f"with parallel.dispatcher={p.dispatcher}."
        )
    fix = "choose a global batch that is a multiple of the micro batch."
    _divides(t.micro_batch, "train.micro_batch", t.global_batch, "train.global_batch", fix)
    validate_pipeline(cfg, world_size)
    layout = layout_of(cfg, world_size)  # refuses an optim.shard_ranks that does not divide dp and edp
    validate_shard_ranks(cfg.optim, layout.stage_size)
    validate_tensor_parallel(cfg)
    layout.micro_batches(t.global_batch, t.micro_batch)
    validate_micro_batches(cfg, layout)
    experts_per_rank(cfg.model.moe.n_experts, p.ep)


def layout_of(cfg: OptimusConfig, world_size: int) -> Layout:
    """The run's rank layout on `world_size` ranks, from parallel.*; refused when its degrees do not divide."""
    p = cfg.parallel
    return Layout(
        world=world_size, pp=p.pp, tp=p.tp, ep=p.ep, sp=p.sp, pp_virtual=p.pp_virtual, shard_ranks=cfg.optim.shard_ranks
    )


def validate_shard_ranks(o: OptimConfig, stage_size: int) -> None:
    """optim.shard_ranks splits a sharded scheme's state: without one (sharding=none, or auto on a stage of one
    rank) there is nothing to split."""
    if o.shard_ranks is not None and resolve_sharding(o.sharding, stage_size) == "none":
        raise ConfigError(
            f"optim.shard_ranks={o.shard_ranks} needs a sharded optimizer, which optim.sharding={o.sharding} on "
            f"{stage_size} rank(s) per pipeline stage is not: set optim.shard_ranks=null, or optim.sharding=ep_aware "
            "or standard."
        )


def validate_optim(o: OptimConfig) -> None:
    """AdamW's hyper-parameters, the schedule and the sharded optimizer's buffers: values outside these ranges
    do not fail, they turn the weights into nan or inf at the first step (beta2=1 makes the bias correction
    0/0, eps=0 does so for every element whose gradient is 0)."""
    _positive(o.lr, "optim.lr")
    _non_negative(o.warmup_steps, "optim.warmup_steps", "no warmup")
    if not 0 <= o.min_lr_ratio <= 1:
        raise ConfigError(f"optim.min_lr_ratio={o.min_lr_ratio} must lie in [0, 1]: it is the final lr over optim.lr.")
    for key, average in (("beta1", "the gradients (0.9 is usual)"), ("beta2", "their squares (0.95 to 0.999)")):
        if not 0 <= getattr(o, key) < 1:
            raise ConfigError(
                f"optim.{key}={getattr(o, key)} must lie in [0, 1): it is the decay rate of AdamW's running mean "
                f"of {average}."
            )
    _positive(o.eps, "optim.eps")
    _non_negative(o.weight_decay, "optim.weight_decay", "no weight decay")
    if o.lr * o.weight_decay >= 1:
        raise ConfigError(
            f"optim.lr x optim.weight_decay = {o.lr} x {o.weight_decay} must be below 1: each step multiplies the "
            "weights by 1 - lr x weight_decay; lower one of them."
        )
    if o.zero not in (1, 2):
        raise ConfigError(f"optim.zero={o.zero} is not supported: set it to 1 or 2.")
    check_choice(o.update, "optim.update", UPDATE_RULES)
    check_choice(o.muon_adjust_lr, "optim.muon_adjust_lr", ("match_rms_adamw", "original"))
    check_choice(o.muon_ns_dtype, "optim.muon_ns_dtype", ("bf16", "fp32"))
    if not 0 <= o.muon_momentum < 1:
        raise ConfigError(f"optim.muon_momentum={o.muon_momentum} must lie in [0, 1) (0.95 is usual).")
    if not 1 <= o.muon_ns_steps < 100:
        raise ConfigError(f"optim.muon_ns_steps={o.muon_ns_steps} must lie in [1, 100) (5 is usual).")
    _positive(o.bucket_mb, "optim.bucket_mb")
    _positive(o.max_collective_numel, "optim.max_collective_numel")


# What a machine.perf number left null takes instead (optimus.perf.machine.machine_model), range included.
_PERF_STAND_INS = {
    "attention_efficiency": "gemm_efficiency's value and range",
    "peak_flops_fp32": "a quarter of machine.peak_flops",
    "package_gbs": "the node link's, node_gbs and its range",
    "package_latency_us": "node_latency_us and its range",
}


def _check_perf_range(perf: MachinePerfConfig, key: str, bounds: Any) -> None:
    """machine.perf.ranges.<key>: [low, high], positive, holding the number's value (fractions at most 1)."""
    name = f"machine.perf.ranges.{key}"
    if key not in RANGED_PERF_KEYS:
        raise ConfigError(f"{name}: {key!r} has no range; give ranges to {', '.join(RANGED_PERF_KEYS)}.")
    numbers = isinstance(bounds, (list, tuple)) and all(
        isinstance(b, (int, float)) and not isinstance(b, bool) for b in bounds
    )
    if not numbers or len(bounds) != 2 or not 0 < bounds[0] <= bounds[1] < float("inf"):
        raise ConfigError(f"{name}={bounds} must be [low, high] with 0 < low <= high.")
    if key.endswith("efficiency") and bounds[1] > 1:
        raise ConfigError(f"{name}={list(bounds)} is a range of fractions of the peak: keep it within (0, 1].")
    if key == "rank_variability" and bounds[1] >= 1:
        raise ConfigError(f"{name}={list(bounds)} is a range of fractions of a step: keep it below 1.")
    value = getattr(perf, key)
    if key == "package_latency_us" and perf.package_gbs is None:
        raise ConfigError(
            f"{name} ranges a latency the model does not read (without machine.perf.package_gbs the package link "
            f"is the node link, node_latency_us included): set machine.perf.package_gbs, or remove the range (~{name})."
        )
    if value is None:
        takes = f", which is null and takes {_PERF_STAND_INS[key]}" if key in _PERF_STAND_INS else ", which is null"
        raise ConfigError(
            f"{name} ranges machine.perf.{key}{takes}: set machine.perf.{key} inside the range, or remove the "
            f"range (~{name})."
        )
    if not bounds[0] <= value <= bounds[1]:
        raise ConfigError(
            f"machine.perf.{key}={value} lies outside its range {name}={list(bounds)}: widen the range to hold it "
            f"(e.g. {name}=[{min(value, bounds[0])},{max(value, bounds[1])}]) or set the number inside it."
        )


def validate_machine_and_data(cfg: OptimusConfig) -> None:
    """The numbers a machine recipe may leave null (looked up or probed), and the data keys the loaders read."""
    m, d = cfg.machine, cfg.data
    _positive_or_null(m.ranks_per_node, "machine.ranks_per_node", "for local runs")
    _positive_or_null(m.peak_flops, "machine.peak_flops", "to look it up or probe it")
    _positive_or_null(m.memory_gb, "machine.memory_gb", "when unknown")
    for key, value in vars(m.perf).items():
        if key not in ("ranges", "operator_times"):
            _positive_or_null(value, f"machine.perf.{key}", "to measure it here (machine=local)")
    for key in ("gemm_efficiency", "attention_efficiency"):
        if (getattr(m.perf, key) or 0) > 1:
            raise ConfigError(f"machine.perf.{key}={getattr(m.perf, key)} is a fraction of the peak: use (0, 1].")
    if (m.perf.rank_variability or 0) >= 1:
        raise ConfigError(
            f"machine.perf.rank_variability={m.perf.rank_variability} is a fraction of a rank's step time: use one "
            "below 1 (0.01 for 1%), or null for none."
        )
    if m.name == "local" and m.perf.ranges:
        raise ConfigError(
            "machine=local measures its numbers here and takes no machine.perf.ranges: remove them, or predict "
            "with a machine file that `optimus plan --calibrate` wrote (its measured numbers carry ranges)."
        )
    if m.name == "local" and m.perf.operator_times:
        raise ConfigError(
            "machine=local times the traced step's operators here and reads no machine.perf.operator_times: remove "
            "it, or predict with the machine file that `optimus plan --calibrate` wrote beside it."
        )
    for key, bounds in m.perf.ranges.items():
        _check_perf_range(m.perf, key, bounds)
    _positive(d.vocab_size, "data.vocab_size")
    _positive(d.max_chars, "data.max_chars")
    _non_negative(d.prefetch, "data.prefetch", "no background loading")
    if d.mix is not None and d.name != "tokens":  # only the token-shard loader reads a mixture
        raise ConfigError(
            f"data.mix is read only with data=tokens, not data={d.name}: set data=tokens with shards made by "
            "`optimus data prepare`, or remove data.mix."
        )


def parse_step_window(text: str) -> tuple[int, int]:
    """'3-5' -> (3, 5): the first and last optimizer step (1-based, inclusive) to trace."""
    first, sep, last = str(text).partition("-")
    try:
        lo, hi = int(first), int(last if sep else first)
    except ValueError:
        lo = hi = -1
    if lo < 1 or hi < lo:
        raise ConfigError(f"profile.torch_steps={text!r} is not a step window: write it as FIRST-LAST, e.g. 3-5.")
    return lo, hi


def validate_profile(cfg: OptimusConfig) -> None:
    """What profile.* asks for must be measurable: profile.torch's step window inside the run (or the run ends
    before the trace is written)."""
    if not cfg.profile.torch and not cfg.profile.operators:
        return
    last = parse_step_window(cfg.profile.torch_steps)[1]
    if last > cfg.train.steps:
        raise ConfigError(
            f"profile.torch_steps={cfg.profile.torch_steps} ends after the run's train.steps={cfg.train.steps}: "
            f"choose a window inside steps 1-{cfg.train.steps}, or raise train.steps to {last} or more."
        )


def validate_tensor_parallel(cfg: OptimusConfig) -> None:
    """What parallel.tp > 1 needs of the model: whole heads, FFN columns, vocabulary rows and sequence slices
    per tp rank, and the features it does not combine with yet."""
    tp, m = cfg.parallel.tp, cfg.model
    if tp == 1:
        return
    fix = "choose a parallel.tp that divides it."
    _divides(tp, "parallel.tp", m.n_heads, "model.n_heads", fix)
    _divides(tp, "parallel.tp", m.n_kv_heads, "model.n_kv_heads", fix + " (each tp rank keeps whole KV heads)")
    if m.moe.n_experts == 0 or m.first_k_dense:
        _divides(tp, "parallel.tp", m.ffn_dim, "model.ffn_dim", fix)
    _divides(tp, "parallel.tp", padded_vocab_size(m.vocab_size), "the padded vocabulary", fix)
    # MoE layers route 1/tp of each sequence on each tp rank; sequence parallelism splits it the same way.
    _divides(tp, "parallel.tp", cfg.train.seq_len, "train.seq_len", fix)
    if m.tie_embeddings:
        raise ConfigError(
            "model.tie_embeddings=true does not combine with parallel.tp > 1 yet: set model.tie_embeddings=false "
            "or parallel.tp=1."
        )
    if m.moe.n_experts and m.moe.seq_aux_loss_coef > 0:
        raise ConfigError(
            "model.moe.seq_aux_loss_coef > 0 does not combine with parallel.tp > 1 yet (a tp rank routes part of "
            "each sequence): set it to 0 or parallel.tp=1."
        )


def validate_pipeline(cfg: OptimusConfig, world_size: int) -> None:
    """parallel.pp / pp_schedule / pp_virtual, and what pipeline parallelism does not combine with yet."""
    p = cfg.parallel
    _positive(p.pp, "parallel.pp")
    _positive(p.pp_virtual, "parallel.pp_virtual")
    check_choice(p.pp_schedule, "parallel.pp_schedule", PP_SCHEDULES)
    if p.pp == 1:
        _refuse_stage_keys_without_stages(p)
        return
    Layout(world=world_size, pp=p.pp)  # refuses a pp that does not divide the world
    interleaved = p.pp_schedule in INTERLEAVED_SCHEDULES
    if interleaved and p.pp_virtual < 2:
        raise ConfigError(
            f"parallel.pp_schedule={p.pp_schedule} needs parallel.pp_virtual >= 2 stages per rank: set it to 2."
        )
    if not interleaved and p.pp_virtual != 1:
        raise ConfigError(
            f"parallel.pp_virtual={p.pp_virtual} needs parallel.pp_schedule=interleaved_1f1b or interleaved_zb: "
            "set one of those, or pp_virtual=1."
        )
    if cfg.model.n_layers < p.pp * p.pp_virtual:
        raise ConfigError(
            f"model.n_layers={cfg.model.n_layers} cannot fill parallel.pp x parallel.pp_virtual = "
            f"{p.pp * p.pp_virtual} pipeline stages: use fewer stages or more layers."
        )
    if cfg.model.moe.n_experts and cfg.model.moe.aux_loss_layers == "pooled":
        raise ConfigError(
            "model.moe.aux_loss_layers=pooled does not combine with parallel.pp > 1 (a stage sees only its own "
            "layers' expert counts): set model.moe.aux_loss_layers=mean or parallel.pp=1."
        )
    if p.pp_layers is not None:
        validate_pp_layers(p.pp_layers, p.pp * p.pp_virtual, cfg.model.n_layers)


def _refuse_stage_keys_without_stages(p: ParallelConfig) -> None:
    """With parallel.pp=1 there is no pipeline: a schedule or stage split would be ignored, and stages per rank
    would have the trainer wait for pipeline peers that no rank runs (it hung)."""
    default = ParallelConfig()
    for key in ("pp_virtual", "pp_schedule", "pp_layers"):
        value, unset = getattr(p, key), getattr(default, key)
        if value != unset:
            raise ConfigError(
                f"parallel.{key}={value} needs pipeline stages, but parallel.pp=1: set parallel.pp to 2 or more, or "
                f"parallel.{key}={'null' if unset is None else unset}."
            )


def validate_pp_layers(pp_layers: Any, n_stages: int, n_layers: int) -> None:
    """parallel.pp_layers: one positive layer count per stage, summing to model.n_layers."""
    counts = None if isinstance(pp_layers, (str, int, float)) else list(pp_layers)  # a list or a ListConfig
    valid = counts is not None and all(isinstance(c, int) and c > 0 for c in counts)
    if not valid or len(counts) != n_stages or sum(counts) != n_layers:
        raise ConfigError(
            f"parallel.pp_layers={pp_layers} must list {n_stages} positive layer counts (one per pipeline stage, "
            f"parallel.pp x parallel.pp_virtual) that add up to model.n_layers={n_layers}: fix the list, or set it "
            "to null for the automatic split."
        )


def validate_micro_batches(cfg: OptimusConfig, layout: Layout) -> None:
    """The pipeline schedules' needs on the number of micro-batches each rank runs per step."""
    p = cfg.parallel
    if p.pp == 1 or p.pp_schedule == "gpipe":
        return
    accum = layout.micro_batches(cfg.train.global_batch, cfg.train.micro_batch)
    rounds = max(1, accum // p.pp)  # the interleaved schedules run the micro-batches in rounds of pp
    if accum < p.pp or (p.pp_schedule in INTERLEAVED_SCHEDULES and accum % rounds):
        raise ConfigError(
            f"parallel.pp_schedule={p.pp_schedule} needs a multiple of parallel.pp={p.pp} micro-batches per step on "
            f"each rank, got {accum} = train.global_batch / (train.micro_batch x {layout.dp} data-parallel "
            "ranks): change global_batch or micro_batch."
        )
