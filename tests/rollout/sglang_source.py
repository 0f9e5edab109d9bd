"""SGLang's own code, read from the pinned installed package without importing it whole.

``make test`` installs ``sglang`` (and ``sglang-router``) with ``--no-deps``: importing
``sglang`` would pull triton, torchvision and a GPU stack, so the contract tests read what they
need from its sources instead. `sglang_path` finds the installed files without executing any
package ``__init__``; `dataclass_fields` lists a dataclass's fields from the AST; `load_function`
executes one top-level function's own source in a namespace the test provides (its imports are
its own, inside the function body, or given in ``namespace``). What is checked is therefore
SGLang's text as shipped, not a copy written here.
"""

from __future__ import annotations

import ast
import importlib.metadata
import importlib.util
import sys
from pathlib import Path

PINNED = "0.5.23"


def sglang_version() -> str:
    return importlib.metadata.version("sglang")


def sglang_path(relative: str) -> Path:
    """``relative`` (e.g. ``"srt/utils/common.py"``) inside the installed ``sglang`` package."""
    spec = importlib.util.find_spec("sglang")  # a top-level spec lookup imports nothing
    if spec is None or not spec.submodule_search_locations:
        raise RuntimeError(
            "the sglang package is not installed: `make test` installs it with --no-deps "
            f"(pip install --no-deps sglang=={PINNED})"
        )
    path = Path(next(iter(spec.submodule_search_locations))) / relative
    if not path.is_file():
        raise RuntimeError(f"{path} is missing from the installed sglang {sglang_version()}")
    return path


def _tree(relative: str) -> ast.Module:
    return ast.parse(sglang_path(relative).read_text(encoding="utf-8"))


def _top_level(relative: str, name: str, kind: type) -> ast.AST:
    for node in _tree(relative).body:
        if isinstance(node, kind) and node.name == name:
            return node
    raise RuntimeError(f"{name} is not defined at the top level of sglang/{relative}")


def dataclass_fields(relative: str, class_name: str) -> list[str]:
    """Field names of a dataclass defined in ``sglang/<relative>``, in declaration order."""
    node = _top_level(relative, class_name, ast.ClassDef)
    return [
        item.target.id
        for item in node.body
        if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name)
    ]


def class_node(relative: str, name: str) -> ast.ClassDef:
    """The AST of class ``name`` in ``sglang/<relative>``."""
    return _top_level(relative, name, ast.ClassDef)


def load_function(relative: str, name: str, namespace: dict | None = None):
    """The function ``name`` of ``sglang/<relative>``, compiled from SGLang's source."""
    return _load(relative, _top_level(relative, name, ast.FunctionDef), namespace)


def load_class(relative: str, name: str, namespace: dict | None = None) -> type:
    """The class ``name`` of ``sglang/<relative>``, compiled from SGLang's source (decorators
    dropped: give ``dataclass`` semantics back with ``dataclasses.dataclass(cls)``)."""
    return _load(relative, class_node(relative, name), namespace)


def load_method(relative: str, class_name: str, name: str, namespace: dict | None = None):
    """Method ``name`` of class ``class_name`` in ``sglang/<relative>``, compiled from SGLang's
    source as a plain function (call it with any object standing in for ``self``)."""
    for node in class_node(relative, class_name).body:
        if isinstance(node, ast.FunctionDef) and node.name == name:
            return _load(relative, node, namespace)
    raise RuntimeError(f"{class_name}.{name} is not defined in sglang/{relative}")


def load_module(relative: str, name: str) -> dict:
    """Execute a self-contained module of ``sglang/<relative>`` (one that imports no other
    sglang module, checked) as module ``name`` (registered in ``sys.modules``, which
    dataclasses need) and return its namespace."""
    tree = _tree(relative)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom | ast.Import):
            modules = (
                [node.module or ""]
                if isinstance(node, ast.ImportFrom)
                else [a.name for a in node.names]
            )
            if any(m.split(".")[0] == "sglang" for m in modules):
                raise RuntimeError(f"sglang/{relative} imports sglang modules; load parts of it")
    module = sys.modules.get(name)
    if module is None:
        spec = importlib.util.spec_from_file_location(name, sglang_path(relative))
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module
        spec.loader.exec_module(module)
    return vars(module)


def _load(relative: str, node: ast.AST, namespace: dict | None):
    node.decorator_list = []
    module = ast.Module(body=[node], type_ignores=[])
    scope = dict(namespace or {})
    exec(compile(module, str(sglang_path(relative)), "exec"), scope)
    return scope[node.name]
