"""Experiment recipes compose to the published layouts: those `optimus plan --search` chose for the MoE models."""

import json
import re
from pathlib import Path

import pytest

from optimus.cli import load_config
from optimus.config_checks import validate
from optimus.recipes import recipe_groups, recipes_dir

AURORA_TILES = 256 * 12


@pytest.mark.parametrize(
    "experiment, model, ep",
    [("aurora-mula-7b-a1b", "mula-7b-a1b", 4), ("aurora-mula-20b-a2b", "mula-20b-a2b", 12)],
)
def test_runnable_experiments_validate_at_3072_tiles(experiment, model, ep):
    cfg = load_config([f"experiment={experiment}"])
    validate(cfg, AURORA_TILES)
    assert (cfg.model.name, cfg.machine.name, cfg.parallel.ep) == (model, "aurora", ep)
    assert (cfg.train.seq_len, cfg.train.global_batch) == (2048, 3072)
    o = cfg.optim
    assert (o.lr, o.lr * o.min_lr_ratio, o.warmup_steps, o.weight_decay, o.beta1, o.beta2) == pytest.approx(
        (4e-4, 4e-5, 2500, 0.1, 0.9, 0.95)
    )


@pytest.mark.parametrize("experiment, pp", [("aurora-mula-100b-a7b", 8), ("aurora-mula-220b-a10b", 8)])
def test_pipeline_experiments_validate_at_3072_tiles(experiment, pp):
    cfg = load_config([f"experiment={experiment}"])
    assert cfg.parallel.pp == pp and cfg.parallel.ep == 12
    validate(cfg, AURORA_TILES)


def test_overrides_apply_on_top_of_an_experiment():
    cfg = load_config(["experiment=aurora-mula-20b-a2b", "parallel.ep=6", "train.steps=10"])
    assert cfg.parallel.ep == 6 and cfg.train.steps == 10 and cfg.model.name == "mula-20b-a2b"


def test_the_default_run_uses_muon_and_every_experiment_adamw():
    """The default run's rule is Muon at 6e-3 (docs/ARCHITECTURE.md, "The default run"); the experiments train
    as the models they mirror were trained, with AdamW, whatever the schema's default."""
    default = load_config([]).optim
    assert (default.update, default.lr) == ("muon", 6e-3)
    experiments = sorted(p.stem for p in (recipes_dir() / "experiment").glob("*.yaml"))
    assert len(experiments) >= 11
    for name in experiments:
        assert load_config([f"experiment={name}"]).optim.update == "adamw", name


def test_the_readme_table_names_every_recipe_and_each_experiments_layout():
    """The README's recipe table lists each group's recipes, and beside each experiment the TP, PP and EP its
    recipe sets (it once said TP 2 of two recipes with tp = 1, and left a recipe out)."""
    readme = (Path(__file__).resolve().parents[1] / "README.md").read_text()
    rows = dict(re.findall(r"^\| `(\w+)=` \| (.*) \|$", readme, re.MULTILINE))
    for group, names in recipe_groups().items():
        assert sorted(set(re.findall(r"`([\w.-]+)`", rows[group]))) == names, group
    layouts = dict(re.findall(r"`([\w.-]+)` \(([^)]*)\)", rows["experiment"]))
    assert sorted(layouts) == recipe_groups()["experiment"]
    for name, layout in layouts.items():
        parallel = load_config([f"experiment={name}"]).parallel
        named = {dim.lower(): int(size) for dim, size in re.findall(r"\b(TP|PP|EP) (\d+)", layout)}
        assert named and all(getattr(parallel, dim) == size for dim, size in named.items()), (name, layout)


def test_the_moe_recipes_hold_the_layout_their_search_chose():
    """Each MoE experiment recipe searched in benchmarks/results/search_results.json sets every key of the
    search's winner to the winner's value (the recipes' comments say so; a later hand edit must change both)."""
    results = Path(__file__).resolve().parents[1] / "benchmarks" / "results" / "search_results.json"
    searched = json.loads(results.read_text())
    assert len(searched) >= 6
    for name, row in searched.items():
        cfg = load_config([f"experiment={name}"])
        for key, value in row["result"]["winner"]["values"].items():
            section, field = key.split(".")
            assert getattr(getattr(cfg, section), field) == value, (name, key)
