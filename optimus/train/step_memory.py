"""The memory of one training step by category, measured by torch's MemTracker.

The same recorder runs in a real run (`profile.memory=true`: run.dir/memory/rank<R>.json after the first
step) and in a dry run on fake tensors (optimus.dry_run), so the two can be compared byte for byte. It is
handed the model and the optimizer's persistent tensors before the step (parameters and buffers are
counted as such; gradient buffers, fp32 master and moments as "other"), then counts every tensor the step
creates: in a forward as activations, in a backward as temporaries, as they are created and freed.
"""

from __future__ import annotations

import weakref

import torch

# MemTracker's categories, by the names a record gives them.
CATEGORIES = {"Parameter": "params", "Buffer": "buffers", "Gradient": "grads", "Activation": "activations",
              "Temp": "temporaries", "Optstate": "optimizer", "Other": "other"}  # fmt: skip


def step_memory_tracker(model: torch.nn.Module, optimizer):
    """A MemTracker of one step of `model` and `optimizer` (enter it around the step; `record(tracker)` after).

    Reduced to what is read here, the peak by category over the step: its per-module statistics are not
    kept, since updating them after every op walks every module seen so far (60% of a 7B rank's dry run),
    and its per-module bookkeeping refuses a root module's second forward (the step's next micro-batch) and
    fails on the interleaved schedules. It also cannot read a sparse tensor's storage."""
    from optimus.kernels.torch_private import _TOTAL_KEY, MemTracker, leaf_safe_mod_tracker

    class StepMemTracker(MemTracker):
        def __init__(self):
            super().__init__()
            self._mod_tracker = leaf_safe_mod_tracker()  # zero bubble's input pass is an autograd.grad

        def _track(self, reftype, t: torch.Tensor) -> None:
            if t.layout == torch.strided:  # a sparse tensor (the CPU combine's) has no storage of its own:
                super()._track(reftype, t)  # its index and value tensors are counted where they are made

        def _update_peak_stats(self, peak_state) -> None:
            for dev, snap in self._curr_mem_snap.items():
                if self._peak_mem.get(dev, 0) < snap[_TOTAL_KEY]:
                    self._peak_mem[dev] = snap[_TOTAL_KEY]
                    self._peak_mem_snap[dev] = dict(snap)

        # The module hooks keep only what the peak's categories need: a module's parameters and buffers, tracked
        # at its first forward, and whether a backward is recomputing a checkpointed region (what it creates
        # there is an activation, not a temporary). No per-module snapshots: a module runs again for every
        # micro-batch, and an interleaved pipeline rank's stages (several root modules) take turns, forwards and
        # backwards interleaved, which MemTracker's per-module bookkeeping refuses (a root's second forward) or
        # loses (a KeyError in the backward of a module whose statistics were reset).
        def _pre_fw_hook(self, module, inputs):
            if module not in self.memory_tracking:
                super()._pre_fw_hook(module, inputs)
            elif self._mod_tracker.is_bw and self._ac_mod is None:
                self._ac_mod, self._in_ac = weakref.ref(module), True

        def _post_fw_hook(self, module, inputs, outputs):
            if self._mod_tracker.is_bw and self._ac_mod is not None and self._ac_mod() is module:
                self._ac_mod, self._in_ac = None, False

        # MemTracker's backward hooks keep per-module statistics, which the per-category peak does not read and
        # which a second backward of the same module (interleaved schedules) broke: nothing to do here.
        def _pre_bw_hook(self, module, args):
            pass

        def _post_bw_hook(self, module, args):
            pass

    tracker = StepMemTracker()
    tracker.track_external(model, *optimizer.state_tensors())
    return tracker


def record(tracker) -> dict:
    """{peak_bytes, by_category} of the device with the largest peak (bytes at that moment, by category)."""
    peaks = tracker.get_tracker_snapshot("peak")
    busiest = max(peaks.values(), key=lambda snapshot: snapshot["Total"])
    return {
        "peak_bytes": busiest["Total"],
        "by_category": {CATEGORIES[k.value]: v for k, v in busiest.items() if k != "Total"},
    }
