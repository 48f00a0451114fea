"""What a checkpoint holds, as flat keys that do not depend on the parallel layout.

    model/<name>                     dense parameter or buffer (router biases included), the same on every rank
    model/<name>/expert_<g>          routed expert g's slice of an expert tensor; g is the GLOBAL expert index
    optim/<name>[<lo>:<hi>]/<kind>   optimizer state of elements [lo, hi) of the full flattened parameter
                                     (expert tensors: all E experts); kind = exp_avg | exp_avg_sq | master
                                     (Muon's momentum in exp_avg, its exp_avg_sq zero: optimus.optim.muon)
    optim/<name>[<lo>:<hi>]@cols[<a>:<b>]/<kind>
                                     the same for elements [lo, hi) of the block of columns [a, b) of a
                                     matrix that tensor parallelism split along its columns
                                     (optimus.optim.state_ranges)
    optim/step                       updates applied so far (AdamW's bias correction)

Every rank writes the keys of what it holds; replicas (dense weights, the experts of
an expert-data-parallel group, the standard scheme's dense optimizer shards) write
identical keys and DCP keeps one copy. On load every rank asks for exactly the keys
it needs: its own experts, and the saved optimizer ranges that overlap the ranges
it owns in the new layout, which is what makes a checkpoint load under any layout.
Under tensor parallelism the split parameters are DTensors, which DCP saves as the
slices each rank holds and reads back into whatever slices the new layout gives
(tp = 1 included).
Every `optim.sharding` scheme (none, standard, ep_aware) writes the same keys, so a
checkpoint also moves between schemes. Pipeline stages need nothing of their own: a
stage's layers keep their global index in their names (`layers.5...`), so each stage
writes the keys of its layers and a rank of another stage split asks for those of its own.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

import torch

from optimus.model.moe.experts import expert_offsets
from optimus.optim import Optimizer
from optimus.optim.state_ranges import StateRange, covered, range_key

OPTIM_KINDS = ("exp_avg", "exp_avg_sq", "master")
OPTIM_KEY = re.compile(
    r"^optim/(?P<name>[^\[]+)\[(?P<lo>\d+):(?P<hi>\d+)\](?:@cols\[(?P<c0>\d+):(?P<c1>\d+)\])?"
    r"/(?P<kind>exp_avg|exp_avg_sq|master)$"
)


@dataclass(frozen=True)
class SavedRange:
    """One optimizer shard in a checkpoint: elements [lo, hi) of parameter `name` (of its block of columns
    `cols`, when tensor parallelism split it along them)."""

    name: str
    lo: int
    hi: int
    cols: tuple[int, int] | None = None

    @property
    def key(self) -> str:
        return "optim/" + range_key(self.name, self.lo, self.hi, self.cols)


# ---- model --------------------------------------------------------------------------------


def _model_items(model: torch.nn.Module):
    """(checkpoint key, tensor in the model) for every entry of the model's state."""
    offsets = expert_offsets(model)
    for name, tensor in model.state_dict().items():
        if name in offsets:
            for i in range(tensor.shape[0]):
                yield f"model/{name}/expert_{offsets[name] + i}", tensor[i]
        else:
            yield f"model/{name}", tensor


def model_state(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The model's checkpoint entries (views into the live tensors: the caller saves or stages them)."""
    return dict(_model_items(model))


def model_targets(model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """Fresh tensors to load this rank's model entries into (the model is only touched once a load succeeded)."""
    return {key: torch.empty_like(t) for key, t in _model_items(model)}


@torch.no_grad()
def apply_model_state(model: torch.nn.Module, loaded: dict[str, torch.Tensor]) -> None:
    for key, tensor in _model_items(model):
        tensor.copy_(loaded[key])


# ---- optimizer ----------------------------------------------------------------------------


def optimizer_state(optimizer: Optimizer, model: torch.nn.Module) -> dict[str, torch.Tensor]:
    """The optimizer's checkpoint entries: its owned ranges, keyed by full-parameter element range."""
    out: dict[str, torch.Tensor] = {}
    state = optimizer.state_dict()
    for e in state["shards"].values():
        key = SavedRange(e["name"], e["lo"], e["hi"], e["cols"]).key
        for kind in OPTIM_KINDS:
            if kind in e:
                out[f"{key}/{kind}"] = e[kind]
    out["optim/step"] = torch.tensor(int(state["step"]), dtype=torch.int64)
    return out


def needed_ranges(optimizer: Optimizer, model: torch.nn.Module) -> list[tuple[str, StateRange]]:
    """(name, where in the parameter) of every range whose state this rank keeps in the current layout."""
    shards = optimizer.state_dict()["shards"].values()
    return [(e["name"], StateRange(e["lo"], e["hi"], tuple(e["shape"]), e["cols"])) for e in shards]


def saved_ranges(keys) -> dict[str, list[tuple[SavedRange, set[str]]]]:
    """Optimizer shards listed in a checkpoint's keys: name -> [(range, kinds saved)]."""
    found: dict[SavedRange, set[str]] = {}
    for key in keys:
        m = OPTIM_KEY.match(key)
        if m:
            cols = (int(m["c0"]), int(m["c1"])) if m["c0"] is not None else None
            found.setdefault(SavedRange(m["name"], int(m["lo"]), int(m["hi"]), cols), set()).add(m["kind"])
    by_name: dict[str, list[tuple[SavedRange, set[str]]]] = {}
    for r, kinds in sorted(found.items(), key=lambda item: (item[0].name, item[0].lo)):
        by_name.setdefault(r.name, []).append((r, kinds))
    return by_name


def optimizer_requests(
    needed: list[tuple[str, StateRange]], saved: dict[str, list[tuple[SavedRange, set[str]]]]
) -> tuple[list[SavedRange], str | None]:
    """Saved shards overlapping this rank's ranges, or a sentence naming the first range nothing covers."""
    wanted: dict[SavedRange, None] = {}
    for name, mine in needed:
        total = 0
        for r, kinds in saved.get(name, []):
            n = covered(mine, StateRange(r.lo, r.hi, mine.shape, r.cols))
            if n:
                if not {"exp_avg", "exp_avg_sq"} <= kinds:
                    return [], f"the optimizer shard {r.key} lacks its moments"
                wanted[r] = None
                total += n
        if total != mine.hi - mine.lo:
            return [], f"no saved optimizer state covers {range_key(name, mine.lo, mine.hi, mine.cols)}"
    return list(wanted), None


def load_optimizer_state(
    optimizer, model: torch.nn.Module, step: int, shards: dict[SavedRange, dict[str, torch.Tensor]]
) -> None:
    """Fill this rank's optimizer state from the loaded shards (each {kind: flat tensor of r.hi - r.lo})."""
    entries = {
        r.key: {"name": r.name, "lo": r.lo, "hi": r.hi, "cols": r.cols, **tensors} for r, tensors in shards.items()
    }
    # The update rule was checked against the checkpoint's run record (optim.update in checkpoint_checks.RUN_KEYS).
    state = {"step": step, "scheme": optimizer.scheme, "update": optimizer.update_rule, "shards": entries}
    optimizer.load_state_dict(state)
