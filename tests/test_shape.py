"""The package's shape, read from its source with ``ast``: no import cycles, small modules, small folders.

An import inside a function counts like one at the top of the module (it still ties the two
modules together, only later); an import under ``if TYPE_CHECKING:`` does not (it never runs).
``importlib.import_module("a.b")`` is an import of ``a.b``; a module that calls it with a name
it computes (a registry such as ``{"memory": "robot_llm.llm.engine.memory:create"}``) is read as
importing every module its string constants name.
"""

from __future__ import annotations

import ast
from collections import Counter
from collections.abc import Iterator
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "robot_llm"
MAX_LINES = 500
MAX_MODULES_PER_FOLDER = 12


def _modules(package: Path) -> dict[str, Path]:
    """Dotted name -> file of every module under ``package`` (a package is its ``__init__.py``)."""
    out = {}
    for path in sorted(package.rglob("*.py")):
        parts = list(path.relative_to(package.parent).with_suffix("").parts)
        if parts[-1] == "__init__":
            parts.pop()
        out[".".join(parts)] = path
    return out


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


def _imported(module: str, is_package: bool, tree: ast.AST) -> Iterator[str]:
    """Every dotted name ``tree`` imports (relative imports resolved), ``TYPE_CHECKING`` blocks skipped."""
    stack = [tree]
    while stack:
        node = stack.pop()
        for child in ast.iter_child_nodes(node):
            if isinstance(child, ast.If) and _is_type_checking(child.test):
                stack.extend(child.orelse)
                continue
            if isinstance(child, ast.Import):
                yield from (alias.name for alias in child.names)
            elif isinstance(child, ast.ImportFrom):
                base = child.module or ""
                if child.level:
                    anchor = module if is_package else module.rpartition(".")[0]
                    for _ in range(child.level - 1):
                        anchor = anchor.rpartition(".")[0]
                    base = f"{anchor}.{base}" if base else anchor
                for alias in child.names:
                    yield f"{base}.{alias.name}"  # a submodule, or a name in module `base`
            elif _is_import_module(child):
                argument = child.args[0] if child.args else None
                if isinstance(argument, ast.Constant) and isinstance(argument.value, str):
                    yield argument.value
                else:  # a computed name: any module the file names in a string may be the one
                    yield from (
                        n.value.partition(":")[0]
                        for n in ast.walk(tree)
                        if isinstance(n, ast.Constant) and isinstance(n.value, str) and n.value.startswith(_ROOTS)
                    )
            stack.append(child)


_ROOTS = ("robot_llm.", "pkg.")  # the package under test, and the one the self-test builds


def _is_import_module(node: ast.AST) -> bool:
    return isinstance(node, ast.Call) and (
        (isinstance(node.func, ast.Attribute) and node.func.attr == "import_module")
        or (isinstance(node.func, ast.Name) and node.func.id == "import_module")
    )


def import_graph(package: Path) -> dict[str, set[str]]:
    """Module -> the package's modules it imports, anywhere in its body."""
    modules = _modules(package)
    graph: dict[str, set[str]] = {}
    for name, path in modules.items():
        targets = set()
        for dotted in _imported(name, path.name == "__init__.py", ast.parse(path.read_text(encoding="utf-8"))):
            while dotted and dotted not in modules:
                dotted = dotted.rpartition(".")[0]
            if dotted and dotted != name:
                targets.add(dotted)
        graph[name] = targets
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm, iterative)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    on_stack: set[str] = set()
    stack: list[str] = []
    found: list[list[str]] = []
    for root in graph:
        if root in index:
            continue
        work = [(root, iter(sorted(graph[root])))]
        index[root] = low[root] = len(index)
        stack.append(root)
        on_stack.add(root)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                if child not in index:
                    index[child] = low[child] = len(index)
                    stack.append(child)
                    on_stack.add(child)
                    work.append((child, iter(sorted(graph[child]))))
                elif child in on_stack:
                    low[node] = min(low[node], index[child])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = []
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.append(member)
                    if member == node:
                        break
                if len(component) > 1:
                    found.append(sorted(component))
    return found


def test_the_cycle_finder_finds_a_cycle_made_by_an_import_inside_a_function(tmp_path: Path) -> None:
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "__init__.py").write_text("")
    (package / "a.py").write_text("from pkg.b import thing\n")
    (package / "b.py").write_text("def thing():\n    from pkg import c\n")
    (package / "c.py").write_text("import importlib\nimportlib.import_module('pkg.a')\n")
    (package / "d.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pkg import a\n")
    (package / "e.py").write_text(
        "import importlib\nT = {'x': 'pkg.f:make'}\ndef get(k):\n    importlib.import_module(T[k])\n"
    )
    (package / "f.py").write_text("def make():\n    from pkg.e import get\n")
    graph = import_graph(package)
    assert graph["pkg.d"] == set()
    assert graph["pkg.e"] == {"pkg.f"}
    assert sorted(cycles(graph)) == [["pkg.a", "pkg.b", "pkg.c"], ["pkg.e", "pkg.f"]]


def test_no_import_cycles() -> None:
    assert cycles(import_graph(PACKAGE)) == []


def test_no_module_over_500_lines() -> None:
    long = {
        name: lines
        for name, path in _modules(PACKAGE).items()
        if (lines := len(path.read_text(encoding="utf-8").splitlines())) > MAX_LINES
    }
    assert long == {}


def test_no_folder_over_12_modules() -> None:
    per_folder = Counter(path.parent.relative_to(PACKAGE.parent) for path in _modules(PACKAGE).values())
    # A folder's __init__.py is its door, not one of its modules.
    per_folder.subtract(Counter(p.parent.relative_to(PACKAGE.parent) for p in PACKAGE.rglob("__init__.py")))
    wide = {str(folder): n for folder, n in per_folder.items() if n > MAX_MODULES_PER_FOLDER}
    assert wide == {}
