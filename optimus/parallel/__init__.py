"""Process groups and the layout of ranks (DP x EP), applied to the model from outside."""

from optimus.parallel.parallelize import parallelize_model
from optimus.parallel.state import ParallelState, build_parallel_state

__all__ = ["ParallelState", "build_parallel_state", "parallelize_model"]
