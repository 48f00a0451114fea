"""Optimus: pretraining Mixture-of-Experts language models with expert parallelism."""

__version__ = "0.1.0"
