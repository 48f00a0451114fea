"""A run's settings resolved once, before anything is built.

`resolve_run(cfg, world_size, platform)` is the one place a run's configuration is validated and its `auto`
choices made for the machine: it returns a RunSpec holding a copy of the config with `train.dtype` resolved for
the device (what config.yaml records), validated for `world_size` ranks, beside the platform this process
drives and the ranks' Layout (optimus.layout). Nothing changes the config afterwards. The `optimus train`
command resolves once per process; the ranks it starts itself receive the resolved config and detect only their
own device (`for_rank`).
"""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass

from optimus.config import OptimusConfig
from optimus.config_checks import layout_of, validate
from optimus.layout import Layout
from optimus.platform import Platform, resolve_dtype


@dataclass(frozen=True)
class RunSpec:
    cfg: OptimusConfig  # validated for world_size, train.dtype resolved; not changed after
    world_size: int
    platform: Platform  # this process's device and collective backend
    layout: Layout  # the ranks' layout (optimus.layout), computed once here

    def for_rank(self, platform: Platform) -> RunSpec:
        """The same run on another process of the same machine, which drives `platform` (its own device)."""
        return dataclasses.replace(self, platform=platform)


def resolve_run(cfg: OptimusConfig, world_size: int, platform: Platform) -> RunSpec:
    """Validate `cfg` for `world_size` ranks and resolve its `auto` choices for `platform`, in a copy."""
    resolved = copy.deepcopy(cfg)
    resolved.train.dtype = resolve_dtype(cfg.train.dtype, platform.device_type)
    validate(resolved, world_size)
    return RunSpec(resolved, world_size, platform, layout_of(resolved, world_size))
