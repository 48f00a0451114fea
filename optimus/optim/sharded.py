"""The EP-aware sharded optimizer: a gradient sharder (optimus.optim.sharder) and an update rule (AdamW, Muon).

    reduce    the sharder finishes the step's reductions -> the global norm of the mean gradient
    update    the rule changes each fp32 slice this rank owns (clip factor and 1 / replicas folded into the step)
    gather    the sharder all-gathers the updated slices into the parameters

The rule is plain arithmetic on the owned slices and its own state; the sharder owns every buffer, hook and
collective, so another rule touches none of them. Checkpoints key the state by element ranges of the whole
parameters (optimus.optim.state_ranges), so it loads into any layout and any scheme.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch

from optimus.config import TORCH_DTYPES, OptimConfig
from optimus.optim.adamw import AdamW, AdamWHyper
from optimus.optim.grad_norm import clip_coefficient
from optimus.optim.memory import zero_bucket_bytes
from optimus.optim.muon import NS_COEFFICIENTS, Muon, MuonHyper
from optimus.optim.sharder import GradSharder
from optimus.optim.state_ranges import StateRange, copy_overlap, range_key
from optimus.parallel import ParallelState


class ShardedOptimizer:
    """A sharder and an update rule (see the module docstring): what the trainer, checkpoints and tools use
    (optimus.optim.protocol.Optimizer)."""

    def __init__(self, sharder: GradSharder, rule, grad_clip: float):
        self.sharder, self.rule, self.grad_clip = sharder, rule, grad_clip
        self.scheme, self.update_rule = sharder.scheme, rule.name
        self.step_count = 0

    def step(self, lr: float) -> float:
        """Reduce, clip and apply the gradients; returns the pre-clip global norm (no update if it is not finite)."""
        norm = self.sharder.reduce()
        self.apply(lr, norm)
        return norm

    def reduce_gradients(self) -> torch.Tensor:
        """step() in two halves, for a caller that sums the norm with its own values in one all-reduce and one
        read (optimus.train.trainer): finish the reductions and return this rank's share of the squared norm of
        the summed gradients (fp64, 0-d, on the device); global_norm() of its sum over all ranks is step()'s norm,
        which apply() then takes."""
        return self.sharder.reduce_local()

    def global_norm(self, sq_norm_sum: float) -> float:
        """The global norm of the mean gradient from reduce_gradients()' values summed over every rank."""
        return math.sqrt(sq_norm_sum) * self.sharder.mean_scale

    def apply(self, lr: float, norm: float) -> None:
        """Clip by `norm` (the global norm of the reduced gradients) and update; nothing if it is not finite."""
        if not math.isfinite(norm):
            return
        self.step_count += 1
        grad_scale = clip_coefficient(norm, self.grad_clip) * self.sharder.mean_scale
        self.rule.step(self.sharder, lr, self.step_count, grad_scale)
        self.sharder.gather()

    def zero_grad(self) -> None:
        self.sharder.zero_grad()

    def discard_gradients(self) -> None:
        """Drop this step's gradients without an update (every rank calls it for the same step)."""
        self.sharder.discard_gradients()

    def wait_for_params(self, buckets: dict[str, Iterable[int]] | None = None) -> None:
        self.sharder.wait_for_params(buckets)

    def overlap_param_gather(self, roots: list[torch.nn.Module]) -> None:
        self.sharder.overlap_param_gather(roots)

    # ---- reporting and checkpoints -------------------------------------------

    def state_tensors(self) -> list[torch.Tensor]:
        """The persistent tensors of the sharder (gradient buffers, fp32 master) and of the rule (its state)."""
        return self.sharder.state_tensors() + self.rule.tensors()

    def memory_bytes(self) -> dict[str, int]:
        """Persistent bytes on this rank (parameters, gradients, fp32 master, the rule's state, and padding)."""
        return self.sharder.state_bytes(self.rule.state_bytes_per_element).rounded()

    def update_bytes(self) -> dict[str, int]:
        """The rule's working bytes in a step and the bytes its own gathers receive, beside what the parameters'
        all-gather receives (the keys of optimus.optim.memory.rank_update_bytes, from this rank's layout)."""
        work, received = self.rule.step_bytes(self.sharder)
        params = sum(
            (g.flat.padded_numel - g.flat.shard_numel) * g.flat.buffer.element_size()
            for g in self.sharder.groups.values()
            if g.comm.shard_world > 1
        )
        return {"step_work_bytes": work, "gather_received_bytes": received, "param_gather_received_bytes": params}

    def state_dict(self) -> dict:
        """The rule's state (and the fp32 master) of every owned range, keyed "name[lo:hi]" in the full parameter's
        flat index (or "name[lo:hi]@cols[a:b]" in a block of its columns, optimus.optim.state_ranges).

        The tensors are views of the live state (a checkpoint writer copies or writes them before the next step).
        """
        shards = {}
        for kind, g in self.sharder.groups.items():
            state = self.rule.state[kind]
            for r in g.flat.owned_ranges:
                entry = {
                    "name": r.name, "lo": r.global_lo, "hi": r.global_hi, "shape": list(r.global_shape), "cols": r.cols,
                }  # fmt: skip
                entry.update({k: state[k][r.shard_lo : r.shard_hi] for k in self.rule.state_kinds})
                if g.master is not None:
                    entry["master"] = g.master[r.shard_lo : r.shard_hi]
                shards[range_key(r.name, r.global_lo, r.global_hi, r.cols)] = entry
        return {"step": self.step_count, "scheme": self.scheme, "update": self.update_rule, "shards": shards}

    def load_state_dict(self, state: dict) -> None:
        """Fill every owned range from the saved shards that overlap it (any layout, as long as they cover it)."""
        saved_rule = state.get("update", "adamw")  # checkpoints from before Muon hold AdamW's state
        if saved_rule != self.update_rule:
            raise ValueError(
                f"the optimizer state was saved by optim.update={saved_rule}: resume with optim.update={saved_rule}, "
                "or start from the checkpoint's weights alone (checkpoint.load_weights_only=true)."
            )
        self.wait_for_params()  # the master copy is refreshed from the parameters
        by_name: dict[str, list[dict]] = {}
        for entry in state["shards"].values():
            by_name.setdefault(entry["name"], []).append(entry)
        for kind, g in self.sharder.groups.items():
            if g.master is not None:
                g.refresh_master()  # for ranges saved without a master copy (an fp32 run)
            held = dict(self.rule.state[kind])
            if g.master is not None:
                held["master"] = g.master
            for r in g.flat.owned_ranges:
                mine, covered = StateRange(r.global_lo, r.global_hi, r.global_shape, r.cols), 0
                for e in by_name.get(r.name, []):
                    saved = StateRange(e["lo"], e["hi"], r.global_shape, e.get("cols"))
                    kinds = [k for k in held if k in e]  # each covers the same elements
                    for k in kinds:
                        n = copy_overlap(held[k][r.shard_lo : r.shard_hi], mine, e[k], saved)
                    covered += n if kinds else 0
                if covered != r.global_hi - r.global_lo:
                    raise ValueError(
                        f"the optimizer state does not cover elements [{r.global_lo}, {r.global_hi}) of {r.name}: "
                        "load a checkpoint saved from a model of the same shape, with the shards of every rank."
                    )
        self.step_count = int(state["step"])


