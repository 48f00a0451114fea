"""`optimus report --predict`: the performance model's step time for each run, beside the measured one.

Each run's own config.yaml (its layout, batch, model and machine recipe) goes through `optimus plan
--predict`'s model (optimus.perf.predict) at the run's world size: a `local` run is predicted from this
machine's measured model (so report on the machine the runs ran on), a cluster run from its machine recipe.
"""

from __future__ import annotations

from omegaconf import OmegaConf

from optimus.config import OptimusConfig
from optimus.efficiency import strong_efficiency, weak_efficiency
from optimus.report.runs import Run


def run_config(run: Run) -> OptimusConfig:
    """The run's resolved config.yaml as the typed config."""
    return OmegaConf.to_object(OmegaConf.merge(OmegaConf.structured(OptimusConfig), run.config))


def add_predictions(rows: list[dict], runs: dict[str, Run], mode: str, log=print) -> None:
    """Add `predicted_step_s`, `predicted_error` (measured / predicted - 1 of the mean step time) and
    `predicted_efficiency` (the predictions' own scaling efficiency, as the report computes the measured one)
    to each row."""
    from optimus.perf.predict import predict

    for row in rows:
        run = runs[row["path"]]
        log(f"predicting {run.name} ({run.world} ranks) ...")
        row["predicted_step_s"] = predict(run_config(run), run.world, progress="none").step_time_s
        row["predicted_error"] = row["step_time_mean_s"] / row["predicted_step_s"] - 1
    base = rows[0]
    for row in rows:
        if mode == "weak":
            per_device = [r["tokens_per_step"] / r["predicted_step_s"] / r["devices"] for r in (base, row)]
            row["predicted_efficiency"] = weak_efficiency(*per_device)
        else:
            row["predicted_efficiency"] = strong_efficiency(
                base["predicted_step_s"], base["devices"], row["predicted_step_s"], row["devices"]
            )
