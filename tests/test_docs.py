"""The README and docs/ point only at things that exist in the repository."""

from __future__ import annotations

import importlib
import re
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]

# [text](target) outside code; images too. Targets with a scheme (https:, mailto:) are not checked.
LINK = re.compile(r"!?\[[^\]]*\]\(([^)\s]+)\)")
FENCE = re.compile(r"^(```|~~~).*?^\1", re.S | re.M)
INLINE_CODE = re.compile(r"`[^`\n]*`")


def links_in(text: str) -> list[str]:
    """Link targets of markdown `text`, without those inside code or with a scheme."""
    text = INLINE_CODE.sub("", FENCE.sub("", text))
    return [t for t in LINK.findall(text) if not re.match(r"[a-z][a-z0-9+.-]*:", t)]


def anchor(heading: str) -> str:
    """GitHub's anchor of a heading: lowercased, punctuation dropped, spaces turned into hyphens."""
    return re.sub(r"[^\w\- ]", "", heading.strip().lower()).replace(" ", "-")


def heading_anchors(page: Path) -> set[str]:
    return {anchor(h) for h in re.findall(r"^#+\s+(.*)$", FENCE.sub("", page.read_text()), re.M)}


def test_link_parser():
    text = "see [a](docs/A.md), ![b](img.png), [c](https://x.org), `[d](no.md)`\n```\n[e](f.md)\n```\n"
    assert links_in(text) == ["docs/A.md", "img.png"]
    assert anchor("The run directory") == "the-run-directory"
    assert anchor("Configuration: `optimus.config`") == "configuration-optimusconfig"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_relative_links_resolve_inside_the_repository(page):
    assert page.exists()
    broken = []
    for target in links_in(page.read_text()):
        path_part, _, anchor = target.partition("#")
        resolved = (page.parent / path_part).resolve() if path_part else page
        if not resolved.is_relative_to(ROOT) or not resolved.exists():
            broken.append(f"{target} (no such file in the repository)")
        elif anchor and resolved.suffix == ".md" and anchor not in heading_anchors(resolved):
            broken.append(f"{target} (no heading with that anchor)")
    assert not broken, f"{page.name}: broken links: {broken}"


def test_readme_links_the_architecture_page():
    assert "(docs/ARCHITECTURE.md)" in (ROOT / "README.md").read_text()


def test_names_in_api_md_exist():
    # Every `optimus.a.b.Name` written in API.md imports (a module) or is an attribute of one.
    names = set(re.findall(r"`(optimus(?:\.\w+)+)", (ROOT / "docs" / "API.md").read_text()))
    assert len(names) > 10
    missing = []
    for name in sorted(names):
        module_name, attrs = name, []
        while True:
            try:
                obj = importlib.import_module(module_name)
                break
            except ModuleNotFoundError:
                module_name, _, attr = module_name.rpartition(".")
                attrs.insert(0, attr)
        for attr in attrs:
            obj = getattr(obj, attr, None)
        if obj is None:
            missing.append(name)
    assert not missing, f"API.md names what does not exist: {missing}"


def readme_train_commands() -> list[list[str]]:
    """The arguments of every `optimus train` command in the README's code blocks, in order (continuation lines
    joined, comments dropped)."""
    import shlex

    commands = []
    for block in FENCE.finditer((ROOT / "README.md").read_text()):
        for line in block.group(0).replace("\\\n", " ").splitlines():
            if line.startswith("optimus train "):
                commands.append(shlex.split(line, comments=True)[2:])
    return commands


def test_readme_reuses_a_run_dir_only_to_resume_it():
    """A README command that names the run.dir of an earlier one must be that command again (the resume): any
    other would be refused, the directory holding another run."""
    first_use: dict[str, list[str]] = {}
    for args in readme_train_commands():
        for run_dir in [a.split("=", 1)[1] for a in args if a.startswith("run.dir=")]:
            earlier = first_use.setdefault(run_dir, args)
            assert earlier == args, f"README: `optimus train {' '.join(args)}` reuses run.dir={run_dir} of another run"


def test_api_md_gives_build_parallel_state_its_real_parameters():
    """API.md's signature names every parameter, in order (it once stopped at timeout_s: no pp, no tp)."""
    import inspect

    from optimus.parallel import build_parallel_state

    documented = re.search(r"`build_parallel_state\(([^)]*)\)", (ROOT / "docs" / "API.md").read_text()).group(1)
    assert [p.split("=")[0].strip() for p in documented.split(",")] == list(
        inspect.signature(build_parallel_state).parameters
    )
