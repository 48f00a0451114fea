"""What a run writes about itself: run_info.json, metrics.jsonl, console lines and wandb."""

from __future__ import annotations

import errno
import json
import math
import os
from collections.abc import Iterable
from pathlib import Path
from typing import Any

from optimus.config import ConfigError


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


# Errors of a full file system, in words.
NO_SPACE = {errno.ENOSPC: "no space left on", errno.EDQUOT: "disk quota exceeded on"}
FULL_BELOW_BYTES = 2**20  # a write that failed where less than this is left ran out of space


class RunWriteError(OSError):
    """A file the run writes could not be written (the OSError's errno and words, with the file's path); the file
    is as it was before the write (a replaced file whole, an appended one without the cut line). The trainer says
    it in one sentence with what the run kept."""

    def __init__(self, path: Path, error: OSError):
        super().__init__(error.errno, error.strerror or str(error), str(path))
        self.path = Path(path)


def _space_left(where: Path) -> int | None:
    """Bytes this user may still write on the file system of `where` (or of its nearest existing parent)."""
    for path in (where, *where.parents):
        try:
            stats = os.statvfs(path)
        except OSError:
            continue
        return stats.f_bavail * stats.f_frsize
    return None


def write_problem(errors: Iterable[BaseException], where: Path) -> tuple[str, str]:
    """(the cause of a failed write in words, what to do) for a write into `where`: a full disk is named as
    such, also when no error says so (torch's writer turns ENOSPC into "[enforce fail at inline_container.cc]
    unexpected pos", and an error from another rank arrives without the OSError it was raised from); otherwise
    the first file system error (or any error)."""
    errors = list(errors)
    for e in errors:
        if isinstance(e, OSError) and e.errno in NO_SPACE:
            return f"{NO_SPACE[e.errno]} {where}", "free space there"
    left = _space_left(Path(where))
    if left is not None and left < FULL_BELOW_BYTES:
        return f"{NO_SPACE[errno.ENOSPC]} {where}", "free space there"
    first = next((e for e in errors if isinstance(e, OSError)), errors[0])
    text = (str(first).strip() or "no message").splitlines()[0][:300]
    return f"{type(first).__name__}: {text}", f"fix that in {where}"


def _write_all(fd: int, data: bytes) -> None:
    """os.write until every byte is written (a write may take part of them, as on a disk filling up)."""
    view = memoryview(data)
    while view:
        view = view[os.write(fd, view) :]


def write_text_atomic(path: Path, text: str) -> None:
    """Replace `path` with `text` whole, or leave it as it was: written to a temporary file beside it (removed
    again if writing fails), synced, then renamed over it. Raises RunWriteError."""
    path = Path(path)
    tmp = path.with_name(path.name + ".tmp")
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW, 0o666)
        try:
            _write_all(fd, text.encode())
            os.fsync(fd)
        finally:
            os.close(fd)
        os.replace(tmp, path)
    except OSError as err:
        tmp.unlink(missing_ok=True)
        raise RunWriteError(path, err) from err


def write_json_atomic(path: Path, payload: Any) -> None:
    write_text_atomic(path, json.dumps(payload, indent=2, default=str) + "\n")


def wandb_refusal() -> ConfigError | None:
    """Why wandb.init would fail for logging.wandb=true, in one sentence, or None: found without the network
    or a prompt, with wandb's own lookup of credentials (WANDB_API_KEY, `wandb login`'s ~/.netrc, its settings
    files), unless its mode (WANDB_MODE=offline or disabled) needs none."""
    try:
        import wandb  # noqa: F401 (the package itself, not only the lookup below)
    except ImportError:
        return ConfigError(
            "logging.wandb=true needs the wandb package, which is not installed: pip install wandb, or set "
            "logging.wandb=false."
        )
    try:
        from wandb.errors import Error as WandbError
        from wandb.sdk import wandb_setup
        from wandb.sdk.lib import wbauth
    except ImportError:  # an older wandb, without this lookup: its wandb.init checks for itself, as it always did
        return None
    try:
        settings = wandb_setup.singleton().settings  # what wandb.init will use in this process
        if settings.mode in ("offline", "dryrun", "disabled"):
            return None
        host = wbauth.HostUrl(settings.base_url, app_url=settings.app_url)
        found = wbauth.authenticate_session(host=host, source="optimus", prompt=False, update_session=False)
    except WandbError as err:  # credentials it cannot use (an API key of the wrong form)
        return ConfigError(f"logging.wandb=true, but W&B refuses its credentials ({err}): {_WANDB_REMEDY}")
    except (AttributeError, TypeError):  # a wandb whose internal lookup changed shape: its wandb.init decides
        return None
    if found is None:
        return ConfigError(f"logging.wandb=true, but no W&B API key is configured for {host.url}: {_WANDB_REMEDY}")
    return None


_WANDB_REMEDY = (
    "log in with `wandb login` (or set WANDB_API_KEY), run with WANDB_MODE=offline to keep the logs in the run "
    "directory for a later `wandb sync`, or set logging.wandb=false."
)


def wandb_values(record: dict, moe_layer_ids: list[int]) -> dict:
    """A record as wandb charts it: `expert_tokens` (a list of lists, which wandb cannot plot) becomes one number
    per MoE layer and expert, `expert_tokens/layer_<block index>/expert_<e>`; None values are left out."""
    values = {k: v for k, v in record.items() if v is not None and k != "expert_tokens"}
    for layer_idx, row in zip(moe_layer_ids, record.get("expert_tokens") or []):
        values.update({f"expert_tokens/layer_{layer_idx}/expert_{e}": n for e, n in enumerate(row)})
    return values


class MetricsLog:
    """Appends one JSON object per optimizer step, and one for a fresh run's starting evaluation (step 0), to
    metrics.jsonl (rank 0 only), and to wandb once `wandb_run` is set; the rows of a record's `expert_tokens`
    are the MoE layers `moe_layer_ids` (block indices), in order. Opening creates metrics.jsonl: the first file
    a run writes, which tells its directory from one that holds other files (optimus.train.run_dir)."""

    def __init__(self, run_dir: Path, enabled: bool, wandb_run=None, moe_layer_ids: list[int] = ()):
        self.enabled = enabled
        self.wandb_run = wandb_run
        self.moe_layer_ids = list(moe_layer_ids)
        self.path = Path(run_dir) / "metrics.jsonl"
        self.fd = None
        if enabled:
            try:
                self.fd = os.open(self.path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | os.O_NOFOLLOW, 0o666)
            except OSError as err:
                raise RunWriteError(self.path, err) from err

    def log(self, record: dict) -> None:
        if not self.enabled:
            return
        clean = {k: (None if isinstance(v, float) and not math.isfinite(v) else v) for k, v in record.items()}
        end = os.fstat(self.fd).st_size
        try:
            _write_all(self.fd, (json.dumps(clean) + "\n").encode())
        except OSError as err:  # a line cut short (a full disk) is no record: the file ends at the last whole one
            os.ftruncate(self.fd, end)
            raise RunWriteError(self.path, err) from err
        if self.wandb_run is not None:
            self.wandb_run.log(wandb_values(clean, self.moe_layer_ids), step=record["step"])

    def close(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None
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
