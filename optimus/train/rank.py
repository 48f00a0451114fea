"""The body of one training rank, as `optimus train` runs it: in this process (inside a launcher, or alone), or
in each of the processes that `parallel.nproc=N` starts (optimus.local_launcher)."""

from __future__ import annotations

from optimus.run_spec import RunSpec


def run_rank(spec: RunSpec) -> dict:
    """Join the process group (if any), train, leave; the run's summary (Trainer.fit)."""
    import torch.distributed as dist

    from optimus.cpu_runtime import keep_cpu_allocations, quiet_gloo_alltoall_fallback, share_cpu_threads
    from optimus.ranks import discover, init_process_group
    from optimus.train.run_dir import remove_if_empty
    from optimus.train.trainer import Trainer

    info = discover()
    platform = spec.platform
    if platform.device_type == "cpu":
        share_cpu_threads(info.local_world_size)
        keep_cpu_allocations()
        quiet_gloo_alltoall_fallback()
    if info.world_size > 1:
        init_process_group(info, platform.backend, platform.device, spec.cfg.parallel.timeout_s)
    try:
        return Trainer(spec, info.local_rank).fit()
    except BaseException:
        remove_if_empty()  # a run that failed to start leaves no empty run directory behind
        raise
    finally:
        if dist.is_initialized():
            dist.destroy_process_group()


def run_spawned_rank(spec: RunSpec) -> dict:
    """Body of a rank that `parallel.nproc=N` started, with the run its parent resolved: it detects only its own
    device. A user error goes to the parent, which says it once."""
    from optimus.config import ConfigError
    from optimus.data.errors import DataError
    from optimus.local_launcher import report_user_error
    from optimus.platform import detect_platform
    from optimus.ranks import LaunchError, discover

    try:
        return run_rank(spec.for_rank(detect_platform(spec.cfg.machine, discover().local_rank)))
    except (ConfigError, DataError, LaunchError) as err:
        report_user_error(str(err))
        raise SystemExit(2) from None
