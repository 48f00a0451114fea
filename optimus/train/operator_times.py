"""Every operator of a window of steps timed inside the step itself (`profile.operators`).

The performance model prices a step by its traced operators, each timed alone on fresh inputs
(optimus.perf.op_timing). Whether that is what the step pays is a question only the step can answer: an operator
may run slower among its neighbours (caches, page faults, a communication thread on the same cores), and the
step may run operators the trace does not (a data-dependent branch). With `profile.operators=true` each operator
that reaches the dispatcher in the steps of `profile.torch_steps` (below autograd: what the model's trace
records, forward, backward and optimizer) is timed by the host's clock around its call, under the signature the
model's replay uses. On an accelerator the device is synchronised before and after each one, so that its time
is its kernel's; that slows the step, which is then for comparing operators, not for its throughput.

Per rank, `run.dir/operators/rank<R>.json`: {"format", "steps": [first, last], "step_wall_s": [each step's
seconds, the timing's overhead included], "operators": {signature: [calls per step, seconds per step]}}.
`benchmarks/step_operators.py` sets it against the replay and the trace.
"""

from __future__ import annotations

import time
from collections import Counter
from pathlib import Path

import torch

from optimus.config_checks import parse_step_window
from optimus.kernels.torch_private import TorchDispatchMode
from optimus.operators import op_signature
from optimus.train.metrics import write_json_atomic

FORMAT = "optimus-step-operators-v1"


class _TimedOperators(TorchDispatchMode):
    def __init__(self, synchronize):
        super().__init__()
        self.synchronize = synchronize  # None on a CPU
        self.seconds: Counter = Counter()
        self.calls: Counter = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if self.synchronize is not None:
            self.synchronize()
        start = time.perf_counter()
        out = func(*args, **kwargs)
        if self.synchronize is not None:
            self.synchronize()
        seconds = time.perf_counter() - start
        signature = op_signature(func, args, kwargs) or str(func)  # unreplayable calls keep the operator's name
        self.seconds[signature] += seconds
        self.calls[signature] += 1
        return out


class OperatorTimes:
    """The timing of the steps [first, last] (1-based), written per rank when the window ends or the run does."""

    def __init__(self, enabled: bool, window: str, run_dir: Path, rank: int, device_type: str):
        self.enabled = enabled
        self.first, self.last = parse_step_window(window) if enabled else (0, 0)
        self.path = Path(run_dir) / "operators" / f"rank{rank}.json"
        self.synchronize = None if device_type == "cpu" else torch.get_device_module(device_type).synchronize
        self._mode: _TimedOperators | None = None
        self._started = 0.0
        self._walls: list[float] = []

    def before_step(self, step: int) -> None:
        """Call with the 1-based number of the step about to run."""
        if self.enabled and self.first <= step <= self.last:
            if self._mode is None:
                self._mode = _TimedOperators(self.synchronize)
                self._mode.__enter__()
            self._started = time.perf_counter()

    def after_step(self, step: int) -> None:
        if self._mode is None:
            return
        self._walls.append(time.perf_counter() - self._started)
        if step >= self.last:
            self.close()

    def close(self) -> None:
        """Stop timing and write the file (also when the run ends inside the window)."""
        if self._mode is None:
            return
        mode, self._mode = self._mode, None
        mode.__exit__(None, None, None)
        steps = max(len(self._walls), 1)
        operators = {sig: [mode.calls[sig] / steps, seconds / steps] for sig, seconds in mode.seconds.items()}
        self.path.parent.mkdir(exist_ok=True)
        payload = {"format": FORMAT, "steps": [self.first, self.first + len(self._walls) - 1],
                   "step_wall_s": self._walls, "operators": operators}  # fmt: skip
        write_json_atomic(self.path, payload)
