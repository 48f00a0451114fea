"""Typed configuration: dataclasses that Hydra fills from the `recipes/` tree.

The dataclasses are registered in Hydra's ConfigStore as the schema of the
primary config, so an unknown key or a value of the wrong type is rejected by
Hydra itself; `optimus.config_checks.validate()` then checks the relations between
keys that a type cannot express (top_k <= n_experts, divisibility of the batch, ...).
This module holds the schema only: the dataclasses, the values a key may take, and
the few derivations the model reads from them.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch

from optimus.errors import ConfigError as ConfigError  # re-exported: users catch it as optimus.config.ConfigError

# The dtypes a run may store parameters (train.dtype) and accumulate gradients (optim.grad_dtype) in.
TORCH_DTYPES = {"fp32": torch.float32, "bf16": torch.bfloat16}


@dataclass
class MoEConfig:
    n_experts: int = 8  # 0 = dense model
    top_k: int = 2
    expert_dim: int = 256  # hidden size F of one routed (and one shared) expert
    n_shared_experts: int = 0
    router: str = "softmax"  # softmax | sigmoid
    norm_topk: bool = False  # renormalise the k softmax weights to sum to 1
    # Load-balancing loss E * sum_e f_e P_e (f_e counts all k choices: k when balanced), OLMoE's convention.
    aux_loss_coef: float | None = None  # null = 0.01 for softmax, 0 for sigmoid (see moe_aux_loss_coef)
    aux_loss_scope: str = "micro_batch"  # micro_batch | global (f_e counted over the data-parallel ranks)
    # mean: each MoE layer's loss with its own f_e, averaged over layers; pooled: f_e and P_e pooled over the
    # layers first, as transformers' load_balancing_loss_func (see docs/ARCHITECTURE.md, router losses).
    aux_loss_layers: str = "mean"
    seq_aux_loss_coef: float = 0.0  # DeepSeek-V3's sequence-wise balance loss (1 when balanced)
    z_loss_coef: float = 0.001
    bias_update_rate: float = 0.001  # sigmoid router: aux-loss-free balancing step size
    capacity_factor: float | None = None  # null = dropless
    n_groups: int = 1  # group-limited routing (DeepSeek-V3): experts split into n_groups groups
    topk_groups: int = 1  # ... of which each token may use the topk_groups best
    routed_scaling_factor: float = 1.0  # multiplies the routed experts' combine weights


def padded_vocab_size(vocab_size: int, multiple: int = 128) -> int:
    """The rows of the embedding and the LM head: the vocabulary rounded up for even GEMM and tp shapes. The
    rows past the vocabulary are never looked up and their logits are -inf (optimus.model.loss)."""
    return -(-vocab_size // multiple) * multiple


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
    qk_norm: str = "full"  # none | head (RMSNorm per head, Qwen3) | full (over the whole projection, OLMoE)
    tie_embeddings: bool = False
    norm_eps: float = 1e-5
    init_std: float = 0.02
    # std of the untied token embedding's initial draw; null = init_std. A tied embedding is the LM head too and
    # draws with init_std. The tiny recipe uses 1.0 (recipes/model/tiny.yaml says why).
    embed_init_std: float | None = None
    moe: MoEConfig = field(default_factory=MoEConfig)


@dataclass
class MachinePerfConfig:
    """The performance model's numbers for one device and its links (optimus.perf.machine); null = measured on
    the spot (machine=local) or, for a cluster, a recipe that cannot be predicted. Bandwidths per direction."""

    peak_flops_fp32: float | None = None  # fp32 matrix FLOP/s per device
    gemm_efficiency: float | None = None  # fraction of the peak a large matrix product reaches
    attention_efficiency: float | None = None  # ... an attention kernel; null = gemm_efficiency
    memory_bandwidth_gbs: float | None = None  # device memory, GB/s
    kernel_floor_us: float | None = None  # the shortest a kernel takes: launch and start-up
    devices_per_package: int = 1  # devices that share a package (GCDs of an MI250X, tiles of a PVC)
    package_gbs: float | None = None  # between devices of one package
    package_latency_us: float | None = None
    node_gbs: float | None = None  # between devices of one node (per device)
    node_latency_us: float | None = None
    nic_gbs: float | None = None  # one NIC
    nics_per_node: int | None = None
    network_latency_us: float | None = None
    # A rank's step time varies about its mean by this fraction (a coefficient of variation), independently of
    # the others'; a synchronous step waits for the slowest rank (optimus.perf.stragglers). Null: none.
    rank_variability: float | None = None
    # Seconds (us) every collective costs beyond its transfer where the ranks wake each other on the cores they
    # compute on (a CPU: optimus.perf.rank_sync); null: none, as for GPUs, whose ranks wait on their streams.
    sync_cost_us: float | None = None
    # A JSON file of the traced step's operators timed on the device, by signature (`optimus plan --calibrate`'s
    # operators.json; a relative path is the calibration file's directory's), which a prediction takes instead
    # of the roofline for every operator it holds (optimus.perf.op_timing). Null: the roofline prices them all.
    operator_times: str | None = None
    # The range of each number above that is not a count, as {key: [low, high]}, holding its value: a measured
    # number a narrow one, an assumed one a wide one (the recipe says why beside each). `optimus plan --predict`
    # reports the step at both ends (optimus.perf.machine). A number without a range is taken as exact.
    ranges: dict[str, Any] = field(default_factory=dict)


# The machine.perf numbers that may carry a range: all but the counts (devices per package, NICs per node).
RANGED_PERF_KEYS = ("peak_flops_fp32", "gemm_efficiency", "attention_efficiency", "memory_bandwidth_gbs",
                    "kernel_floor_us", "package_gbs", "package_latency_us", "node_gbs", "node_latency_us", "nic_gbs",
                    "network_latency_us", "rank_variability", "sync_cost_us")  # fmt: skip


@dataclass
class MachineConfig:
    name: str = "local"
    device: str = "auto"  # auto | cpu | cuda | rocm | xpu (rocm: torch calls the device cuda)
    backend: str | None = None  # null = pick from the device (nccl, xccl/ccl, gloo)
    ranks_per_node: int | None = None
    peak_flops: float | None = None  # bf16 FLOP/s per device; null = table or CPU probe
    memory_gb: float | None = None  # memory per device, for the planner
    account_required: bool = False  # its scheduler rejects a job without a project to charge (launch --account)
    # A machine.yaml that `optimus plan --calibrate` (or `optimus selftest`) wrote: its keys replace the recipe's
    # machine (optimus.recipes.load_config); machine.* overrides on the command line still come last.
    calibration: str | None = None
    perf: MachinePerfConfig = field(default_factory=MachinePerfConfig)


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
    pp: int = 1  # pipeline stages (PP is the outermost rank dimension: world = pp x dp x ep)
    pp_schedule: str = "1f1b"  # gpipe | 1f1b | interleaved_1f1b | interleaved_zb (zero bubble)
    pp_virtual: int = 1  # stages per rank (interleaved schedules: 2 or more)
    # layers per stage, in stage order (pp x pp_virtual counts); null = split by parameters, embedding and head included
    pp_layers: Any | None = None
    dispatcher: str = "alltoall"  # alltoall | allgather
    # alltoall: slices of each micro-batch pipelined through the token exchange, so that one slice's experts
    # run while another's tokens travel (2 overlaps them; 1 = one exchange, the shared experts still overlap it)
    ep_overlap_chunks: int = 1
    # Tensor parallelism: the innermost rank dimension (world = pp x dp x tp), inside a node. Attention, dense
    # FFNs, the embedding and the LM head are split over the tp ranks; MoE layers fold them into expert
    # parallelism instead (their ranks count as ep x edp). See optimus/parallel/tensor_parallel.py.
    tp: int = 1
    sp: bool = True  # with tp > 1: sequence parallelism (norms and residuals hold 1/tp of the sequence)
    timeout_s: float = 600.0
    # Before step 1, run each collective the step uses once on small tensors and check the values
    # (optimus/parallel/collective_check.py): a backend that corrupts data stops the run there.
    check_collectives: bool = True


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
    eval_sequences: int = 32  # the held-out set: this many sequences, the same in every layout
    log_interval: int = 10
    max_skipped_steps: int = 5
    # none | selective (recompute attention) | full (recompute every block's math but the EP exchange);
    # see optimus/parallel/activation_checkpointing.py
    activation_checkpointing: str = "none"


@dataclass
class OptimConfig:
    lr: float = 6e-3  # for the tiny default with Muon (docs/ARCHITECTURE.md, "The default run"); experiments set theirs
    min_lr_ratio: float = 0.1  # cosine decays to lr * min_lr_ratio
    warmup_steps: int = 20
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    weight_decay: float = 0.1
    sharding: str = "auto"  # auto (ep_aware when world > 1, else none) | ep_aware | standard | none
    # Hierarchical sharding: each group's state split over groups of this many consecutive ranks of its shard world
    # (dense: dp ranks; experts: edp ranks) and replicated across the groups; null = over all of them; 1 = DDP-like
    shard_ranks: int | None = None
    # muon | adamw: Muon for the hidden matrices (experts per expert), AdamW with the keys above for the embedding,
    # LM head, router and vectors (optimus/optim/muon.py); the same lr, schedule and weight decay drive both.
    # Muon is the default run's (docs/ARCHITECTURE.md, "The default run"); every experiment recipe and the command
    # `optimus checkpoint import` prints choose adamw, the optimizer the models they mirror were trained with
    update: str = "muon"
    muon_momentum: float = 0.95
    muon_nesterov: bool = True
    muon_ns_steps: int = 5  # Newton-Schulz iterations (torch.optim.Muon's quintic, in bf16)
    # match_rms_adamw: lr x 0.2 sqrt(max(A, B)) per [A, B] matrix, an update of AdamW's RMS (Moonlight), so that
    # optim.lr means what it means for AdamW; original: lr x sqrt(max(1, A / B)) (torch.optim.Muon's default)
    muon_adjust_lr: str = "match_rms_adamw"
    # bf16 (torch.optim.Muon's) | fp32: the Newton-Schulz iteration's dtype. In bf16 a direction one fp32 unit
    # apart (another layout's summation order) can round to another bf16 value and move its matrix's update by a
    # bf16 unit; fp32 makes layouts agree within fp32 rounding, where fp32 matrix products cost more
    muon_ns_dtype: str = "bf16"
    zero: int = 1
    grad_dtype: str = "fp32"  # fp32 | bf16: dtype of gradient accumulation and reduction
    bucket_mb: float = 32.0
    max_collective_numel: int = 256 * 1024 * 1024
    # step() returns with the sharded parameters' all-gathers in flight; each transformer block waits for its
    # own in its forward (optimus/optim/gather_overlap.py)
    overlap_param_gather: bool = False


@dataclass
class CheckpointConfig:
    dir: str | None = None  # null = <run.dir>/checkpoints
    interval: int = 0  # steps between saves; 0 = off (a SIGTERM/SIGUSR1 still saves one)
    keep: int = 2  # published checkpoints kept (the newest ones)
    load: str | None = None  # checkpoint (step dir or checkpoint root) to start from when checkpoint.dir has none
    load_weights_only: bool = False  # with `load`: take its weights, start a new run (step 0, fresh optimizer)
    # A start from `load`'s weights in a model whose top_k, router, norm_topk, qk_norm, rope_theta, ... differ
    # from the checkpoint's (what its weights were trained to compute): refused unless this confirms it.
    allow_architecture_change: bool = False
    async_save: bool = False  # write in a background thread (DCP async_save); `async` is a Python keyword


@dataclass
class RunConfig:
    dir: str | None = None  # null = runs/<model>-<timestamp>
    overwrite: bool = False  # start afresh in a run.dir that holds another run (its records and checkpoints go)


@dataclass
class LoggingConfig:
    wandb: bool = False
    wandb_project: str = "optimus"
    progress: bool = True  # progress bar on rank 0


@dataclass
class ProfileConfig:
    timers: bool = False  # step-time breakdown in metrics.jsonl; synchronises the device at every phase
    torch: bool = False  # torch.profiler chrome trace of the steps in torch_steps, per rank, into run.dir
    torch_steps: str = "3-5"  # first-last optimizer step (1-based, inclusive) of the trace and of `operators`
    # every operator of the steps in torch_steps timed inside the step, with the signature the performance model
    # replays, per rank into run.dir/operators/ (optimus/train/operator_times.py); synchronises a GPU per operator
    operators: bool = False
    collectives: bool = False  # every collective of the first step, per rank, into run.dir/collectives/
    host_syncs: bool = False  # the first step's host synchronisations by source line, into run.dir/host_syncs/
    memory: bool = False  # the first step's peak memory by category (torch's MemTracker), into run.dir/memory/


@dataclass
class OptimusConfig:
    model: ModelConfig = field(default_factory=ModelConfig)
    machine: MachineConfig = field(default_factory=MachineConfig)
    data: DataConfig = field(default_factory=DataConfig)
    parallel: ParallelConfig = field(default_factory=ParallelConfig)
    train: TrainConfig = field(default_factory=TrainConfig)
    optim: OptimConfig = field(default_factory=OptimConfig)
    kernels: str = "auto"  # auto | torch | triton
    # Before step 1, run every expert-path kernel of that backend once on a small case at the model's widths,
    # forward and backward, against the plain-PyTorch reference (optimus/train/kernel_check.py): a kernel wrong on
    # this device stops the run there. null = on for any device but a CPU; true = on, CPUs too; false = off
    check_kernels: bool | None = None
    checkpoint: CheckpointConfig = field(default_factory=CheckpointConfig)
    run: RunConfig = field(default_factory=RunConfig)
    logging: LoggingConfig = field(default_factory=LoggingConfig)
    profile: ProfileConfig = field(default_factory=ProfileConfig)


# Values of train.activation_checkpointing, from least to most recomputation.
ACTIVATION_CHECKPOINTING = ("none", "selective", "full")
# Values of optim.sharding besides `auto` (optimus.optim implements each; `optimus plan` lists them in this order).
SHARDING_SCHEMES = ("none", "standard", "ep_aware")
UPDATE_RULES = ("adamw", "muon")


QK_NORMS = ("none", "head", "full")
# Configs written before qk_norm had a choice held a boolean: true meant today's "full".
_LEGACY_QK_NORM = {"true": "full", "false": "none"}


def qk_norm_mode(value: str | bool) -> str:
    """model.qk_norm as one of QK_NORMS (old boolean values mapped to what they meant)."""
    return _LEGACY_QK_NORM.get(str(value).lower(), str(value))


def moe_aux_loss_coef(moe: MoEConfig) -> float:
    """The load-balancing coefficient in force: as set, else 0.01 for softmax routers (OLMoE's value, in the
    same convention) and 0 for the sigmoid router, which balances through its selection bias instead."""
    if moe.aux_loss_coef is not None:
        return moe.aux_loss_coef
    return 0.0 if moe.router == "sigmoid" else 0.01


PP_SCHEDULES = ("gpipe", "1f1b", "interleaved_1f1b", "interleaved_zb")
INTERLEAVED_SCHEDULES = ("interleaved_1f1b", "interleaved_zb")  # several stages per rank (pp_virtual >= 2)
# Schedules that compute weight gradients in a pass of their own (torch.autograd.grad w.r.t. the weights), which
# assigns what it gets to .grad: gradient-accumulation fusion there under ZeRO-2 only (optimus.optim.weight_pass_sinks).
WEIGHT_PASS_SCHEDULES = ("interleaved_zb",)
