"""Package names imported on first use (PEP 562), so that light submodules load fast."""

from __future__ import annotations

import importlib
from collections.abc import Callable, Mapping


def lazy_getattr(package: str, homes: Mapping[str, str], namespace: dict) -> Callable:
    """A module ``__getattr__`` that imports ``homes[name]`` (a module path) on first access of
    ``name`` and caches the value in the package's ``namespace`` (its ``globals()``)."""

    def __getattr__(name: str):
        if name not in homes:
            raise AttributeError(f"module {package!r} has no attribute {name!r}")
        value = getattr(importlib.import_module(homes[name]), name)
        namespace[name] = value
        return value

    return __getattr__
