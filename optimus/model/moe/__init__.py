"""Mixture-of-Experts layer: router, dispatchers and grouped experts."""

from optimus.model.moe.dispatch import Assignments, LocalDispatcher, sort_by_expert
from optimus.model.moe.experts import GroupedExperts
from optimus.model.moe.layer import MoE, MoEStats
from optimus.model.moe.router import Router, Routing

__all__ = ["Assignments", "GroupedExperts", "LocalDispatcher", "MoE", "MoEStats", "Router", "Routing", "sort_by_expert"]
