"""Dependencies point one way: no import cycle between optimus subpackages, and the layering rules hold.

The graph is read from the source (the AST of every module, imports inside functions included), so an
import hidden in a function body to dodge a cycle at import time still counts as an edge.
"""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

import optimus

PACKAGE_DIR = Path(optimus.__file__).parent


def module_name(path: Path) -> str:
    """`optimus/model/moe/layer.py` -> `optimus.model.moe.layer`; a package's __init__ is the package."""
    parts = list(path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def imported_modules(source: str, package: str) -> set[str]:
    """Absolute names of everything `source` (a module of `package`) imports, at any depth, relative ones resolved."""
    found = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom):
            base = package.split(".")[: len(package.split(".")) - node.level + 1] if node.level else []
            target = ".".join(base + ([node.module] if node.module else []))
            found.add(target)
            # `from optimus import parallel` imports the subpackage itself.
            found.update(f"{target}.{alias.name}" for alias in node.names)
    return found


def imports_of(path: Path) -> set[str]:
    name = module_name(path)
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    return imported_modules(path.read_text(), package)


def unit(module: str) -> str | None:
    """The subpackage (or top-level module) of optimus that `module` belongs to; None outside optimus."""
    parts = module.split(".")
    if parts[0] != "optimus" or len(parts) < 2:
        return None
    return parts[1]


def existing_units() -> set[str]:
    """Top-level modules and subpackages of optimus (a folder of modules counts even without an __init__.py)."""
    modules = {p.stem for p in PACKAGE_DIR.glob("*.py") if p.stem != "__init__"}
    return modules | {p.name for p in PACKAGE_DIR.iterdir() if p.is_dir() and any(p.glob("*.py"))}


def unit_graph() -> dict[str, set[str]]:
    """unit -> the other units it imports."""
    units = existing_units()
    graph: dict[str, set[str]] = {}
    for path in sorted(PACKAGE_DIR.rglob("*.py")):
        source = unit(module_name(path))
        if source is None:
            continue
        edges = graph.setdefault(source, set())  # every unit is a node, even one that imports nothing
        for target in map(unit, imports_of(path)):
            if target in units and target != source:
                edges.add(target)
    return graph


def find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` as a list of nodes (first == last), or None when it is acyclic."""
    state: dict[str, str] = {}  # "open" while on the DFS stack, "done" after
    stack: list[str] = []

    def visit(node: str) -> list[str] | None:
        state[node] = "open"
        stack.append(node)
        for nxt in sorted(graph.get(node, ())):
            if state.get(nxt) == "open":
                return stack[stack.index(nxt) :] + [nxt]
            if nxt not in state and (cycle := visit(nxt)):
                return cycle
        stack.pop()
        state[node] = "done"
        return None

    for node in sorted(graph):
        if node not in state and (cycle := visit(node)):
            return cycle
    return None


def test_find_cycle_finds_cycles():
    # The checker itself, on graphs whose answer is known.
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": set()}) is None
    assert find_cycle({"a": {"b"}, "b": {"c"}, "c": {"a"}}) == ["a", "b", "c", "a"]
    assert find_cycle({"a": {"b"}, "b": {"a"}, "c": {"a"}}) == ["a", "b", "a"]


def test_imports_inside_functions_and_relative_imports_count():
    # In package optimus.model.moe, `from ..parallel` names optimus.model.parallel and `from .` the package itself.
    source = "import torch\n\ndef f():\n    from ..parallel import state\n    from . import router\n"
    assert imported_modules(source, "optimus.model.moe") == {
        "torch", "optimus.model.parallel", "optimus.model.parallel.state", "optimus.model.moe",
        "optimus.model.moe.router",
    }  # fmt: skip
    assert unit("optimus.model.parallel.state") == "model"
    assert unit("torch.nn") is None


def test_no_import_cycle_between_subpackages():
    graph = unit_graph()
    assert {"model", "parallel", "kernels", "train", "optim", "cli"} <= set(graph)
    cycle = find_cycle(graph)
    assert cycle is None, "import cycle between optimus subpackages: " + " -> ".join(cycle)


@pytest.mark.parametrize(
    "unit_name, forbidden",
    [
        ("model", {"parallel", "train", "optim", "cli"}),
        ("kernels", existing_units() - {"kernels"}),
        # The bottom of the graph: the rank layout and the user's error, which every layer reads.
        ("layout", existing_units() - {"layout", "errors"}),
        ("errors", existing_units() - {"errors"}),
    ],
)
def test_layering(unit_name, forbidden):
    imported = unit_graph()[unit_name]
    assert not imported & forbidden, f"optimus.{unit_name} imports {sorted(imported & forbidden)}"


def test_the_library_imports_no_command_and_holds_no_main():
    graph = unit_graph()
    commands = {"cli", "commands", "__main__"}  # `python -m optimus` is the command too
    for name, imported in graph.items():
        if name not in commands:
            assert not imported & commands, f"optimus.{name} imports the command modules {sorted(imported & commands)}"
    for path in PACKAGE_DIR.rglob("*.py"):
        if unit(module_name(path)) not in commands:
            assert "\ndef main(" not in path.read_text(), f"{path.relative_to(PACKAGE_DIR)} holds a main()"


def test_kernels_import_only_torch_and_triton():
    allowed_roots = {"torch", "triton", "optimus"} | set(sys.stdlib_module_names)
    for path in (PACKAGE_DIR / "kernels").rglob("*.py"):
        imported = imports_of(path)
        roots = {m.split(".")[0] for m in imported}
        assert roots <= allowed_roots, f"{path.name} imports {sorted(roots - allowed_roots)}"
        # Of optimus, only its own modules: not even optimus.config (its errors are translated by the model).
        outside = {m for m in imported if m.split(".")[0] == "optimus" and not m.startswith("optimus.kernels")}
        assert not outside, f"{path.name} imports {sorted(outside)}"


def test_import_of_kernels_loads_nothing_else_of_optimus(tmp_path):
    # A fresh interpreter: what `import optimus.kernels` itself loads, imports at run time included.
    code = (
        "import sys\n"
        "import optimus.kernels\n"
        "loaded = sorted(m for m in sys.modules if m.startswith('optimus.') and not m.startswith('optimus.kernels'))\n"
        "assert not loaded, f'loaded {loaded}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]


LIGHT_COMMANDS = {
    "plan": ["plan"],
    "launch": ["launch", "--nodes", "1", "machine=frontier", "parallel.ep=8", "train.micro_batch=1"],
}


@pytest.mark.parametrize("command", sorted(LIGHT_COMMANDS))
def test_plan_and_launch_do_not_load_the_data_stack(command, tmp_path):
    # A fresh interpreter, so that modules other tests imported do not count.
    code = (
        "import sys\n"
        "from optimus.cli import main\n"
        f"assert main({LIGHT_COMMANDS[command]!r}) == 0\n"
        "loaded = [m for m in ('tokenizers', 'datasets') if m in sys.modules]\n"
        "assert not loaded, f'loaded {loaded}'\n"
    )
    result = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stderr[-2000:]
