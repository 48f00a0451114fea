"""A training step makes no tensor from host data where it could fill one on the device.

On a GPU, `torch.tensor(x, device=...)` or `t.new_tensor([x])` is a copy from pageable host memory, which PyTorch
makes blocking: the host waits for the device's whole queue. An H200's profile of a one-device step found 81
such waits per step, 78 of them from two lines (the router's token count, once per MoE layer and micro-batch;
the fused AdamW's step count, once per owned slice). On a CPU the same calls show as `aten.lift_fresh`, which
this test counts by the function that made it.
"""

import collections
import traceback

import torch
from torch.utils._python_dispatch import TorchDispatchMode

from optimus.recipes import load_config
from optimus.train.trainer import Trainer
from tests.conftest import SMALL_MODEL_RUN

# Reads its value back at once (a sync in any case), once per logged step
READ_BACK_AT_ONCE = {"_max_peak_memory"}


class TensorsFromHostData(TorchDispatchMode):
    """Counts `aten.lift_fresh` (a tensor made from Python or NumPy data) by the Optimus function that asked."""

    def __init__(self):
        super().__init__()
        self.by_function = collections.Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten.lift_fresh.default:
            ours = [frame for frame in traceback.extract_stack() if "/optimus/" in frame.filename]
            self.by_function[ours[-1].name if ours else "outside optimus"] += 1
        return func(*args, **(kwargs or {}))


def test_a_step_fills_its_scalars_on_the_device(tmp_path, corpus_file):
    overrides = [*SMALL_MODEL_RUN, "data=text", f"data.path={corpus_file}", f"run.dir={tmp_path / 'run'}"]
    overrides += ["train.steps=2", "train.micro_batch=4", "optim.update=adamw", "logging.progress=false"]
    trainer = Trainer.from_config(load_config(overrides))
    with TensorsFromHostData() as made:
        trainer.fit()
    assert set(made.by_function) <= READ_BACK_AT_ONCE, made.by_function