def build_sharder(
    model: torch.nn.Module, cfg: OptimConfig, ps: ParallelState, scheme: str, micro_batches: int = 1, timers=None,
    tied=None, grad_sinks: bool = True,
) -> GradSharder:  # fmt: skip
    """The gradient sharder that `cfg` (optim.zero, grad_dtype, bucket_mb, max_collective_numel,
    overlap_param_gather) describes."""
    bucket_bytes = zero_bucket_bytes(cfg.bucket_mb, cfg.zero, cfg.overlap_param_gather)
    return GradSharder(
        model, ps, scheme, cfg.zero, TORCH_DTYPES[cfg.grad_dtype], bucket_bytes, cfg.max_collective_numel,
        micro_batches, timers, tied, grad_sinks,
    )  # fmt: skip


def adamw_hyper(cfg: OptimConfig) -> AdamWHyper:
    return AdamWHyper(cfg.beta1, cfg.beta2, cfg.eps, cfg.weight_decay)


class ShardedAdamW(ShardedOptimizer):
    """AdamW for `optim.sharding=none | standard | ep_aware` over `model`'s trainable parameters (see
    optimus.optim.sharder). `micro_batches`: the backwards of one optimizer step (ZeRO-2 reduces after the last);
    `tied`: tie_embeddings across pipeline stages (optimus.parallel.pipeline.TiedEmbedding); `grad_sinks`: offer
    kernels the fp32 gradient sums to add weight gradients into (optimus.kernels.grad_sink; under a schedule
    with a weight pass of its own, config.WEIGHT_PASS_SCHEDULES, only where optimus.optim.weight_pass_sinks)."""

    def __init__(
        self, model: torch.nn.Module, cfg: OptimConfig, ps: ParallelState, grad_clip: float, scheme: str,
        timers=None, micro_batches: int = 1, tied=None, grad_sinks: bool = True,
    ):  # fmt: skip
        sharder = build_sharder(model, cfg, ps, scheme, micro_batches, timers, tied, grad_sinks)
        shards = {kind: (g.flat.shard_numel, g.flat.device) for kind, g in sharder.groups.items()}
        super().__init__(sharder, self.make_rule(cfg, shards), grad_clip)

    @staticmethod
    def make_rule(cfg: OptimConfig, shards: dict[str, tuple[int, torch.device]]) -> AdamW:
        return AdamW(adamw_hyper(cfg), shards)


class ShardedMuon(ShardedAdamW):
    """Muon for the hidden matrices and AdamW for the rest (optimus.optim.muon), on the same sharder as
    ShardedAdamW; the arguments are ShardedAdamW's."""

    @staticmethod
    def make_rule(cfg: OptimConfig, shards: dict[str, tuple[int, torch.device]]) -> Muon:
        muon = MuonHyper(
            cfg.muon_momentum, cfg.muon_nesterov, cfg.muon_ns_steps, NS_COEFFICIENTS, cfg.muon_adjust_lr,
            TORCH_DTYPES[cfg.muon_ns_dtype],
        )  # fmt: skip
        return Muon(muon, adamw_hyper(cfg), shards)
