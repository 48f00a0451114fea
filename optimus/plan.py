"""`optimus plan`: predicted memory per device and FLOPs per step of a recipe on a layout, before running it.

Layout: world = PP x DP x TP (TP innermost, inside a node); MoE layers see a stage's DP x TP ranks as
EDP x EP. Persistent state per device (P_d dense = P_t split by tensor parallelism + P_r replicated, P_e
routed-expert parameters, experts split over the EP group and never over TP; es / gs = bytes per parameter /
gradient element, from train.dtype and optim.grad_dtype), computed by the optimizer's own layout code
(optimus.optim.memory.rank_state_bytes), so the figures equal what a run reports in run_info.json (per_rank).
A rank holds N_d = P_t/TP + P_r dense parameters (P_t: attention's q/k/v/out projections, dense SwiGLU
layers, embedding and LM head; P_r: norms, routers, shared experts); S = world / PP ranks per stage, of which
S/TP hold the same dense slices:

    sharding   owner ranks (dense, expert)   parameters          optimizer-owned shard N_o
    none       1, 1                          es (N_d + P_e/EP)   N_d + P_e/EP
    standard   S/EP, S/EP                    es (N_d + P_e/EP)   N_d EP/S + P_e/S   (TP = 1)
               S/TP, S/EP                    es (N_d + P_e/EP)   N_d TP/S + P_e/S   (TP > 1)
    ep_aware   S/TP, S/EP                    es (N_d + P_e/EP)   N_d TP/S + P_e/S
               (optim.shard_ranks = R: standard and ep_aware split each group over R owners, N_o = N_d/R + P_e/(EP R))

    gradients  ZeRO-1: gs x full local size (+ gs N_o when the owner ranks are > 1);
               ZeRO-2: gs N_o (the full gradient exists only during the last backward)
    master     4 N_o when parameters are bf16, else 0
    moments    8 N_o (two fp32 Adam moments)

Each flat group is padded to a multiple of (owner ranks x 128 bytes), counted exactly.

Activations saved for the backward of one micro-batch (t = micro_batch x seq_len tokens of the micro-batch,
a = bytes per activation element: 2 for bf16, 4 for fp32), per token, counted from what autograd actually
saves with the torch kernels (fused SDPA: no S x S scores; tests/train/test_activation_checkpointing.py
measures them, and the peak, within 5%). With TP > 1 each term is one tp rank's
(optimus/parallel/tensor_parallel.py; tests/test_plan.py measures what autograd keeps on 2 ranks, within
5%): r = 1/TP with sequence parallelism (parallel.sp), where the residual stream and the norms hold t/TP
tokens, else r = 1; G = D a with sequence parallelism (the [t, D] input that attention, a dense FFN and the
head all-gather and keep), else 0:

    norms         2 D a r + O    both pre-norms' input (their backward recomputes the normalised rows from it and
                                 one fp32 number per token, optimus.model.norm), and the attention norm's output
                                 O = D a, the projections' input (O = 0 with sequence parallelism: they keep it
                                 gathered, G); the ffn norm's output counts as the FFN's input below
    attention     G + ((2 D + 2 D_kv) s + D a) / TP + 4 n_heads / TP + Q   its gathered input; q/k/v and output
                                 of SDPA in its dtype (s bytes: a, or 4 for heads up to 32 wide on a CPU,
                                 optimus.model.attention.attention_dtype) with its fp32 log-sum-exp,
                                 the out-projection's input, split by heads;
                                 Q: q/k before QK-norm (the norm's input), (D + D_kv) a, / TP for qk_norm=head;
                                 for qk_norm=full at TP > 1 (D + D_kv) a / TP + 8 (the width-split norm's
                                 input and two fp32 inverse norms); 0 without QK-norm
                                 (D_kv = n_kv_heads x head_dim)
    dense FFN     4 F_dense a / TP + G + O   gate and up outputs, SiLU output, their product, split by
                                 columns, and its input (gathered with sequence parallelism)
    MoE FFN       an MoE layer routes t/TP tokens on each tp rank, with or without sequence parallelism:
                  D a / TP       its input, this rank's share of the ffn norm's output
                  router: (8 E + 28 K) / TP bytes (fp32 logits and probabilities, ids, row ids, weights;
                                 + 4 D / TP for the router's fp32 input copy in bf16 runs)
                  2 K D a / TP   the exchanged rows: expert inputs and expert outputs
                  4 K F a / TP   the routed experts' SwiGLU (as the dense FFN, per routed copy)
                  4 F_s a / TP   shared experts, F_s = n_shared x F
    head          2 D a + V a + 16   final norm (as a pre-norm: D a r + G with sequence parallelism), ids
                                 and the logits' gradient in the compute dtype, which the fused cross-entropy
                                 (optimus.model.loss) makes in its forward (tp = 1; the last pipeline stage
                                 runs the same loss); the vocabulary-parallel one (tp > 1: V/TP logits per
                                 rank, never gathered) the fp32 log-probabilities of its columns, 4 V / TP

The peak is the larger of: everything kept (plus the head's working memory, head_work_bytes: for the fused
head one chunk's logits in its forward,
C V (4 + a) in bf16 and 4 C V in fp32 for C = optimus.model.loss.chunk_rows(V) rows, or its backward's
gradients V D a + 2 t D a, whichever is larger; for the vocabulary-parallel head t V a / TP, its logits or
their gradient in the compute dtype) as the backward starts, and, for each block, what it and the
blocks before it keep plus its largest recomputed region, alive again during its backward, and two gradients:
the residual stream's (D a r) and the region's input's (D a; 2 D a in all without TP), and, at the last MoE
layer, what it and the blocks before it keep plus its work beyond that (moe_work_bytes: the exchange's buffers
and the combine's fp32 sums in its forward, the combine's gradients and the two gradients in its backward; the
peak of a first pipeline stage, which has no head, found by `optimus plan --dry-run`: 7% above the plan there).
train.activation_checkpointing (optimus/parallel/activation_checkpointing.py) removes parts:
selective drops attention (recomputing one layer's; its gathered input G is the recomputation's input and
stays); full keeps only the input (D a r) of a dense block and drops attention (G stays), the expert SwiGLU
and shared experts of an MoE block (the norms, router and exchanged rows stay, since the exchange is never
re-run). Under expert parallelism each rank computes K x t / TP routed rows on average (balanced routing; the
busiest rank holds `expert_load_imbalance` times more). ZeRO-2 (optim.zero=2) adds its staged gradient
buckets (optimus.optim.memory.zero2_staging_bytes): up to two being packed and BUCKETS_IN_FLIGHT in reduction
per group, each with gloo's receive buffer, alive in the backward once the head's has run; and at the end of
the backward, when the activations are gone, the last ones in flight beside the embedding's gradient, the last
one computed. Two more terms are added at the peak (found by `optimus plan --dry-run`): ZeRO-2's full-size
gradient, which accumulates from a step's first backward when it has several micro-batches
(zero2_accumulated_bytes), and under zero bubble with ZeRO-1 the gradients its weight passes store in .grad
until the optimizer collects them (weight_pass_grad_bytes). A pipeline rank also holds its stages' outputs, one
per micro-batch in flight (torch's schedule keeps each until its backward; zero bubble's, until its weight pass),
but not on the last stage, and the head's activations of one micro-batch only, except under GPipe and zero bubble
(optimus.parallel.pipeline.last_stage_in_flight). Under zero bubble all of these are counted at each moment of
the rank's order instead, and the peak is the moment where they weigh most (_zero_bubble_peak): a stage's
gradient sums begin with its first weight pass, usually after the most forwards are held. The pipeline stages' receive
buffers are not a term: Optimus's stages hold one only while its micro-batch needs it
(optimus.parallel.pipeline_stage; pipeline_buffer_bytes counts torch's, one per micro-batch of the step, on a
torch where they cannot be released). (The tensor-parallel embedding's backward
keeps only its rank's rows: optimus.parallel.tensor_parallel.) The optimizer step comes after the
backward: with Muon its working memory (the fp32 update directions of the busiest rank, sized by the
ownership code a run executes, on the parameters' shapes: optimus.optim.muon_plan) beside the state and the
pipeline's receive buffers is the peak where that is more (the totals, and so the dry run's planned figure,
take the larger). Not included: allocator fragmentation and
cached blocks, the libraries' own workspaces (on a CPU MKL's and SDPA's, about 10 MiB), the TP
all-gathers' and reduce-scatters' buffers, AdamW's temporaries of the optimizer step (after the backward, below
the peak; with optim.overlap_param_gather its all-gathers' sent shards live on into the next forward and are freed
as its blocks start, before the peak), and the different buffers of the Triton kernels. docs/MEMORY.md
measures what these add to a CPU run's resident peak.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from optimus.config import (
    ACTIVATION_CHECKPOINTING,
    TORCH_DTYPES,
    WEIGHT_PASS_SCHEDULES,
    ConfigError,
    ModelConfig,
    OptimConfig,
    OptimusConfig,
    qk_norm_mode,
)
from optimus.config_checks import layout_of, validate
from optimus.kernels import SAVED_FFN_WIDTHS, KernelUnavailable, resolve_name
from optimus.kernels.cpu_schedules import WIDEN_BLOCK_ROWS
from optimus.layout import Layout
from optimus.model import ParamCounts, count_params_of_config, flops_per_token, moe_layer_ids, padded_vocab_size
from optimus.model.attention import attention_dtype
from optimus.model.loss import chunk_rows
from optimus.optim import SCHEMES, rank_state_bytes, resolve_sharding
from optimus.optim.adamw import AdamW
from optimus.optim.memory import (
    bucket_numel,
    grads_by_hook,
    rank_update_bytes,
    rank_zero2_staging_bytes,
    zero_bucket_bytes,
)
from optimus.optim.muon_plan import planned_muon_step_bytes
from optimus.parallel.pipeline_stage import releases_receive_buffers
from optimus.plan_shares import RankShare, rank_shares
from optimus.platform import TORCH_DEVICE_OF_PATH, declared_device_path, declared_device_type, resolve_dtype
from optimus.run_spec import RunSpec

DTYPE_BYTES = {name: dtype.itemsize for name, dtype in TORCH_DTYPES.items()}
GIB = 2**30
STATE_KEYS = ("param_bytes", "grad_bytes", "master_bytes", "optim_state_bytes")  # persistent bytes per rank


def planned_dtype(cfg: OptimusConfig) -> str:
    """`train.dtype` as a run on `machine` resolves it: auto is bf16 on GPUs, and on CPUs with bf16 units."""
    return resolve_dtype(cfg.train.dtype, declared_device_type(cfg.machine))


@dataclass(frozen=True)
class PlanInputs:
    """What every pipeline rank's plan reads besides its own share, resolved once per plan, so that the arithmetic
    below reads numbers rather than reaching through the config into other modules for each rank."""

    stage: Layout  # one pipeline stage's ranks
    accum: int  # micro-batches per rank and step
    compute_dtype: str  # train.dtype as a run on the recipe's machine resolves it (planned_dtype)
    grad_bytes: int  # per element of optim.grad_dtype
    zero: int  # optim.zero
    scheme: str  # optim.sharding, resolved
    bucket: int  # elements per gradient bucket (bucket_numel)
    kernels: str  # the expert kernels' backend a run on the device path takes (planned_kernels)
    attention_bytes: int  # per element of what SDPA keeps (optimus.model.attention.attention_dtype)
    dispatcher: str  # how an MoE layer's rows travel: "local" (ep 1), or parallel.dispatcher

    @property
    def act_bytes(self) -> int:
        """Bytes per element of the compute dtype: parameters and activations."""
        return DTYPE_BYTES[self.compute_dtype]

    @classmethod
    def of(cls, cfg: OptimusConfig, layout: Layout, path: str) -> PlanInputs:
        o, t = cfg.optim, cfg.train
        stage = layout.one_stage()
        compute_dtype = planned_dtype(cfg)
        head_dim = cfg.model.dim // cfg.model.n_heads
        attention = attention_dtype(TORCH_DEVICE_OF_PATH[path], head_dim, TORCH_DTYPES[compute_dtype])
        return cls(
            stage, layout.micro_batches(t.global_batch, t.micro_batch), compute_dtype, DTYPE_BYTES[o.grad_dtype],
            o.zero, resolve_sharding(o.sharding, stage.world),
            bucket_numel(
                zero_bucket_bytes(o.bucket_mb, o.zero, o.overlap_param_gather), o.max_collective_numel,
                DTYPE_BYTES[compute_dtype],
            ),
            planned_kernels(cfg, path), attention.itemsize, cfg.parallel.dispatcher if layout.ep > 1 else "local",
        )  # fmt: skip


def zero2_accumulated_bytes(inputs: PlanInputs, params: int) -> int:
    """ZeRO-2 reduces in the last micro-batch's backward: with several micro-batches per step the earlier ones'
    gradients add up in a full-size buffer until then (the parameters' .grad, or the hooks' partial sums in
    optim.grad_dtype), each parameter's from its first gradient to the step's last; `params`: those one device
    holds whose sums are alive (a rank's, from its first backward to the end of the step, which is where the
    1F1B family's peak is; under zero bubble, the stages whose weight passes have begun: _zero_bubble_peak)."""
    if inputs.zero != 2 or inputs.accum == 1:
        return 0
    return inputs.grad_bytes * params


def weight_pass_grad_bytes(cfg: OptimusConfig, inputs: PlanInputs, dense: int, expert: int) -> int:
    """Zero bubble with ZeRO-1: a weight pass stores its gradients in .grad (autograd's accumulation, and the hooks
    that would add each into the fp32 buffer, do not run there), where they add up until the optimizer collects
    them after the backwards (optimus.optim.shard_group.collect): the parameters' gradients in their own dtype,
    alive from a stage's first weight pass to the end of the step, beside the buffer the state counts. Where a
    group's gradients would reach its buffer in .grad anyway (grads_by_hook false), .grad is a view into the
    buffer: 0. `dense`: the dense parameters one tp rank holds, tensor-parallel when tp > 1; `expert`: the expert
    parameters of the stages (split by EP, never by tp)."""
    stage, grad_dtype, compute = inputs.stage, cfg.optim.grad_dtype, inputs.compute_dtype
    if cfg.parallel.pp_schedule not in WEIGHT_PASS_SCHEDULES or inputs.zero != 1:
        return 0
    dense = dense if grads_by_hook(grad_dtype, compute, tensor_parallel=stage.tp > 1) else 0
    expert = expert // stage.ep if grads_by_hook(grad_dtype, compute, tensor_parallel=False) else 0
    return inputs.act_bytes * (dense + expert)


def _zero_bubble_peak(cfg: OptimusConfig, inputs: PlanInputs, share: RankShare, mode: str, where: dict) -> dict:
    """Zero bubble's peak: the moment of its order (RankShare.moments) where the activations held and the gradients
    being summed weigh most together, as {activations, zero2_accumulated, weight_pass_grads}. The activations
    peak before the first weight passes on most ranks, where no sums exist yet. A stage's sums begin with its
    first weight pass: ZeRO-2's end with its last, which hands them to the buckets (staged from the first such
    pass to the end of the backward); ZeRO-1's .grad lives to the end of the step. Each moment's activations:
    its held forwards weighted by their stages' layers, the last stage's head as many times as it holds
    forwards, every other held forward's output kept to be sent, and what each input pass whose weight pass has
    not ended left for it (the Triton experts' inner gradients)."""
    m, t, stage = cfg.model, cfg.train, inputs.stage
    lengths = [len(layers) for layers in share.stage_layers]
    moe_ids = set(moe_layer_ids(m))
    inner_grad = _layer_activations(m, inputs.act_bytes, stage.tp, stage.sp, inputs.kernels)["expert_inner_grad"]
    # bytes an input pass of each stage leaves for its weight pass: its MoE layers' inner gradients
    tokens = t.micro_batch * t.seq_len
    left_for_weights = [round(tokens * inner_grad * sum(i in moe_ids for i in ids)) for ids in share.stage_layers]
    best: dict | None = None
    for moment in share.moments:
        begun = [p for p, passes in zip(share.stage_params, moment.weight_passes) if passes > 0]
        summing = [p for p, passes in zip(share.stage_params, moment.weight_passes) if 0 < passes < inputs.accum]
        head_held = moment.held[-1] if share.head else 0
        completed = any(passes == inputs.accum for passes in moment.weight_passes)
        held_where = {**where, "in_flight": sum(n * k for n, k in zip(moment.held, lengths)) / sum(lengths),
                      "head_in_flight": head_held, "sent_outputs": sum(moment.held) - head_held,
                      "staging": where["staging"] if completed else (0, 0)}  # fmt: skip
        awaiting = sum(n * size for n, size in zip(moment.awaiting_weight, left_for_weights))
        terms = {
            "activations": activation_bytes(m, t.micro_batch, t.seq_len, inputs.act_bytes, mode, **held_where)
            + awaiting,
            "zero2_accumulated": zero2_accumulated_bytes(
                inputs, sum(p.local_dense(stage.tp) + p.expert // stage.ep for p in summing)
            ),
            "weight_pass_grads": weight_pass_grad_bytes(
                cfg, inputs, sum(p.local_dense(stage.tp) for p in begun), sum(p.expert for p in begun)
            ),
        }
        if best is None or sum(terms.values()) > sum(best.values()):
            best = terms
    return best


def pipeline_buffer_bytes(cfg: OptimusConfig, inputs: PlanInputs, share: RankShare) -> int:
    """The receive buffers torch's PipelineStage keeps for the whole run: one for every micro-batch of the step
    on each stage a rank runs, for its input (all stages but the first) and its output's gradient (all but the
    last), [micro_batch, positions, D] in the compute dtype (positions / TP with sequence parallelism); with
    hundreds of micro-batches per step, GiBs (frontier-1t: 6.3 GiB per kind, which a dry run measured).
    Optimus's stages (optimus.parallel.pipeline_stage) hold a buffer only while its micro-batch needs it, where
    this torch lets them: a received input is then the first layer's input, which the activations count, and a
    received gradient lives during one backward, beside the gradients the activations count. 0 then."""
    m, t, p = cfg.model, cfg.train, cfg.parallel
    if p.pp == 1 or releases_receive_buffers():
        return 0
    n_stages = p.pp * p.pp_virtual
    positions = inputs.stage.residual_seq_len(t.seq_len)
    buffers = sum((i > 0) + (i < n_stages - 1) for i in share.stages)
    return inputs.accum * buffers * t.micro_batch * positions * m.dim * inputs.act_bytes


def _layer_activations(
    m: ModelConfig, a: int, tp: int = 1, sp: bool = True, kernels: str = "torch", attention_bytes: int | None = None
) -> dict[str, float]:
    """Bytes per token of the micro-batch that each part of a block keeps for the backward on one tp rank (see
    the module docstring): what tensor parallelism splits over heads or columns, and the MoE layer's share of
    the tokens, count 1/tp; the norms 1/tp with sequence parallelism, whole without. `kernels`: the expert
    kernels' backend, which keeps optimus.kernels.SAVED_FFN_WIDTHS F-wide rows per routed row. `attention_bytes`:
    per element of SDPA's q, k, v and output (the compute dtype's `a` by default)."""
    d, moe = m.dim, m.moe
    s = attention_bytes or a
    d_kv = m.n_kv_heads * (m.dim // m.n_heads)
    qk = qk_norm_mode(m.qk_norm)
    k, f = moe.top_k, moe.expert_dim
    router_input = 4 * d if a != 4 else 0  # the router's fp32 copy of its input, in bf16 runs only
    residual = 1 / tp if sp else 1  # the share of the sequence that the residual stream and the norms hold
    gathered = d * a if tp > 1 and sp else 0  # the [t, D] input that attention and a dense FFN all-gather
    # a norm's output, kept by the projections it feeds; with sequence parallelism they keep it gathered instead
    # (an MoE layer keeps only its share of the tokens: "moe_input")
    norm_output = 0 if gathered else d * a
    # q and k before QK-norm (the norm's input; its output is attention's q/k), split like the heads. "full" under
    # tp (optimus.parallel.tensor_parallel's width-split norm) also keeps each token's two inverse norms (fp32)
    qk_norm = {"none": 0, "head": (d + d_kv) * a / tp, "full": (d + d_kv) * a}[qk]
    if qk == "full" and tp > 1:
        qk_norm = (d + d_kv) * a / tp + 2 * 4
    return {
        # both pre-norms' input (optimus.model.norm recomputes the normalised rows), the attention norm's output
        "norms": 2 * d * a * residual + norm_output,
        "attention_input": gathered,  # gathered before the attention module runs: kept when it is recomputed
        # q, k, v and SDPA's output in the attention's dtype, the out-projection's input in the compute dtype
        "attention": ((2 * d + 2 * d_kv) * s + d * a + 4 * m.n_heads) / tp + qk_norm,
        "dense_ffn": 4 * m.ffn_dim * a / tp + gathered + norm_output,  # + its input, the ffn norm's output
        # an MoE layer routes 1/tp of the tokens on each tp rank, with or without sequence parallelism, and keeps
        # them as its input: the ffn norm's output (with sequence parallelism) or a copy of this rank's slice of it
        "moe_input": d * a / tp,
        "router": (router_input + 8 * moe.n_experts + 8 * k + 20 * k) / tp,  # fp32 logits/probs, ids, row ids
        "expert_rows": 2 * k * d * a / tp,  # the exchanged rows: expert inputs and expert outputs
        "expert_mlp": SAVED_FFN_WIDTHS[kernels] * k * f * a / tp,
        # the Triton kernels under zero bubble: the experts' inner gradient [rows, 2F], which an input pass keeps
        # for its weight pass (optimus.kernels.triton_backend), alive between the two
        "expert_inner_grad": 2 * k * f * a / tp if kernels == "triton" else 0,
        "shared": 4 * moe.n_shared_experts * f * a / tp,
        "block_input": d * a * residual,
        "head_input": d * a * residual + norm_output + gathered,  # the final norm's, and the head's input
        "grads": d * a * (1 + residual),  # the residual stream's gradient and a region's input gradient
    }


def _block_activations(part: dict[str, float], is_moe: bool, checkpointing: str) -> tuple[float, float]:
    """(bytes per token a block keeps, bytes per token alive again while its largest region is recomputed)."""
    ffn = ("moe_input", "router", "expert_rows", "expert_mlp", "shared") if is_moe else ("dense_ffn",)
    kept = part["norms"] + part["attention_input"] + part["attention"] + sum(part[name] for name in ffn)
    if checkpointing == "selective":
        return kept - part["attention"], part["attention"]
    if checkpointing == "full" and not is_moe:
        return part["block_input"], kept  # the whole block runs again
    if checkpointing == "full":
        regions = (part["attention"], part["expert_mlp"], part["shared"])  # one at a time, never the exchange
        return kept - sum(regions), max(regions)
    return kept, 0


def activation_bytes(
    m: ModelConfig,
    micro_batch: int,
    seq_len: int,
    act_bytes: int,
    checkpointing: str,
    recompute: bool = True,
    layers: list[int] | None = None,
    head: bool = True,
    in_flight: float = 1,
    tp: int = 1,
    sp: bool = True,
    head_work: bool = False,
    staging: tuple[int, int] = (0, 0),
    kernels: str = "torch",
    sent_outputs: float = 0,
    attention_bytes: int | None = None,
    dispatcher: str = "local",
    ep: int = 1,
    head_in_flight: float | None = None,
) -> int:
    """Peak bytes of activations for the backward of one micro-batch on one rank under
    `train.activation_checkpointing=checkpointing` (see the module docstring); without `recompute`,
    only what the forward keeps for the backward. A pipeline rank holds the blocks `layers` (and the
    head with `head`) and keeps `in_flight` micro-batches' worth of them until their backward. The head's
    cross-entropy is optimus.model.loss's fused one, or with `tp` > 1 the vocabulary-parallel one on V/tp of the
    logits. `tp` > 1: one rank of a tensor-parallel group, with sequence parallelism when `sp`. `head_work`: also
    count the cross-entropy's working memory (head_work_bytes) beside everything kept; the profiler
    books it to the head's own frames, so what tests/train/test_activation_checkpointing.py measures leaves it
    out. `staging`: ZeRO-2's staged gradient buckets, (alive in the backward once the head's has run, alive at
    its end). `kernels`, `attention_bytes`: as _layer_activations'. `sent_outputs`: a pipeline rank's stage
    outputs held at the peak, each the residual stream of a micro-batch ([t, D], its tp share with sequence
    parallelism): torch's schedule keeps a stage's output in its forward cache until that micro-batch's backward
    (found by `optimus plan --dry-run`: 0.78 GiB on frontier-1t's first stage, 64 in flight). `dispatcher` ("local",
    "alltoall", "allgather") and `ep`: how an MoE layer's rows travel, for what it holds beyond what it keeps
    (moe_work_bytes). `head_in_flight`: micro-batches' worth of the head's activations held (`in_flight` by
    default; one where the last stage's backward follows its forward: optimus.parallel.pipeline)."""
    part = _layer_activations(m, act_bytes, tp, sp, kernels, attention_bytes)
    moe_ids = set(moe_layer_ids(m))
    layers = range(m.n_layers) if layers is None else layers
    blocks = [_block_activations(part, i in moe_ids, checkpointing) for i in layers]
    vocab = padded_vocab_size(m.vocab_size) / tp  # vocabulary-parallel head: a rank's columns of the logits
    # final norm and ids; fused: the logits' gradient in the compute dtype; vocabulary-parallel (tp > 1): the fp32
    # log-probs of this rank's V/tp columns only
    head_logits = vocab * act_bytes if tp == 1 else vocab * 4
    head_kept = part["head_input"] + head_logits + 16 if head else 0
    kept = sum(block_kept for block_kept, _ in blocks) + head_kept
    heads = in_flight if head_in_flight is None else head_in_flight
    # forwards waiting for their backward
    waiting = (in_flight - 1) * (kept - head_kept) + (heads - 1) * head_kept + sent_outputs * part["block_input"]
    if not recompute:
        return round(micro_batch * seq_len * (waiting + kept))
    # The backward starts with everything kept (the head kept its logits' gradient already); block i is
    # recomputed once the blocks after it and the head have freed theirs, while the residual stream's gradient
    # and the region's are alive.
    tokens = micro_batch * seq_len
    # the cross-entropy's working memory: the fused one's on a whole head, or the vocabulary-parallel one's
    work = head_work_bytes(m, tokens, act_bytes, tp) if head_work and head else 0
    peak = tokens * kept + work
    during, at_end = staging
    # the head's backward has freed what it kept; the staged gradients take its place
    peak = max(peak, tokens * (kept - head_kept) + during)
    below = 0
    for block_kept, block_recomputed in blocks:
        below += block_kept
        if block_recomputed:
            peak = max(peak, tokens * (below + block_recomputed + part["grads"]) + during)
    moe_positions = [pos for pos, i in enumerate(layers) if i in moe_ids]
    if moe_positions:
        # The last MoE layer holds the most below it: in the forward of this micro-batch (everything before it
        # kept, its exchange buffers and its combine's work alive), and in the backward, the head's and the later
        # blocks' activations gone, its combine's gradient work beside the two gradients.
        below = sum(block_kept for block_kept, _ in blocks[: moe_positions[-1] + 1])
        forward, backward = moe_work_bytes(m, tokens, act_bytes, tp, kernels, dispatcher, ep)
        peak = max(peak, tokens * below + forward, tokens * (below + part["grads"]) + backward + during)
    peak = max(peak, at_end)  # this micro-batch's activations are gone; the last reductions are in flight
    return round(tokens * waiting + peak)


def moe_work_bytes(
    m: ModelConfig, tokens: int, act_bytes: int, tp: int, kernels: str, dispatcher: str, ep: int
) -> tuple[int, int]:
    """(forward, backward): bytes an MoE layer holds beyond what it keeps, at their largest, for a micro-batch of
    `tokens` on one tp rank (which routes tokens / tp of them; K rows each, balanced over the experts).

    Forward, at the combine: the exchange's buffers (the all-to-all's rows sent, received and sent back, 3 K D a;
    the all-gather's gathered tokens, ep D a) and the combine's work: torch's sums weighted rows in fp32 (a widened
    copy and the weighted product of the K D rows, or the product and the [T, D] fp32 sum; T = ep x tokens for the
    all-gather, whose combine sums every gathered token), Triton's writes the [T, D] sum in the compute dtype.
    Backward, at the combine's: the rows' gradient [K t, D] in the compute dtype; torch's also the weights'
    gradient, one block of rows at a time (optimus.kernels.cpu_schedules.WIDEN_BLOCK_ROWS) as gathered output
    gradients, their and the rows' fp32 copies and their product; the all-gather's the gathered output gradient."""
    d, a = m.dim, act_bytes
    routed = tokens / tp
    rows = m.moe.top_k * routed
    summed = ep * routed if dispatcher == "allgather" else routed  # tokens whose rows this rank's combine sums
    exchange = {"local": 0, "alltoall": 3 * rows * d * a, "allgather": summed * d * a}[dispatcher]
    if kernels == "torch":
        widened = 4 if a != 4 else 0  # bytes per element of a copy widened to fp32
        combine = max(rows * d * (widened + 4), 4 * rows * d + 4 * summed * d)
        block = min(rows, WIDEN_BLOCK_ROWS)
        combine_grad = rows * d * a + block * d * (a + 2 * widened + 4)
    else:
        combine, combine_grad = summed * d * a, rows * d * a
    gathered_grad = summed * d * a if dispatcher == "allgather" else 0
    return round(exchange + combine), round(combine_grad + gathered_grad)


def head_work_bytes(m: ModelConfig, tokens: int, act_bytes: int, tp: int) -> int:
    """Bytes the LM head's cross-entropy holds beyond what it keeps for the backward, at their largest: the fused
    one's (fused_head_work_bytes), or under tensor parallelism the vocabulary-parallel one's: beside its kept fp32
    probabilities [T, V/tp], the head's logits in the compute dtype in the forward, and their gradient (cast to
    it) in the backward (optimus.model.loss)."""
    if tp == 1:
        return fused_head_work_bytes(m, tokens, act_bytes)
    return tokens * padded_vocab_size(m.vocab_size) // tp * act_bytes


def fused_head_work_bytes(m: ModelConfig, tokens: int, act_bytes: int) -> int:
    """Bytes the fused cross-entropy (optimus.model.loss) holds beyond what it keeps for the backward, at their
    largest, while everything else is kept: in its forward one chunk of fp32 logits (and, in a 16-bit run, the
    chunk's GEMM output it is copied from); in its backward the head weight's gradient [V, D] and the hidden
    states' gradient and scaled copy [T, D] in the compute dtype (in a 16-bit run, while the scaled copy is
    made, the hidden states' gradient beside an fp32 copy of the hidden states and its fp32 product)."""
    vocab, d, a = padded_vocab_size(m.vocab_size), m.dim, act_bytes
    rows = min(chunk_rows(vocab), tokens)
    forward = rows * vocab * (4 + (a if a != 4 else 0))
    backward = vocab * d * a + 2 * tokens * d * a
    rounded_from_fp32 = (a + 2 * 4) * tokens * d if a != 4 else 0
    return max(forward, backward, rounded_from_fp32)


@dataclass
class Plan:
    model: str
    world: int
    pp: int
    dp: int  # data-parallel ranks of a stage (world / (pp x tp)): ranks that read different batches
    tp: int
    sp: bool  # sequence parallelism (tp > 1)
    ep: int
    edp: int  # expert data-parallel ranks of a stage (world / (pp x ep)): MoE layers fold DP x TP into EDP x EP
    sharding: str
    shard_ranks: int | None  # optim.shard_ranks: each group's state split over groups of this many ranks (None: all)
    zero: int
    param_dtype: str  # also the compute dtype
    grad_dtype: str
    params: dict
    state: dict  # scheme -> StateBytes as a dict
    activations: dict  # micro-batch activations with / without checkpointing
    flops: dict
    memory: dict
    stages: list[dict]  # pp > 1: per pipeline rank (its stages, layers, bytes); the figures above are the busiest's
    update: dict  # optim.update and what it adds to a step of the busiest rank (optimus.optim.memory.rank_update_bytes)

    def as_dict(self) -> dict:
        return asdict(self)


def _rank_plan(cfg: OptimusConfig, share: RankShare, inputs: PlanInputs) -> dict:
    """State bytes per scheme, activations per checkpointing mode and totals of one pipeline rank."""
    m, t, stage = cfg.model, cfg.train, inputs.stage
    a = inputs.act_bytes
    state, staging, update = _optimizer_bytes(cfg.optim, inputs, share)
    for scheme_bytes in state.values():
        scheme_bytes["param_bytes"] += a * share.head_copy  # parameters are stored in the compute dtype
    if share.embed and staging[1]:  # the backward ends with the embedding's gradient [V / tp, D], being staged
        staging = (staging[0], staging[1] + padded_vocab_size(m.vocab_size) * m.dim * a // stage.tp)
    where = {"layers": share.layers, "head": share.head, "in_flight": share.in_flight, "tp": stage.tp,
             "sp": stage.sp, "head_work": True, "staging": staging, "kernels": inputs.kernels,
             "sent_outputs": share.sent_outputs, "attention_bytes": inputs.attention_bytes,
             "dispatcher": inputs.dispatcher, "ep": stage.ep, "head_in_flight": share.head_in_flight}  # fmt: skip
    buffers = pipeline_buffer_bytes(cfg, inputs, share)

    def peak_terms(mode: str) -> dict:
        """The activations at the peak and what is held beside them to the end of the backward."""
        if share.moments:
            return {**_zero_bubble_peak(cfg, inputs, share, mode, where), "pipeline_buffers": buffers}
        return {
            "activations": activation_bytes(m, t.micro_batch, t.seq_len, a, mode, **where),
            "zero2_accumulated": zero2_accumulated_bytes(inputs, share.per_device(stage.tp, stage.ep)),
            "pipeline_buffers": buffers,
            "weight_pass_grads": weight_pass_grad_bytes(cfg, inputs, share.local_dense(stage.tp), share.expert),
        }

    terms = {mode: peak_terms(mode) for mode in ACTIVATION_CHECKPOINTING}  # the configured mode among them
    peak = {mode: sum(mode_terms.values()) for mode, mode_terms in terms.items()}
    held = {k: v for k, v in terms[t.activation_checkpointing].items() if k != "activations"}
    act = {
        "micro_batch": t.micro_batch,
        "no_checkpointing": peak["none"],
        "selective": peak["selective"],
        "checkpointing": peak["full"],
        "configured": peak[t.activation_checkpointing],
        **held,
        "configured_mode": t.activation_checkpointing,
        "zero2_staging": staging,  # (during the backward, at its end)
    }
    chosen = sum(state[inputs.scheme][k] for k in STATE_KEYS)
    # The optimizer step comes after the backward: its working memory (Muon's update directions) beside the
    # state and the pipeline's receive buffers, which live for the whole run, when that is more than the peak
    # of the activations.
    step = update["step_work_bytes"] + buffers
    return {"state": state, "activations": act, "step": step, "update": update, "state_total": chosen,
            "total": chosen + max(act["configured"], step), "share": share}  # fmt: skip


def _optimizer_bytes(o: OptimConfig, inputs: PlanInputs, share: RankShare) -> tuple[dict, tuple[int, int], dict]:
    """What the optimizer `o` holds on one pipeline rank, from its own buffer layout (optimus.optim.memory): the
    state bytes under each sharding scheme (with tp > 1 the dense group is sharded over the dp ranks that hold the
    same slices), ZeRO-2's staged gradient buckets alive during the backward and at its end ((0, 0) under ZeRO-1),
    and what its update rule adds to a step of the busiest data-parallel rank: AdamW's works in place; Muon's
    working bytes and bytes received are planned from the parameters' shapes by the ownership code a run executes
    (optimus.optim.muon_plan)."""
    i, stage = inputs, inputs.stage
    rule_step = (0, 0)
    if share.param_shapes is not None:  # Muon
        groups, split_dims = share.param_shapes
        dtype, ns_dtype = TORCH_DTYPES[i.compute_dtype], TORCH_DTYPES[o.muon_ns_dtype]
        rule_step = planned_muon_step_bytes(groups, i.scheme, stage, dtype, i.bucket, split_dims, ns_dtype)
    dense, expert = share.local_dense(stage.tp), share.expert // stage.ep
    per_element = AdamW.state_bytes_per_element
    state = {
        scheme: rank_state_bytes(
            scheme, dense, expert, stage, i.act_bytes, i.grad_bytes, i.zero, state_bytes_per_element=per_element
        ).rounded()
        for scheme in SCHEMES
    }
    update = rank_update_bytes(i.scheme, dense, expert, stage, i.act_bytes, rule_step)
    staging = (0, 0)
    if i.zero == 2:
        staging = rank_zero2_staging_bytes(i.scheme, dense, expert, stage, i.act_bytes, i.grad_bytes, i.bucket)
    return state, staging, {"rule": o.update, **update}


def _stage_row(rank: dict, device: float | None, tp: int, ep: int) -> dict:
    """One pipeline rank's line of the plan."""
    share, activations = rank["share"], rank["activations"]["configured"]
    return {
        "pp_rank": share.pp_rank, "stages": share.stages, "layers": share.layers, "embed": share.embed,
        "head": share.head, "params": share.dense + share.expert + share.head_copy, "in_flight": share.in_flight,
        "params_per_device": share.per_device(tp, ep),
        "state_bytes": rank["state_total"], "activation_bytes": activations, "step_bytes": rank["step"],
        "total_bytes": rank["total"], "fits": fits(rank["total"], device),
    }  # fmt: skip


def device_bytes(cfg: OptimusConfig) -> int | None:
    """The memory of one device of the recipe's machine (machine.memory_gb GiB), or None where it is not set."""
    return round(cfg.machine.memory_gb * GIB) if cfg.machine.memory_gb else None


def fits(peak: float, device: float | None) -> bool | None:
    """The fit rule of every figure: a peak fits a device that holds at least as many bytes (None: unknown)."""
    return None if device is None else peak <= device


def fit_of(peak: int, cfg: OptimusConfig) -> dict:
    """{fits, peak_bytes, device_bytes}: the verdict on one rank's peak (planned or measured), as JSON gives it."""
    device = device_bytes(cfg)
    return {"fits": fits(peak, device), "peak_bytes": peak, "device_bytes": device}


def gib(n: float | None) -> str:
    """Bytes as GiB (MiB below one GiB), or '-' for none."""
    if n is None:
        return "-"
    return f"{n / GIB:.2f} GiB" if n >= GIB else f"{n / 2**20:.2f} MiB"


def does_not_fit_line(fit: dict, whose: str) -> str:
    """The line that comes first in what a dry run or a prediction prints for a layout that does not fit."""
    return (
        f"DOES NOT FIT: {whose} {gib(fit['peak_bytes'])} on a device of {gib(fit['device_bytes'])} "
        "(machine.memory_gb); `optimus plan` with the same arguments shows where the memory goes."
    )


def make_plan(cfg: OptimusConfig, world: int, counts: ParamCounts | None = None) -> Plan:
    """The plan of the busiest rank (with pp > 1, of the pipeline rank that needs the most memory; every
    pipeline rank's figures are in `stages`), for `cfg` on `world` ranks, which it validates, on the device path of
    the recipe's machine."""
    validate(cfg, world)
    return plan_layout(cfg, layout_of(cfg, world), declared_device_path(cfg.machine), counts)


def plan_run(spec: RunSpec) -> Plan:
    """make_plan of a run whose settings are resolved and validated already (optimus.run_spec), on its platform's
    device path."""
    return plan_layout(spec.cfg, spec.layout, spec.platform.path)


def planned_kernels(cfg: OptimusConfig, path: str) -> str:
    """The expert kernels' backend that `cfg.kernels` gives a run on device path `path` (Triton on a GPU where it
    imports: optimus.kernels.resolve_name, as a dry run resolves it)."""
    try:
        return resolve_name(cfg.kernels, TORCH_DEVICE_OF_PATH[path], traced=path != "cpu")
    except KernelUnavailable as err:
        raise ConfigError(str(err)) from None


def plan_layout(cfg: OptimusConfig, layout: Layout, path: str, counts: ParamCounts | None = None) -> Plan:
    """make_plan without the validation, of `cfg` on the ranks `layout` (config_checks.layout_of), on device path
    `path`."""
    m, t = cfg.model, cfg.train
    world, ep, pp, tp = layout.world, layout.ep, layout.pp, layout.tp
    counts = counts or count_params_of_config(m)
    inputs = PlanInputs.of(cfg, layout, path)
    shares = rank_shares(cfg, counts, inputs.stage, inputs.accum)
    ranks = [_rank_plan(cfg, share, inputs) for share in shares]
    busiest = max(ranks, key=lambda r: r["total"])
    state, act = busiest["state"], busiest["activations"]
    compute = inputs.compute_dtype
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
    sharding = inputs.scheme
    device = device_bytes(cfg)
    memory = {"device_bytes": device, "step_bytes": busiest["step"]}
    for key in ("no_checkpointing", "checkpointing", "configured"):
        total = busiest["state_total"] + max(act[key], busiest["step"])  # the larger of the backward's, the step's
        memory[f"total_{key}"] = total
        memory[f"fits_{key}"] = fits(total, device)
    stages = [_stage_row(r, device, tp, ep) for r in ranks] if pp > 1 else []
    params = {**counts.as_dict(), "per_device": busiest["share"].per_device(tp, ep)}
    update = busiest["update"]
    return Plan(
        m.name, world, pp, layout.dp, tp, layout.sp, ep, layout.edp, sharding, layout.shard_ranks,
        cfg.optim.zero, compute, cfg.optim.grad_dtype, params, state, act, flops, memory, stages, update,
    )  # fmt: skip
