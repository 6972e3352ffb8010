"""The shape of the code, checked statically: small files, no import cycles between
modules or between packages (lazy imports count), the library never imports the widgets,
no package reaches into another's private names, and no public class name is defined
twice. ARCHITECTURE.md says why."""

from __future__ import annotations

import ast
import itertools
import json
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
MAX_LINES = 400


def _modules() -> dict[str, Path]:
    """Dotted name -> file, for the library and its widgets."""
    found = {}
    for path in sorted((ROOT / "minipar").rglob("*.py")):
        parts = ["minipar", *path.relative_to(ROOT / "minipar").with_suffix("").parts]
        if parts[-1] == "__init__":
            parts.pop()
        found[".".join(parts)] = path
    return found


MODULES = _modules()


def _is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def _resolve(module: str, level: int, target: str | None) -> str:
    """The absolute name of `from <level dots><target>` written in `module`."""
    if level == 0:
        return target or ""
    base = module.split(".") if _is_package(module) else module.split(".")[:-1]
    base = base[:len(base) - (level - 1)]
    return ".".join(base + ([target] if target else []))


def _imports(module: str) -> list[tuple[str, list[str], int]]:
    """(imported module, names taken from it, line) for every import, lazy ones included."""
    tree = ast.parse(MODULES[module].read_text())
    found = []
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            found += [(alias.name, [], node.lineno) for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            source = _resolve(module, node.level, node.module)
            names = [alias.name for alias in node.names]
            found.append((source, names, node.lineno))
    return found


def _edges(module: str) -> set[str]:
    """Internal modules `module` imports: `from pkg import sub` counts as importing pkg.sub."""
    edges = set()
    for source, names, _ in _imports(module):
        for name in names or [None]:
            if name and f"{source}.{name}" in MODULES:
                edges.add(f"{source}.{name}")
            elif source in MODULES:
                edges.add(source)
    edges.discard(module)
    return edges


def _package(module: str) -> str:
    """minipar.<package> for modules inside a subpackage; the module itself otherwise."""
    parts = module.split(".")
    if len(parts) >= 2 and f"{parts[0]}.{parts[1]}" in MODULES \
            and _is_package(f"{parts[0]}.{parts[1]}"):
        return f"{parts[0]}.{parts[1]}"
    return module


def test_the_start_up_handler_is_the_packages_first_import_and_needs_nothing_slow():
    """What keeps the window before Ctrl-C's start-up handler a few milliseconds: it is the
    first thing minipar/__init__.py imports, and it imports only `_signal`, `os` and `sys`
    (test_cli checks that the interpreter has them loaded before any package runs)."""
    first = min(_imports("minipar"), key=lambda found: found[2])
    assert first[:2] == ("minipar", ["interrupt_at_start"]), first
    imported = {source for source, _, _ in _imports("minipar.interrupt_at_start")}
    assert imported == {"_signal", "os", "sys"}, imported


def test_every_file_is_small():
    long = {str(path.relative_to(ROOT)): n for path in MODULES.values()
            if (n := len(path.read_text().splitlines())) > MAX_LINES}
    assert not long, f"files over {MAX_LINES} lines (split them): {long}"


def _find_cycle(graph: dict[str, set[str]]) -> list[str] | None:
    """One cycle of `graph` (its nodes, the first repeated at the end), or None."""
    state: dict[str, int] = {}
    stack: list[str] = []

    def visit(m: str) -> list[str] | None:
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                return stack[stack.index(n):] + [n]
            if n not in state and (cycle := visit(n)):
                return cycle
        stack.pop()
        state[m] = 2
        return None

    for m in sorted(graph):
        if m not in state and (cycle := visit(m)):
            return cycle
    return None


def test_no_import_cycles():
    cycle = _find_cycle({m: _edges(m) for m in MODULES})
    assert cycle is None, "import cycle: " + " -> ".join(cycle)


def test_no_package_imports_a_package_that_imports_it():
    """Packages form layers: module-level rules can pass while two packages tangle (a.x
    imports b.y, b.z imports a.w). Each top-level module counts as a package of its own."""
    graph: dict[str, set[str]] = {_package(m): set() for m in MODULES}
    why: dict[tuple[str, str], str] = {}
    for m in MODULES:
        for n in _edges(m):
            a, b = _package(m), _package(n)
            if a != b:
                graph[a].add(b)
                why.setdefault((a, b), f"{m} imports {n}")
    cycle = _find_cycle(graph)
    assert cycle is None, "package cycle: " + " -> ".join(cycle) + " (" + "; ".join(
        why[(a, b)] for a, b in itertools.pairwise(cycle)) + ")"


def test_no_public_class_name_is_defined_twice():
    """One class per name across the library: `from minipar.x import Step` must never
    leave a reader wondering which Step."""
    where: dict[str, list[str]] = {}
    for m, path in MODULES.items():
        for node in ast.parse(path.read_text()).body:
            if isinstance(node, ast.ClassDef) and not node.name.startswith("_"):
                where.setdefault(node.name, []).append(m)
    twice = {name: modules for name, modules in where.items() if len(modules) > 1}
    assert not twice, f"public class names defined in more than one module: {twice}"


# a package's entry points and the per-technique convention files share names on purpose
SHARED_FILE_NAMES = {"__init__.py", "__main__.py", "bench.py", "demo.py", "exercises.py"}


def test_no_two_library_files_share_a_name():
    """A file's name says what it holds: `memory.py` twice leaves a reader (and a
    traceback) guessing which memory."""
    where: dict[str, list[str]] = {}
    for path in MODULES.values():
        if path.name not in SHARED_FILE_NAMES:
            where.setdefault(path.name, []).append(str(path.relative_to(ROOT)))
    twice = {name: paths for name, paths in where.items() if len(paths) > 1}
    assert not twice, f"library files sharing a name (rename one to say what it holds): {twice}"


def test_the_library_never_imports_the_widgets():
    bad = [(m, line) for m in MODULES if not m.startswith("minipar.widgets")
           for source, names, line in _imports(m)
           if source.startswith("minipar.widgets")
           or (source == "minipar" and "widgets" in names)]
    assert not bad, f"library modules importing minipar.widgets: {bad}"


def _private_uses(module: str, tree: ast.AST, here: str) -> list[str]:
    """`from X import _name` and `X._name` where X belongs to another package than `here`."""
    bad, bound = [], {}
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            source = _resolve(module, node.level, node.module) if module else node.module or ""
            for alias in node.names:
                full = f"{source}.{alias.name}"
                if full in MODULES:
                    bound[alias.asname or alias.name] = full
                elif alias.name.startswith("_") and not alias.name.startswith("__") \
                        and source.startswith("minipar") and _package(source) != here:
                    bad.append(f"line {node.lineno}: from {source} import {alias.name}")
        elif isinstance(node, ast.Import):
            for alias in node.names:
                if alias.name in MODULES:
                    bound[alias.asname or alias.name.split(".")[0]] = \
                        alias.name if alias.asname else alias.name.split(".")[0]
    for node in ast.walk(tree):
        if isinstance(node, ast.Attribute) and isinstance(node.value, ast.Name) \
                and node.value.id in bound and node.attr.startswith("_") \
                and not node.attr.startswith("__") \
                and _package(bound[node.value.id]) != here:
            bad.append(f"line {node.lineno}: {node.value.id}.{node.attr}")
    return bad


def test_no_package_uses_another_packages_private_names():
    bad = {}
    for m, path in MODULES.items():
        found = _private_uses(m, ast.parse(path.read_text()), _package(m))
        if found:
            bad[m] = found
    for notebook in sorted((ROOT / "lessons").glob("*.ipynb")):
        cells = json.loads(notebook.read_text())["cells"]
        source = "\n".join("".join(c["source"]) for c in cells if c["cell_type"] == "code")
        lines = [line for line in source.splitlines() if not line.lstrip().startswith(("%", "!"))]
        found = _private_uses("", ast.parse("\n".join(lines)), "lesson")
        if found:
            bad[notebook.name] = found
    assert not bad, f"private names used across packages: {bad}"


def test_every_package_is_installed():
    """A non-editable install ships only the packages pyproject.toml lists: each folder
    with an __init__.py must be there, or `pip install .` leaves it out."""
    import pytest

    tomllib = pytest.importorskip("tomllib")  # Python 3.11+
    listed = set(tomllib.loads((ROOT / "pyproject.toml").read_text())["tool"]["setuptools"]
                 ["packages"])
    folders = {"minipar." + p.parent.name for p in (ROOT / "minipar").glob("*/__init__.py")}
    assert folders | {"minipar", "minipar.widgets"} <= listed, sorted(folders - listed)


CROSS_CUTTING_TESTS = {"architecture", "demos", "docs", "entry_points", "exercises"}


def test_tests_mirror_the_packages():
    """tests/test_<package>[_<topic>].py: a test file is named for the package or
    top-level module it tests (or is one of the few that sweep across all of them), so a
    package's tests are found by its name."""
    owners = {m.split(".")[1] for m in MODULES if m.count(".") >= 1}
    bad = []
    for path in sorted((ROOT / "tests").glob("test_*.py")):
        name = path.stem[len("test_"):]
        if not any(name == o or name.startswith(o + "_") for o in owners | CROSS_CUTTING_TESTS):
            bad.append(path.name)
    assert not bad, f"name these after the package or module they test: {bad}"
