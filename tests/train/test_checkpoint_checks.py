"""The settings a resume is held to (optimus.train.checkpoint_checks.changed_setting), on records alone."""

from optimus.recipes import load_config
from optimus.train.checkpoint_checks import changed_setting, run_identity


def test_a_record_from_before_optim_update_is_held_to_adamw():
    adamw, muon = load_config(["optim.update=adamw"]), load_config([])
    record = run_identity(adamw, {})
    del record["optim.update"]  # what checkpoints saved before the setting existed hold
    meta = {"run": record}
    assert changed_setting(meta, adamw, {}, weights_only=False) is None
    assert changed_setting(meta, muon, {}, weights_only=False) == ("optim.update", "adamw", "muon")
    assert changed_setting({"run": run_identity(muon, {})}, muon, {}, weights_only=False) is None
    assert changed_setting(meta, muon, {}, weights_only=True) is None  # a new run from the weights alone
