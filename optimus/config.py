"""Typed configuration: dataclasses that Hydra fills from the `recipes/` tree.

The dataclasses are registered in Hydra's ConfigStore as the schema of the
primary config, so an unknown key or a value of the wrong type is rejected by
Hydra itself; `validate()` then checks the relations between keys that a type
cannot express (top_k <= n_experts, divisibility of the batch, ...).
Every check raises `ConfigError` with one sentence that names the key and what
to change.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any


class ConfigError(ValueError):
    """A configuration a user wrote that cannot run; the message says what to change."""


@dataclass
class MoEConfig:
    n_experts: int = 8  # 0 = dense model
    top_k: int = 2
    expert_dim: int = 256  # hidden size F of one routed (and one shared) expert
    n_shared_experts: int = 0
    router: str = "softmax"  # softmax | sigmoid
    norm_topk: bool = False  # renormalise the k softmax weights to sum to 1
    aux_loss_coef: float = 0.01
    z_loss_coef: float = 0.001
    bias_update_rate: float = 0.001  # sigmoid router: aux-loss-free balancing step size
    capacity_factor: float | None = None  # null = dropless


@dataclass
class ModelConfig:
    name: str = "tiny"
    n_layers: int = 4
    dim: int = 256
    n_heads: int = 8
    n_kv_heads: int = 4
    vocab_size: int = 8192  # padded up to a multiple of 128 in the model
    ffn_dim: int = 1024  # hidden size of the dense SwiGLU layers
    first_k_dense: int = 0
    rope_theta: float = 10000.0
    qk_norm: bool = True
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    init_std: float = 0.02
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class MachineConfig:
    name: str = "local"
    device: str = "auto"  # auto | cpu | cuda | xpu
    backend: str | None = None  # null = pick from the device (nccl, xccl/ccl, gloo)
    ranks_per_node: int | None = None
    peak_flops: float | None = None  # bf16 FLOP/s per device; null = table or CPU probe
    memory_gb: float | None = None  # memory per device, for the planner


@dataclass
class DataConfig:
    name: str = "builtin"  # builtin | text | hf | tokens
    path: Any | None = None  # file, directory, dataset name, or a list of them
    tokenizer: str | None = None  # tokenizers JSON file or HF name; null = train one (builtin)
    vocab_size: int = 8192  # vocabulary of the tokenizer trained for builtin data
    text_field: str = "text"
    hf_split: str = "train"
    hf_config: str | None = None
    val_fraction: float = 0.02
    max_chars: int = 16_000_000  # cap on the builtin corpus size
    mix: Any | None = None  # list of {path, weight} for data=tokens
    prefetch: int = 4


@dataclass
class ParallelConfig:
    nproc: int = 1
    ep: int = 1
    pp: int = 1  # pipeline stages; recipes name it, the trainer refuses pp > 1 until it exists
    dispatcher: str = "alltoall"  # alltoall | allgather
    timeout_s: float = 600.0


@dataclass
class TrainConfig:
    steps: int = 250
    global_batch: int = 8  # sequences per optimizer step, over all ranks
    micro_batch: int = 8  # sequences per forward/backward on one rank
    seq_len: int = 256
    seed: int = 0
    dtype: str = "auto"  # auto (bf16 where bf16 matmuls are fast, else fp32) | bf16 | fp32
    grad_clip: float = 1.0  # 0 = no clipping
    eval_interval: int = 50
    eval_batches: int = 4
    log_interval: int = 10
    max_skipped_steps: int = 5


@dataclass
class OptimConfig:
    lr: float = 6e-3
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    sharding: str = "auto"  # auto (ep_aware when world > 1, else none) | ep_aware | standard | none
    zero: int = 1
    bucket_mb: float = 32.0
    max_collective_numel: int = 256 * 1024 * 1024


@dataclass
class CheckpointConfig:
    dir: str | None = None  # null = <run.dir>/checkpoints
    interval: int = 0  # steps between saves; 0 = off (a SIGTERM/SIGUSR1 still saves one)
    keep: int = 2  # published checkpoints kept (the newest ones)
    load: str | None = None  # checkpoint (step dir or checkpoint root) to start from when checkpoint.dir has none
    load_weights_only: bool = False  # with `load`: take its weights, start a new run (step 0, fresh optimizer)
    async_save: bool = False  # write in a background thread (DCP async_save); `async` is a Python keyword


@dataclass
class RunConfig:
    dir: str | None = None  # null = runs/<model>-<timestamp>


@dataclass
class LoggingConfig:
    wandb: bool = False
    wandb_project: str = "optimus"
    progress: bool = True  # progress bar on rank 0


@dataclass
class ProfileConfig:
    timers: bool = False  # step-time breakdown in metrics.jsonl; synchronises the device at every phase
    torch: bool = False  # torch.profiler chrome trace of the steps in torch_steps, per rank, into run.dir
    torch_steps: str = "3-5"  # first-last optimizer step (1-based, inclusive) of the trace


@dataclass
class OptimusConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    machine: MachineConfig = field(default_factory=MachineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    kernels: str = "auto"  # auto | torch | triton
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


def _choice(value: str, key: str, allowed: tuple[str, ...]) -> None:
    if value not in allowed:
        raise ConfigError(f"{key}={value!r} is not supported: set it to one of {', '.join(allowed)}.")


def _positive(value: float, key: str) -> None:
    if value <= 0:
        raise ConfigError(f"{key}={value} must be positive.")


def validate_model(m: ModelConfig) -> None:
    for key in ("n_layers", "dim", "n_heads", "n_kv_heads", "vocab_size"):
        _positive(getattr(m, key), f"model.{key}")
    if m.dim % m.n_heads:
        raise ConfigError(
            f"model.n_heads={m.n_heads} does not divide model.dim={m.dim}: choose n_heads that divides dim."
        )
    if (m.dim // m.n_heads) % 2:
        raise ConfigError(
            f"model.dim / model.n_heads = {m.dim // m.n_heads} is odd: RoPE needs an even head dimension."
        )
    if m.n_heads % m.n_kv_heads:
        raise ConfigError(
            f"model.n_kv_heads={m.n_kv_heads} does not divide model.n_heads={m.n_heads}: "
            "choose n_kv_heads that divides n_heads."
        )
    if not 0 <= m.first_k_dense <= m.n_layers:
        raise ConfigError(f"model.first_k_dense={m.first_k_dense} must lie between 0 and model.n_layers={m.n_layers}.")
    moe = m.moe
    if moe.n_experts < 0:
        raise ConfigError(f"model.moe.n_experts={moe.n_experts} must be 0 (dense) or positive.")
    if moe.n_experts == 0:
        _positive(m.ffn_dim, "model.ffn_dim")
        return
    _choice(moe.router, "model.moe.router", ("softmax", "sigmoid"))
    _positive(moe.expert_dim, "model.moe.expert_dim")
    if not 1 <= moe.top_k <= moe.n_experts:
        raise ConfigError(
            f"model.moe.top_k={moe.top_k} must lie between 1 and model.moe.n_experts={moe.n_experts}: "
            "lower top_k or add experts."
        )
    if moe.capacity_factor is not None and moe.capacity_factor <= 0:
        raise ConfigError(
            f"model.moe.capacity_factor={moe.capacity_factor} must be positive, or null for dropless routing."
        )
    if moe.n_shared_experts < 0:
        raise ConfigError(f"model.moe.n_shared_experts={moe.n_shared_experts} must be 0 or positive.")
    if m.first_k_dense:
        _positive(m.ffn_dim, "model.ffn_dim")


def validate(cfg: OptimusConfig, world_size: int = 1) -> None:
    """Check relations between keys; `world_size` is the number of ranks of the job."""
    validate_model(cfg.model)
    t, p = cfg.train, cfg.parallel
    _choice(t.dtype, "train.dtype", ("auto", "bf16", "fp32"))
    _choice(cfg.kernels, "kernels", ("auto", "torch", "triton"))
    _choice(p.dispatcher, "parallel.dispatcher", ("alltoall", "allgather"))
    _choice(cfg.optim.sharding, "optim.sharding", ("auto", "ep_aware", "standard", "none"))
    _choice(cfg.data.name, "data", ("builtin", "text", "hf", "tokens"))
    for key in ("steps", "global_batch", "micro_batch", "seq_len", "eval_interval", "eval_batches", "log_interval"):
        _positive(getattr(t, key), f"train.{key}")
    if t.max_skipped_steps < 0:
        raise ConfigError(f"train.max_skipped_steps={t.max_skipped_steps} must be 0 or positive.")
    if t.grad_clip < 0:
        raise ConfigError(f"train.grad_clip={t.grad_clip} must be 0 (no clipping) or positive.")
    _positive(cfg.optim.lr, "optim.lr")
    if cfg.optim.warmup_steps < 0:
        raise ConfigError(f"optim.warmup_steps={cfg.optim.warmup_steps} must be 0 or positive.")
    if not 0 <= cfg.optim.min_lr_ratio <= 1:
        raise ConfigError(
            f"optim.min_lr_ratio={cfg.optim.min_lr_ratio} must lie in [0, 1]: it is the final lr over optim.lr."
        )
    _positive(p.nproc, "parallel.nproc")
    _positive(p.ep, "parallel.ep")
    if t.global_batch % t.micro_batch:
        raise ConfigError(
            f"train.micro_batch={t.micro_batch} does not divide train.global_batch={t.global_batch}: "
            "choose a global batch that is a multiple of the micro batch."
        )
    if t.global_batch % (t.micro_batch * world_size):
        raise ConfigError(
            f"train.global_batch={t.global_batch} is not divisible by train.micro_batch x world size = "
            f"{t.micro_batch} x {world_size}: make global_batch a multiple of {t.micro_batch * world_size}."
        )
    if p.pp != 1:
        raise ConfigError(
            f"parallel.pp={p.pp} asks for pipeline parallelism, which Optimus does not have yet: "
            "this layout cannot run until it exists; use parallel.pp=1 with a model that fits DP x EP."
        )
    if world_size % p.ep:
        raise ConfigError(
            f"parallel.ep={p.ep} does not divide the world size {world_size}: choose an ep that divides it."
        )
    if p.ep > 1 and cfg.model.moe.n_experts == 0:
        raise ConfigError("parallel.ep > 1 needs a model with experts: set parallel.ep=1 for a dense model.")
    if cfg.model.moe.n_experts and cfg.model.moe.n_experts % p.ep:
        raise ConfigError(
            f"model.moe.n_experts={cfg.model.moe.n_experts} is not divisible by parallel.ep={p.ep}: "
            "choose an ep that divides the number of experts."
        )
    if cfg.optim.zero not in (1, 2):
        raise ConfigError(f"optim.zero={cfg.optim.zero} is not supported: set it to 1 or 2.")


def grad_accum_steps(cfg: OptimusConfig, world_size: int) -> int:
    return cfg.train.global_batch // (cfg.train.micro_batch * world_size)
