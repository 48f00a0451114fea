"""The recipe tree and composing a config from it: `load_config(overrides)` is what `optimus train` runs.

Recipes ship inside the wheel (as optimus/recipes/, beside this module) or sit at the repository
root in an editable install. Composition errors from Hydra become one-sentence ConfigErrors.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

from optimus.config import ConfigError, OptimusConfig


def recipes_dir() -> Path:
    """Recipes ship inside the wheel (optimus/recipes) or sit at the repository root (editable install)."""
    packaged = Path(__file__).parent / "recipes"
    return packaged if packaged.is_dir() else Path(__file__).resolve().parent.parent / "recipes"


def recipe_groups() -> dict[str, list[str]]:
    root = recipes_dir()
    return {
        group.name: sorted(p.stem for p in group.glob("*.yaml"))
        for group in sorted(root.iterdir())
        if group.is_dir() and any(group.glob("*.yaml"))
    }


def _explain_compose_error(err: Exception) -> str:
    """Turn Hydra's multi-line errors into one sentence that says what to change."""
    text = str(err)
    for group, names in recipe_groups().items():
        missing = f"Could not find '{group}/"
        if missing in text:  # Hydra names the recipe it looked for: the last of several overrides of the group
            bad = text.split(missing, 1)[1].split("'", 1)[0]
            return f"Unknown {group} recipe {bad!r}: choose one of {', '.join(names)}."
    if text.startswith("Could not override '"):
        key = text.split("'")[1]
        return f"Unknown config key {key!r}: check the spelling against `optimus train --help` and ARCHITECTURE.md."
    if text.startswith("Error merging override "):
        override = text.removeprefix("Error merging override ").strip()
        cause = str(err.__cause__).strip().splitlines()[0] if err.__cause__ else "wrong type"
        return f"Bad value in {override} ({cause}): give a value of the key's type."
    first_line = text.strip().splitlines()[0] if text.strip() else type(err).__name__
    return f"Invalid override ({first_line}): fix it or see `optimus train --help`."


def unknown_keys(node: dict, schema: type, prefix: str = "") -> list[str]:
    """Dotted keys of `node` that the dataclass `schema` does not define (free-form fields are not searched)."""
    fields = {f.name: f for f in dataclasses.fields(schema)}
    out = []
    for key, value in node.items():
        field = fields.get(key)
        if field is None:
            out.append(prefix + str(key))
        elif dataclasses.is_dataclass(field.default_factory) and isinstance(value, dict):
            out += unknown_keys(value, field.default_factory, f"{prefix}{key}.")
    return out


def _apply_calibration(composed, overrides: list[str]) -> None:
    """machine.calibration: the keys of that machine.yaml (`optimus plan --calibrate`'s) over the recipe's machine,
    then the command line's machine.* overrides again, which come last as everywhere else."""
    from omegaconf import OmegaConf, open_dict

    path = composed.machine.get("calibration")
    if not path:
        return
    file = Path(path).expanduser()
    if not file.is_file():
        raise ConfigError(
            f"machine.calibration={path} is not a file: run `optimus plan --calibrate --out DIR` on a node of the "
            "machine and pass DIR/machine.yaml."
        )
    explicit = [o.lstrip("+") for o in overrides if o.lstrip("+").startswith("machine.")]
    with open_dict(composed):  # machine.perf.ranges is free-form: the file's ranges are new keys there
        composed.machine = OmegaConf.merge(composed.machine, OmegaConf.load(file))
        operators = composed.machine.perf.get("operator_times")
        if operators and not Path(operators).expanduser().is_absolute():  # written beside the file
            composed.machine.perf.operator_times = str((file.parent / operators).resolve())
        composed.machine = OmegaConf.merge(composed.machine, OmegaConf.from_dotlist(explicit).get("machine", {}))
    composed.machine.calibration = str(file)


def load_config(overrides: list[str]) -> OptimusConfig:
    """Compose recipes + overrides into a typed, validated-for-types OptimusConfig."""
    from hydra import compose, initialize_config_dir
    from hydra.core.config_store import ConfigStore
    from hydra.core.global_hydra import GlobalHydra
    from omegaconf import OmegaConf

    ConfigStore.instance().store(name="optimus_schema", node=OptimusConfig)
    GlobalHydra.instance().clear()
    try:
        with initialize_config_dir(config_dir=str(recipes_dir()), version_base=None):
            composed = compose(config_name="config", overrides=list(overrides))
        _apply_calibration(composed, overrides)
        unknown = unknown_keys(OmegaConf.to_container(composed), OptimusConfig)
        if unknown:  # `+key=value` adds keys that Hydra's struct mode lets through
            raise ConfigError(
                f"Unknown config key {unknown[0]!r}: check the spelling against `optimus train --help` and "
                "ARCHITECTURE.md."
            )
        cfg = OmegaConf.to_object(composed)
    except ConfigError:
        raise
    except Exception as err:  # Hydra and OmegaConf raise many types; all mean "bad override"
        raise ConfigError(_explain_compose_error(err)) from None
    return cfg
