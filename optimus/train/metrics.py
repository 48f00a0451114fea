"""What a run writes about itself: run_info.json, metrics.jsonl, console lines and wandb."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch


def expert_tokens(tokens_per_expert_LE: torch.Tensor | None) -> list[list[int]] | None:
    """`tokens_per_expert_LE` (per MoE layer, the step's assignments to each expert over the global batch: a token
    counts once for each of its top_k experts) as lists of ints, read to the host in one transfer; None for a
    model without MoE layers."""
    if tokens_per_expert_LE is None:
        return None
    return [[int(n) for n in row] for row in tokens_per_expert_LE.tolist()]


def expert_load_imbalance(expert_tokens_LE: list[list[int]] | None) -> float | None:
    """Mean over MoE layers of max/mean tokens per expert (1.0 = perfectly balanced)."""
    if not expert_tokens_LE:
        return None
    ratios = [max(row) / max(sum(row) / len(row), 1e-9) for row in expert_tokens_LE]
    return sum(ratios) / len(ratios)


def throughput(tokens: int, seconds: float, flops_per_token: float, world_size: int, peak_flops: float | None) -> dict:
    """tokens/s over the job, model TFLOP/s per device, and MFU (None when the peak is unknown)."""
    tokens_per_s = tokens / seconds
    flops_per_device = tokens_per_s * flops_per_token / world_size
    mfu = flops_per_device / peak_flops if peak_flops else None
    return {"tokens_per_s": tokens_per_s, "tflops_per_device": flops_per_device / 1e12, "mfu": mfu}


def write_json_atomic(path: Path, payload: Any) -> None:
    tmp = path.with_suffix(path.suffix + ".tmp")
    tmp.write_text(json.dumps(payload, indent=2, default=str) + "\n")
    os.replace(tmp, path)


def wandb_values(record: dict, moe_layer_ids: list[int]) -> dict:
    """A record as wandb charts it: `expert_tokens` (a list of lists, which wandb cannot plot) becomes one number
    per MoE layer and expert, `expert_tokens/layer_<block index>/expert_<e>`; None values are left out."""
    values = {k: v for k, v in record.items() if v is not None and k != "expert_tokens"}
    for layer_idx, row in zip(moe_layer_ids, record.get("expert_tokens") or []):
        values.update({f"expert_tokens/layer_{layer_idx}/expert_{e}": n for e, n in enumerate(row)})
    return values


class MetricsLog:
    """Appends one JSON object per optimizer step, and one for a fresh run's starting evaluation (step 0), to
    metrics.jsonl (rank 0 only), and to wandb if enabled; the rows of a record's `expert_tokens` are the MoE
    layers `moe_layer_ids` (block indices), in order."""

    def __init__(self, run_dir: Path, enabled: bool, wandb_run=None, moe_layer_ids: list[int] = ()):
        self.enabled = enabled
        self.wandb_run = wandb_run
        self.moe_layer_ids = list(moe_layer_ids)
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log(wandb_values(clean, self.moe_layer_ids), step=record["step"])

    def close(self) -> None:
        if self.file is not None:
            self.file.close()
        if self.wandb_run is not None:
            self.wandb_run.finish()


def console_line(record: dict, total_steps: int) -> str:
    parts = [
        f"step {record['step']:>5}/{total_steps}",
        f"loss {record['loss']:.4f}",
        f"lm {record['lm_loss']:.4f}",
        f"aux {record['aux_loss']:.3f}",
        f"gnorm {record['grad_norm']:.3f}",
        f"lr {record['lr']:.2e}",
        f"{record['tokens_per_s']:,.0f} tok/s",
    ]
    if record.get("mfu") is not None:
        parts.append(f"MFU {100 * record['mfu']:.1f}%")
    if record.get("expert_load_imbalance") is not None:
        parts.append(f"imbalance {record['expert_load_imbalance']:.2f}")
    return " | ".join(parts)
