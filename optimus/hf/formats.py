"""The three Hugging Face MoE architectures Optimus reads and writes, and what tells them apart.

All three are the same decoder (RMSNorm, RoPE, GQA attention, softmax top-k router,
SwiGLU experts); they differ in QK-norm, in the names of their tensors, in which config
key holds the expert hidden size, and in what their routers may do:

    OlmoeForCausalLM      q/k RMSNorm over the whole projection; experts gate/up/down_proj
    Qwen3MoeForCausalLM   q/k RMSNorm per head; leading dense layers (mlp_only_layers)
    MixtralForCausalLM    no QK-norm; top-k weights always renormalised; experts w1/w3/w2
"""

from __future__ import annotations

from dataclasses import dataclass

from optimus.config import ConfigError, ModelConfig, qk_norm_mode


@dataclass(frozen=True)
class HFFormat:
    architecture: str  # config.json "architectures"[0]
    model_type: str  # config.json "model_type"
    qk_norm: str  # model.qk_norm this format implies
    moe_prefix: str  # module of a layer's MoE block
    expert_names: tuple[str, str, str]  # gate, up, down projections of one expert
    expert_dim_key: str  # config key of the expert hidden size
    n_experts_key: str  # config key of the number of experts
    dense_layers: bool  # supports leading dense layers (first_k_dense)
    always_norm_topk: bool  # the router always renormalises the top-k weights
    aux_loss_coef: float  # transformers' router_aux_loss_coef when config.json gives none


_SWIGLU_NAMES = ("gate_proj", "up_proj", "down_proj")
OLMOE = HFFormat(
    architecture="OlmoeForCausalLM", model_type="olmoe", qk_norm="full", moe_prefix="mlp",
    expert_names=_SWIGLU_NAMES, expert_dim_key="intermediate_size", n_experts_key="num_experts", dense_layers=False,
    always_norm_topk=False, aux_loss_coef=0.01,
)  # fmt: skip
QWEN3_MOE = HFFormat(
    architecture="Qwen3MoeForCausalLM", model_type="qwen3_moe", qk_norm="head", moe_prefix="mlp",
    expert_names=_SWIGLU_NAMES, expert_dim_key="moe_intermediate_size", n_experts_key="num_experts", dense_layers=True,
    always_norm_topk=False, aux_loss_coef=0.001,
)  # fmt: skip
MIXTRAL = HFFormat(
    architecture="MixtralForCausalLM", model_type="mixtral", qk_norm="none", moe_prefix="block_sparse_moe",
    expert_names=("w1", "w3", "w2"), expert_dim_key="intermediate_size", n_experts_key="num_local_experts",
    dense_layers=False, always_norm_topk=True, aux_loss_coef=0.001,
)  # fmt: skip
FORMATS = {f.model_type: f for f in (OLMOE, QWEN3_MOE, MIXTRAL)}


def format_of_hf_config(hf: dict) -> HFFormat:
    """The format a config.json describes (by model_type, else by architecture)."""
    if hf.get("model_type") in FORMATS:
        return FORMATS[hf["model_type"]]
    for fmt in FORMATS.values():
        if fmt.architecture in (hf.get("architectures") or []):
            return fmt
    found = hf.get("model_type") or hf.get("architectures")
    raise ConfigError(
        f"config.json describes {found!r}, which Optimus cannot read: give a directory of one of "
        f"{', '.join(f.architecture for f in FORMATS.values())}."
    )


def format_for_model(cfg: ModelConfig) -> HFFormat:
    """The format that holds `cfg` exactly: chosen by its QK-norm, then checked for what that format lacks."""
    mode = qk_norm_mode(cfg.qk_norm)
    fmt = next(f for f in FORMATS.values() if f.qk_norm == mode)
    moe = cfg.moe
    problems = []
    if moe.n_experts == 0:
        problems.append("it is a dense model (model.moe.n_experts=0)")
    if moe.router != "softmax":
        problems.append(f"its router is {moe.router} (these formats have softmax routers)")
    if moe.n_shared_experts:
        problems.append("it has shared experts")
    if moe.n_groups > 1 or moe.routed_scaling_factor != 1.0:
        problems.append("it uses group-limited routing or routed_scaling_factor")
    if cfg.first_k_dense and not fmt.dense_layers:
        problems.append(f"it has dense layers (first_k_dense={cfg.first_k_dense}), which {fmt.architecture} lacks")
    if fmt.always_norm_topk and not moe.norm_topk:
        problems.append(f"{fmt.architecture} always renormalises the top-k weights (set model.moe.norm_topk=true)")
    if problems:
        raise ConfigError(
            f"model {cfg.name!r} (qk_norm={mode}, so {fmt.architecture}) cannot be written in a Hugging Face format: "
            + "; ".join(problems)
            + "."
        )
    return fmt
