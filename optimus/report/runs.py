"""Reading run directories (config.yaml, run_info.json, metrics.jsonl) for the scaling report."""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import yaml

from optimus.config import ConfigError
from optimus.cpu_runtime import parse_cpu_list


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
        return int(self.info["layout"].get("pp") or 1)

    @property
    def tp(self) -> int:
        return int(self.info["layout"].get("tp") or 1)

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


# What a value the report computes with must be (bools, strings, nan and inf are none of them).
COUNT, POSITIVE, NON_NEGATIVE = (
    "a whole number, 1 or more",
    "a positive, finite number",
    "0 or a positive, finite number",
)
# What the report reads from each file, and what each value must be; a run directory that lacks a required one
# is named with the key. Optional keys may be absent or null: runs from before pipeline and tensor parallelism
# have no pp or tp (1), and a peak of 0 or null is unknown (no MFU).
INFO_NEEDS = {"layout.world": COUNT, "layout.ep": COUNT, "tokens_per_step": COUNT, "flops_per_token": POSITIVE}
INFO_OPTIONAL = {"layout.pp": COUNT, "layout.tp": COUNT, "device.peak_flops": NON_NEGATIVE}
CONFIG_NEEDS = {"train.global_batch": COUNT}


def is_a(value: object, kind: str) -> bool:
    """Whether a value read from JSON or YAML is `kind` (COUNT, POSITIVE or NON_NEGATIVE)."""
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        return False
    if kind == COUNT:
        return isinstance(value, int) and value >= 1
    return 0 < value < math.inf if kind == POSITIVE else 0 <= value < math.inf


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


def _lookup(data: dict, key: str) -> object:
    """The value at a dotted key, None where a part is missing or not a mapping."""
    node = data
    for part in key.split("."):
        node = node.get(part) if isinstance(node, dict) else None
    return node


def _require(data: dict, needs: dict[str, str], path: Path, optional: dict[str, str] | None = None) -> None:
    """Each key of `needs` (and each key of `optional` that is there) holds a value of its kind."""
    for key in needs:
        if _lookup(data, key) is None:
            raise ReportError(f"{path} has no number at {key}: pass run directories written by `optimus train`.")
    for key, kind in {**needs, **(optional or {})}.items():
        value = _lookup(data, key)
        if value is not None and not is_a(value, kind):
            raise ReportError(f"{path} has {key}={value!r}, which is not {kind}: repair it or rerun that run.")


def _check_info(info: dict, path: Path) -> None:
    """run_info.json's numbers, the layout they make up, and its per-rank records."""
    _require(info, INFO_NEEDS, path, INFO_OPTIONAL)
    if "device" in info and not isinstance(info["device"], dict):
        raise ReportError(f"{path} has device={info['device']!r}, which is not a mapping: repair it or rerun that run.")
    layout = info["layout"]
    world, pp, tp, ep = (layout.get(k) or 1 for k in ("world", "pp", "tp", "ep"))
    for names, ranks in (("pp x tp", pp * tp), ("pp x ep", pp * ep)):
        if world % ranks:
            raise ReportError(
                f"{path} has layout.world={world}, which {names} = {ranks} does not divide: repair it or rerun "
                "that run."
            )
    _check_per_rank(info.get("per_rank") or [], path)


def _check_per_rank(per_rank: object, path: Path) -> None:
    """Each rank's record that shared_cores reads (those with a host, cpus and threads)."""
    if not isinstance(per_rank, list):
        raise ReportError(f"{path} has per_rank={per_rank!r}, which is not a list: repair it or rerun that run.")
    for i, rank in enumerate(per_rank):
        if isinstance(rank, dict) and {"host", "cpus", "threads"} <= rank.keys() and not _is_cpu_share(rank):
            raise ReportError(
                f"{path} has per_rank[{i}]={rank!r}, which needs a host name, cpus as a cpulist like 0-3,8 and threads "
                "1 or more: repair it or rerun that run."
            )


def _is_cpu_share(rank: dict) -> bool:
    """A per-rank record as optimus.cpu_runtime.cpu_share writes it."""
    try:
        cores = parse_cpu_list(rank["cpus"]) if isinstance(rank["cpus"], str) else set()
    except ValueError:
        cores = set()
    return isinstance(rank["host"], str) and bool(cores) and is_a(rank["threads"], COUNT)


def _check_record(record: dict, path: Path, lineno: int) -> None:
    """The numbers the report computes with: the step, its time (or, before that was logged, tokens_per_s) and
    the timed phases."""
    time_key = "step_time_s" if record.get("step_time_s") is not None else "tokens_per_s"
    kinds = {"step": COUNT, time_key: POSITIVE}
    kinds |= {
        k: NON_NEGATIVE for k, v in record.items() if k.startswith("time_") and k.endswith("_s") and v is not None
    }
    for key, kind in kinds.items():
        if not is_a(record.get(key), kind):
            raise ReportError(
                f"{path} line {lineno} has {key}={record.get(key)!r}, which is not {kind}: remove or repair that "
                "line, or rerun the run."
            )


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
        _check_record(record, path, lineno)
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
    _check_info(info, path / "run_info.json")
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
