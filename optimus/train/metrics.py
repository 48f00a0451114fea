"""What a run writes about itself: run_info.json, metrics.jsonl, console lines and wandb."""

from __future__ import annotations

import json
import math
import os
from pathlib import Path
from typing import Any

import torch


def expert_load_imbalance(tokens_per_expert_LE: torch.Tensor | None) -> float | None:
    """Mean over MoE layers of max/mean tokens per expert (1.0 = perfectly balanced)."""
    if tokens_per_expert_LE is None:
        return None
    mean_L = tokens_per_expert_LE.mean(dim=1).clamp_min(1e-9)
    return (tokens_per_expert_LE.max(dim=1).values / mean_L).mean().item()


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


class MetricsLog:
    """Appends one JSON object per optimizer step to metrics.jsonl (rank 0 only), and to wandb if enabled."""

    def __init__(self, run_dir: Path, enabled: bool, wandb_run=None):
        self.enabled = enabled
        self.wandb_run = wandb_run
        self.file = open(run_dir / "metrics.jsonl", "a") if enabled else None

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        self.file.write(json.dumps(clean) + "\n")
        self.file.flush()
        if self.wandb_run is not None:
            self.wandb_run.log({k: v for k, v in clean.items() if v is not None}, step=record["step"])

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
