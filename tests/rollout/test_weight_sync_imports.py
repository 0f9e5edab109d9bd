"""The imports inside `megatron_rl.rollout.weight_sync` form no circle: `sync` picks a transport
and imports each, the transports see the sync only through `weight_sync.transport`.

The graph is read from the source with `ast`, every import statement counted (also those under
``if TYPE_CHECKING:`` and inside functions): a circle that only type hints close still ties the
modules together.
"""

from __future__ import annotations

import ast
import textwrap
from pathlib import Path

import megatron_rl

PACKAGE = "megatron_rl.rollout.weight_sync"
PACKAGE_DIR = Path(megatron_rl.__file__).parent / "rollout" / "weight_sync"


def import_graph(folder: Path, package: str) -> dict[str, set[str]]:
    """{module: the modules of ``package`` it imports}, for every ``*.py`` directly in
    ``folder`` (``__init__.py`` is ``package`` itself)."""
    modules = {
        path: package if path.stem == "__init__" else f"{package}.{path.stem}"
        for path in sorted(folder.glob("*.py"))
    }
    names = set(modules.values())
    graph: dict[str, set[str]] = {}
    for path, module in modules.items():
        here = module if path.stem == "__init__" else module.rpartition(".")[0]
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), filename=str(path))):
            if isinstance(node, ast.Import):
                edges.update(alias.name for alias in node.names)
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    parent = here.rsplit(".", node.level - 1)[0] if node.level > 1 else here
                    base = f"{parent}.{base}" if base else parent
                for alias in node.names:  # a submodule by name, else the module it is taken from
                    edges.add(f"{base}.{alias.name}" if f"{base}.{alias.name}" in names else base)
        graph[module] = {edge for edge in edges if edge in names and edge != module}
    return graph


def find_circle(graph: dict[str, set[str]]) -> list[str] | None:
    """One circle of ``graph`` as ``[a, b, ..., a]``, or None when it is acyclic."""
    state: dict[str, str] = {}  # "open" while on the path, "done" once fully explored
    path: list[str] = []

    def visit(module: str) -> list[str] | None:
        state[module] = "open"
        path.append(module)
        for target in sorted(graph.get(module, ())):
            if state.get(target) == "open":
                return [*path[path.index(target) :], target]
            if target not in state and (circle := visit(target)) is not None:
                return circle
        path.pop()
        state[module] = "done"
        return None

    for module in sorted(graph):
        if module not in state and (circle := visit(module)) is not None:
            return circle
    return None


def test_weight_sync_imports_form_no_circle():
    graph = import_graph(PACKAGE_DIR, PACKAGE)
    assert f"{PACKAGE}.sync" in graph and f"{PACKAGE}.disk" in graph[f"{PACKAGE}.sync"]
    circle = find_circle(graph)
    assert circle is None, "import circle: " + " -> ".join(circle)


def test_a_circle_closed_only_by_a_type_hint_import_is_found(tmp_path):
    """The check itself: two modules that import each other, one of them only for type hints
    and by a relative import, are a circle."""
    (tmp_path / "__init__.py").write_text("")
    (tmp_path / "picker.py").write_text("from pkg.carrier import Carrier\n")
    (tmp_path / "carrier.py").write_text(
        textwrap.dedent(
            """
            from typing import TYPE_CHECKING

            if TYPE_CHECKING:
                from .picker import Picker
            """
        )
    )
    graph = import_graph(tmp_path, "pkg")
    assert find_circle(graph) in (
        ["pkg.carrier", "pkg.picker", "pkg.carrier"],
        ["pkg.picker", "pkg.carrier", "pkg.picker"],
    )
    (tmp_path / "carrier.py").write_text("import os\n")
    assert find_circle(import_graph(tmp_path, "pkg")) is None
