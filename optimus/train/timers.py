"""Step-time breakdown (`profile.timers`) and a torch.profiler trace window (`profile.torch`).

The trainer owns one `Timers` and hands it to the parts that communicate when it builds
them (each MoE dispatcher, the pipeline stages, the optimizer); they time their work with

    with self.timers("dispatch_comm") if self.timers else nullcontext():
        ...

Times are *exclusive*: a phase timed inside another (dispatch_comm inside forward)
is subtracted from the outer one, so the phases of a step add up to at most the
step time and stack without double counting. Enabled timers synchronise the
device at every phase boundary (otherwise a GPU phase would only time its kernel
launches), which costs throughput; that is why they are off by default.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable
from contextlib import contextmanager
from pathlib import Path

import torch

from optimus.config_checks import parse_step_window

# Phases in the order a step runs them (the report stacks them in this order).
PHASES = (
    "data_wait",
    "forward",
    "dispatch_comm",
    "combine_comm",
    "backward",
    "grad_reduce",
    "optimizer",
    "param_gather",
)


def phase_key(name: str) -> str:
    return f"time_{name}_s"


class Timers:
    """Named, exclusive wall-clock timers; `pop_totals()` returns and resets the sums since the last call."""

    def __init__(self, enabled: bool = False, synchronize_fn: Callable[[], None] | None = None):
        self.enabled = enabled
        self.synchronize = synchronize_fn or (lambda: None)
        self._totals: dict[str, float] = defaultdict(float)
        self._stack: list[list] = []  # [name, start, seconds spent in nested phases]

    def __bool__(self) -> bool:
        return self.enabled

    @contextmanager
    def __call__(self, name: str):
        if not self.enabled:
            yield
            return
        self.synchronize()
        frame = [name, time.perf_counter(), 0.0]
        self._stack.append(frame)
        try:
            yield
        finally:
            self.synchronize()
            self._stack.pop()
            elapsed = time.perf_counter() - frame[1]
            self._totals[name] += elapsed - frame[2]
            if self._stack:
                self._stack[-1][2] += elapsed

    def pop_totals(self) -> dict[str, float]:
        """{"time_<phase>_s": seconds} for every phase timed since the last call ({} when disabled)."""
        out = {phase_key(name): seconds for name, seconds in self._totals.items()}
        self._totals.clear()
        return out


class TorchTrace:
    """torch.profiler over steps [first, last]; writes a chrome trace per rank into the run directory."""

    def __init__(self, enabled: bool, window: str, run_dir: Path, rank: int, device_type: str):
        self.enabled = enabled
        self.first, self.last = parse_step_window(window) if enabled else (0, 0)
        self.path = Path(run_dir) / f"trace_rank{rank}.json"
        self.device_type = device_type
        self._prof = None

    def _activities(self) -> list:
        acts = [torch.profiler.ProfilerActivity.CPU]
        if self.device_type == "cuda":
            acts.append(torch.profiler.ProfilerActivity.CUDA)
        elif self.device_type == "xpu" and hasattr(torch.profiler.ProfilerActivity, "XPU"):
            acts.append(torch.profiler.ProfilerActivity.XPU)
        return acts

    def before_step(self, step: int) -> None:
        """Call with the 1-based number of the step about to run."""
        if self.enabled and step == self.first and self._prof is None:
            self._prof = torch.profiler.profile(activities=self._activities(), record_shapes=True)
            self._prof.__enter__()

    def after_step(self, step: int) -> None:
        if self._prof is not None and step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop and write the trace (also when the run ends inside the window)."""
        if self._prof is None:
            return
        prof, self._prof = self._prof, None
        prof.__exit__(None, None, None)
        prof.export_chrome_trace(str(self.path))
