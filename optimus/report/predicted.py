"""`optimus report --predict`: the performance model's step time for each run, beside the measured one.

Each run's own config.yaml (its layout, batch, model and machine recipe) goes through `optimus plan
--predict`'s model (optimus.perf.predict) at the run's world size: a `local` run is predicted from this
machine's measured model (so report on the machine the runs ran on), a cluster run from its machine recipe.
A run the model cannot predict (a capacity factor, ...) is reported without one,
with a line saying why.
"""

from __future__ import annotations

from omegaconf import OmegaConf
from omegaconf.errors import OmegaConfBaseException

from optimus.config import ConfigError, OptimusConfig
from optimus.efficiency import strong_efficiency, weak_efficiency
from optimus.report.runs import Run


def run_config(run: Run) -> OptimusConfig:
    """The run's resolved config.yaml as the typed config; ConfigError when it does not read as one."""
    try:
        return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OptimusConfig), run.config))
    except OmegaConfBaseException as err:  # a key this version lacks, or a value of the wrong type
        first = str(err).strip().splitlines()[0] if str(err).strip() else type(err).__name__
        raise ConfigError(f"{run.path / 'config.yaml'} is not a config of this version of Optimus ({first}).") from None


def add_predictions(rows: list[dict], runs: dict[str, Run], mode: str, log=print) -> None:
    """Add `predicted_step_s`, `predicted_step_s_range` (the interval of a machine whose numbers have ranges, else
    None), `predicted_error` (measured / predicted - 1 of the mean step time) and `predicted_efficiency` (the
    predictions' own scaling efficiency, as the report computes the measured one) to each row. A run the model
    cannot predict gets None in each, and `predicted_refused` says why: the
    other runs' predictions stand (the efficiencies need the base run's)."""
    from optimus.perf.predict import predict

    for row in rows:
        run = runs[row["path"]]
        log(f"predicting {run.name} ({run.world} ranks) ...")
        try:
            prediction = predict(run_config(run), run.world, progress="none")
        except ConfigError as refused:  # e.g. a capacity factor, which the model cannot trace
            log(f"no prediction for {run.name}: {refused}")
            row.update(predicted_step_s=None, predicted_step_s_range=None, predicted_error=None,
                       predicted_refused=str(refused))  # fmt: skip
            continue
        row["predicted_step_s"] = prediction.step_time_s
        row["predicted_step_s_range"] = prediction.step_time_s_range
        row["predicted_error"] = row["step_time_mean_s"] / prediction.step_time_s - 1
    for row in rows:
        row["predicted_efficiency"] = predicted_efficiency(rows[0], row, mode)


def predicted_efficiency(base: dict, row: dict, mode: str) -> float | None:
    """`row`'s efficiency against `base` from their predicted step times; None where either has none."""
    if base["predicted_step_s"] is None or row["predicted_step_s"] is None:
        return None
    if mode == "weak":
        per_device = [r["tokens_per_step"] / r["predicted_step_s"] / r["devices"] for r in (base, row)]
        return weak_efficiency(*per_device)
    return strong_efficiency(base["predicted_step_s"], base["devices"], row["predicted_step_s"], row["devices"])
