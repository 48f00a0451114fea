"""Mixture-of-Experts layer: router, dispatchers and grouped experts."""

from optimus.model.moe.dispatch import Assignments, LocalDispatcher, sort_by_expert
from optimus.model.moe.experts import GroupedExperts, expert_offsets
from optimus.model.moe.layer import MoE
from optimus.model.moe.router import Router, Routing
from optimus.model.moe.stats import RouterStats, attach_router_loss, router_loss

__all__ = [
    "Assignments",
    "GroupedExperts",
    "LocalDispatcher",
    "MoE",
    "Router",
    "RouterStats",
    "Routing",
    "attach_router_loss",
    "expert_offsets",
    "router_loss",
    "sort_by_expert",
]
