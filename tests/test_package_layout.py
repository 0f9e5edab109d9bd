"""The library does not depend on its test doubles: no module under ``megatron_rl/`` outside
``megatron_rl/testing/`` imports ``megatron_rl.testing`` (statically, relatively, or by a dotted
name handed to ``importlib``), and the SGLang stand-in lives only in ``megatron_rl.testing``."""

from __future__ import annotations

import ast
import re
from pathlib import Path

import megatron_rl

PACKAGE_DIR = Path(megatron_rl.__file__).parent
TESTING = "megatron_rl.testing"
_DOTTED_TESTING = re.compile(rf"^{re.escape(TESTING)}(\.\w+)*$")


def _module_name(path: Path) -> str:
    """``megatron_rl/rollout/x.py`` -> ``megatron_rl.rollout.x`` (a package: its ``__init__``)."""
    parts = path.relative_to(PACKAGE_DIR.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _resolve(node: ast.ImportFrom, module: str, is_package: bool) -> str:
    """The absolute module a (possibly relative) ``from ... import`` names."""
    if node.level == 0:
        return node.module or ""
    base = module.split(".") if is_package else module.split(".")[:-1]
    base = base[: len(base) - (node.level - 1)]
    return ".".join([*base, node.module] if node.module else base)


def imports_of_testing(source: str, module: str, is_package: bool = False) -> list[str]:
    """Each import of ``megatron_rl.testing`` in ``source`` (the code of ``module``), as text:
    ``import``/``from`` statements, relative ones resolved, and string constants that are exactly
    a dotted ``megatron_rl.testing[.x]`` name (``importlib.import_module``, lazy exports)."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            target = _resolve(node, module, is_package)
            names = [target] + [f"{target}.{alias.name}" for alias in node.names]
        elif isinstance(node, ast.Constant) and isinstance(node.value, str):
            names = [node.value] if _DOTTED_TESTING.match(node.value) else []
        else:
            continue
        if any(n == TESTING or n.startswith(TESTING + ".") for n in names):
            found.append(f"line {node.lineno}: {ast.unparse(node)}")
    return found


def _library_modules() -> list[Path]:
    testing_dir = PACKAGE_DIR / "testing"
    return [p for p in sorted(PACKAGE_DIR.rglob("*.py")) if testing_dir not in p.parents]


def test_no_library_module_imports_megatron_rl_testing():
    offenders = {
        str(path.relative_to(PACKAGE_DIR.parent)): hits
        for path in _library_modules()
        if (
            hits := imports_of_testing(
                path.read_text(encoding="utf-8"), _module_name(path), path.name == "__init__.py"
            )
        )
    }
    assert not offenders, (
        f"library modules import the test doubles of {TESTING} (move the code they need into the "
        f"library, or the importer into tests/ or tools/): {offenders}"
    )


def test_the_import_check_sees_absolute_relative_and_dynamic_imports():
    """The check above can fail: each spelling of an import of the test doubles is caught, and
    neighbours that merely mention the name (a docstring, ``megatron_rl.testing_x``) are not."""
    caught = [
        "import megatron_rl.testing.loopback_server",
        "from megatron_rl.testing import loopback_server",
        "from megatron_rl.testing.loopback_server import LoopbackServer",
        "from ..testing import loopback_server",
        "from .. import testing",
        "importlib.import_module('megatron_rl.testing.loopback_server')",
    ]
    for source in caught:
        assert imports_of_testing(source, "megatron_rl.rollout.http_pool"), source
    ignored = [
        '"""Tests use `megatron_rl.testing.loopback_server` instead of SGLang."""',
        "import megatron_rl.testing_x",
        "from megatron_rl.rollout import testing",
        "from . import testing",  # megatron_rl.rollout.testing
    ]
    for source in ignored:
        assert not imports_of_testing(source, "megatron_rl.rollout.http_pool"), source


def test_the_sglang_stand_in_lives_only_in_megatron_rl_testing():
    defining = sorted(
        str(path.relative_to(PACKAGE_DIR.parent))
        for path in PACKAGE_DIR.rglob("*.py")
        if any(
            isinstance(node, ast.ClassDef) and node.name == "LoopbackServer"
            for node in ast.walk(ast.parse(path.read_text(encoding="utf-8")))
        )
    )
    assert defining == ["megatron_rl/testing/loopback_server.py"]
