"""Reading run directories (config.yaml, run_info.json, metrics.jsonl) for the scaling report."""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

import yaml

from optimus.config import ConfigError
from optimus.platform import parse_cpu_list


class ReportError(ConfigError):
    """Runs that cannot be reported (missing files, too few steps, or not comparable); the message says why."""


@dataclass
class Run:
    path: Path
    config: dict  # the resolved config.yaml
    info: dict  # run_info.json
    records: list[dict]  # metrics.jsonl, one per optimizer step (the starting evaluation, step 0, left out)

    @property
    def name(self) -> str:
        return self.path.name

    @property
    def world(self) -> int:
        return int(self.info["layout"]["world"])

    # From world, pp, tp and ep rather than read: run_info.json's `dp` held the expert-data-parallel degree
    # (world / (pp x ep)) before it was named `edp`, so runs written before that still read right.
    @property
    def dp(self) -> int:
        """The data-parallel degree, world / (pp x tp): ranks that read different batches."""
        return self.world // (self.pp * self.tp)

    @property
    def edp(self) -> int:
        """The expert-data-parallel degree, world / (pp x ep): the replicas of each expert."""
        return self.world // (self.pp * self.ep)

    @property
    def ep(self) -> int:
        return int(self.info["layout"]["ep"])

    @property
    def pp(self) -> int:  # runs from before pipeline parallelism have no pp (nor tp) in their layout: 1
        return int(self.info["layout"].get("pp", 1))

    @property
    def tp(self) -> int:
        return int(self.info["layout"].get("tp", 1))

    @property
    def tokens_per_step(self) -> int:
        return int(self.info["tokens_per_step"])

    @property
    def global_batch(self) -> int:
        return int(self.config["train"]["global_batch"])

    @property
    def flops_per_token(self) -> float:
        return float(self.info["flops_per_token"])

    @property
    def peak_flops(self) -> float | None:
        peak = self.info.get("device", {}).get("peak_flops")
        return float(peak) if peak else None

    @property
    def device_name(self) -> str:
        device = self.info.get("device", {})
        return f"{device.get('name', '?')} ({device.get('type', '?')})"


# What the report reads from each file; a run directory that lacks one is named with the key.
INFO_NEEDS = ("layout.world", "layout.ep", "tokens_per_step", "flops_per_token")
CONFIG_NEEDS = ("train.global_batch",)


def _read_json(path: Path) -> dict:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as err:
        raise ReportError(
            f"{path} is not valid JSON ({err.msg} at line {err.lineno}): rerun or repair that run."
        ) from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} holds a {type(data).__name__}, not a JSON object: rerun or repair that run.")
    return data


def _read_yaml(path: Path) -> dict:
    try:
        data = yaml.safe_load(path.read_text())
    except yaml.YAMLError as err:
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ReportError(f"{path} is not valid YAML ({first}): rerun or repair that run.") from None
    if not isinstance(data, dict):
        raise ReportError(f"{path} does not hold a config mapping: rerun or repair that run.")
    return data


def _require(data: dict, keys: tuple[str, ...], path: Path) -> None:
    for key in keys:
        node = data
        for part in key.split("."):
            node = node.get(part) if isinstance(node, dict) else None
        if not isinstance(node, (int, float)) or isinstance(node, bool):
            raise ReportError(f"{path} has no number at {key}: pass run directories written by `optimus train`.")


def _read_metrics(path: Path) -> list[dict]:
    records = []
    for lineno, line in enumerate(path.read_text().splitlines(), start=1):
        if not line.strip():
            continue
        try:
            record = json.loads(line)
        except json.JSONDecodeError:
            record = None
        if isinstance(record, dict) and record.get("step") == 0:
            continue  # the starting evaluation: no step was run, nothing was timed
        timed = isinstance(record, dict) and (record.get("step_time_s") is not None or "tokens_per_s" in record)
        if not (timed and isinstance(record.get("step"), int)):
            raise ReportError(
                f"{path} line {lineno} is not a step record (a JSON object with step and step_time_s): "
                "remove that line or rerun the run."
            )
        records.append(record)
    return records


def load_run(path: str | Path) -> Run:
    """Read one run directory; raises ReportError naming the file that is missing or broken."""
    path = Path(path)
    if not path.is_dir():
        raise ReportError(f"{path} is not a directory: pass run directories (run.dir) written by `optimus train`.")
    for name in ("config.yaml", "run_info.json", "metrics.jsonl"):
        if not (path / name).is_file():
            raise ReportError(f"{path} has no {name}: pass run directories written by `optimus train`.")
    config, info = _read_yaml(path / "config.yaml"), _read_json(path / "run_info.json")
    _require(config, CONFIG_NEEDS, path / "config.yaml")
    _require(info, INFO_NEEDS, path / "run_info.json")
    return Run(path, config, info, _read_metrics(path / "metrics.jsonl"))


def shared_cores(run: Run) -> str | None:
    """On a CPU, where one host's ranks ran more intra-op threads than the cores they could run on (run_info.json's
    per-rank host, cpus and threads), a phrase saying so: their step times then measure the contention, not the
    layout. None otherwise, for accelerator runs (whose CPU threads mostly wait) and for runs without the record."""
    per_rank = run.info.get("per_rank") or []
    if run.info.get("device", {}).get("type") != "cpu" or not all(
        isinstance(r, dict) and {"host", "cpus", "threads"} <= r.keys() for r in per_rank
    ):
        return None
    hosts: dict[str, list] = {}  # host -> [ranks, threads, cores]
    for rank in per_rank:
        host = hosts.setdefault(rank["host"], [0, 0, set()])
        host[0] += 1
        host[1] += int(rank["threads"])
        host[2] |= parse_cpu_list(rank["cpus"])
    for name, (ranks, threads, cores) in hosts.items():
        if threads > len(cores):
            return f"its {ranks} ranks ran {threads} threads on the {len(cores)} cores of {name}"
    return None


def measured_records(run: Run, warmup_steps: int) -> list[dict]:
    """The records after the first `warmup_steps` optimizer steps (compilation, allocator and cache warm-up)."""
    kept = [r for r in run.records if int(r["step"]) > warmup_steps]
    if not kept:
        raise ReportError(
            f"{run.path} has {len(run.records)} steps and none is left after --warmup-steps {warmup_steps}: "
            "lower --warmup-steps or train the run for more steps."
        )
    return kept


def step_time(record: dict, tokens_per_step: int) -> float:
    """Seconds of one step: `step_time_s`, or (runs from before it was logged) tokens / tokens_per_s."""
    if record.get("step_time_s") is not None:
        return float(record["step_time_s"])
    return tokens_per_step / float(record["tokens_per_s"])
