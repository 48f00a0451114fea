"""Which runs may be compared in one scaling report, and the one-sentence refusal when they may not.

Scaling efficiency only means something between runs of the same experiment: the
resolved configs must agree in everything but the parallel layout and the device
count. Weak scaling also lets the global batch grow with the devices (the batch per
device stays fixed); strong scaling keeps the global batch.
"""

from __future__ import annotations

from optimus.report.runs import ReportError, Run

ALWAYS_IGNORED = ("run.", "logging.", "checkpoint.", "profile.")
ALLOWED = {
    "weak": ("parallel.", "machine.ranks_per_node", "train.global_batch"),
    "strong": ("parallel.",),
}
INFO_KEYS = ("device.type", "device.name", "kernels")  # resolved at run time, so compared from run_info.json


def flatten(tree: dict, prefix: str = "") -> dict[str, object]:
    """{"a": {"b": 1}} -> {"a.b": 1}."""
    out = {}
    for key, value in tree.items():
        name = f"{prefix}{key}"
        if isinstance(value, dict):
            out.update(flatten(value, name + "."))
        else:
            out[name] = value
    return out


def _matches(key: str, prefixes: tuple[str, ...]) -> bool:
    return any(key == p or (p.endswith(".") and key.startswith(p)) for p in prefixes)


def first_difference(a: dict, b: dict, allowed: tuple[str, ...]) -> tuple[str, object, object] | None:
    """The first key (sorted) whose values differ and that is neither ignored nor allowed to differ."""
    fa, fb = flatten(a), flatten(b)
    for key in sorted(fa.keys() | fb.keys()):
        if _matches(key, ALWAYS_IGNORED + allowed):
            continue
        if fa.get(key, "<missing>") != fb.get(key, "<missing>"):
            return key, fa.get(key, "<missing>"), fb.get(key, "<missing>")
    return None


def infer_mode(runs: list[Run]) -> str:
    """strong when every run has the same global batch, else weak."""
    return "strong" if len({r.global_batch for r in runs}) == 1 else "weak"


def check_comparable(runs: list[Run], mode: str) -> None:
    """Raise ReportError with one sentence naming the first difference that `mode` does not allow."""
    if mode not in ALLOWED:
        raise ReportError(f"--mode {mode} is not supported: choose weak or strong.")
    base = runs[0]
    allowed = ALLOWED[mode]
    for other in runs[1:]:
        diff = first_difference(base.config, other.config, allowed)
        if diff is None:
            info_a, info_b = flatten(base.info), flatten(other.info)
            diff = next(
                ((f"run_info {k}", info_a.get(k), info_b.get(k)) for k in INFO_KEYS if info_a.get(k) != info_b.get(k)),
                None,
            )
        if diff is not None:
            key, va, vb = diff
            free = " / ".join(p + "*" if p.endswith(".") else p for p in allowed)
            raise ReportError(
                f"{base.path} and {other.path} differ in {key} ({va!r} vs {vb!r}), but {mode} scaling compares "
                f"only runs that differ in {free} and device count: rerun one of them with the other's setting."
            )
        if mode == "weak" and base.global_batch * other.world != other.global_batch * base.world:
            raise ReportError(
                f"{base.path} and {other.path} have different batches per device "
                f"({base.global_batch}/{base.world} vs {other.global_batch}/{other.world} sequences): weak "
                "scaling keeps train.global_batch / devices fixed, so scale train.global_batch with the device count."
            )
