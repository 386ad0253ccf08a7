"""The package layout stays acyclic: no module imports, directly or through others, a
module that imports it back -- counting imports inside functions (which import-linter's
layer contracts cannot order within one package) and names a package re-exports lazily
(``_EXPORTS``), and leaving out ``if TYPE_CHECKING:`` blocks (never run)."""

from __future__ import annotations

import ast
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path

SRC = Path(__file__).resolve().parents[1] / "src"


def _modules() -> dict[str, Path]:
    modules = {}
    for path in (SRC / "ludic").rglob("*.py"):
        parts = path.with_suffix("").relative_to(SRC).parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        modules[name] = path
    return modules


def _lazy_exports(tree: ast.Module) -> dict[str, str]:
    """``_EXPORTS = {"Name": "module", ...}`` of a package ``__init__``."""
    for node in tree.body:
        target = node.target if isinstance(node, ast.AnnAssign) else None
        if isinstance(node, ast.Assign) and len(node.targets) == 1:
            target = node.targets[0]
        if isinstance(target, ast.Name) and target.id == "_EXPORTS":
            return ast.literal_eval(node.value)
    return {}


def _runtime_imports(tree: ast.Module) -> Iterator[ast.Import | ast.ImportFrom]:
    """Every import statement except those under ``if TYPE_CHECKING:``."""
    stack: list[ast.AST] = [tree]
    while stack:
        node = stack.pop()
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            stack.extend(node.orelse)
            continue
        if isinstance(node, ast.Import | ast.ImportFrom):
            yield node
        stack.extend(ast.iter_child_nodes(node))


def import_graph() -> dict[str, set[str]]:
    """Module -> the ``ludic`` modules it imports at run time."""
    modules = _modules()
    trees = {name: ast.parse(path.read_text()) for name, path in modules.items()}
    exports = {name: _lazy_exports(tree) for name, tree in trees.items()}

    def targets(module: str, names: list[str]) -> Iterator[str]:
        """``from module import names``: a submodule named is imported (its package's
        ``__init__`` runs first in any case, as for every submodule import); any other
        name comes from ``module`` itself, or from the module that lazily exports it."""
        if module in modules and not (
            names and all(f"{module}.{name}" in modules for name in names)
        ):
            yield module
        for name in names:
            if f"{module}.{name}" in modules:
                yield f"{module}.{name}"
            elif name in exports.get(module, {}):
                yield exports[module][name]

    graph: dict[str, set[str]] = defaultdict(set)
    for name, tree in trees.items():
        package = name if modules[name].name == "__init__.py" else name.rpartition(".")[0]
        for node in _runtime_imports(tree):
            if isinstance(node, ast.Import):
                found = [t for alias in node.names for t in targets(alias.name, [])]
            else:
                base = node.module or ""
                if node.level:
                    parts = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join([*parts, *([node.module] if node.module else [])])
                found = list(targets(base, [alias.name for alias in node.names]))
            graph[name].update(t for t in found if t != name)
    # A lazily exported name reaches its module only when asked for, not on import.
    return graph


def import_cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    cycles: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                cycles.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return cycles


def test_no_import_cycles_anywhere_in_ludic() -> None:
    cycles = import_cycles(import_graph())
    assert not cycles, "import cycles (each line one cycle's modules):\n" + "\n".join(
        " <-> ".join(c) for c in cycles
    )


def test_the_cycle_check_sees_imports_inside_functions() -> None:
    graph = {"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}
    assert import_cycles(graph) == [["a", "b", "c"]]
    # preflight imports the builders (it once did so inside a function): the edge is seen
    assert "ludic.run.builders" in import_graph()["ludic.run.preflight"]
