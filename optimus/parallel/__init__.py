"""Process groups and the layout of ranks (PP x DP x TP, MoE layers EDP x EP), applied to the model from outside:
`parallelize` applies a whole layout to a model built on meta, `parallelize_model` expert parallelism alone to
any model with Optimus MoE layers."""

from optimus.parallel.expert_parallel import parallelize_model
from optimus.parallel.parallelize import ParallelModel, parallelize
from optimus.parallel.state import ParallelState, build_parallel_state

__all__ = ["ParallelModel", "ParallelState", "build_parallel_state", "parallelize", "parallelize_model"]
