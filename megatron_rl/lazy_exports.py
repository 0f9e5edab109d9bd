"""Names and modules imported on first use, so that light submodules and the trainer load fast.

`lazy_getattr`: a package's names imported on first access (PEP 562). `lazy_module`: a whole
third-party module whose code runs on its first real use, not at ``import``.
"""

from __future__ import annotations

import importlib
import importlib.util
import sys
import threading
import types
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


# read by the import statement, `importlib.util.find_spec` and `inspect.getmodule`: not a use
_IMPORT_ATTRS = frozenset(
    {"__spec__", "__name__", "__loader__", "__package__", "__file__", "__cached__", "__class__"}
)
_LOAD_LOCK = threading.RLock()


class _LazyModule(types.ModuleType):
    """A module not executed yet; any other attribute access runs its code in place (the object
    becomes a plain module, so every holder of it sees the loaded module)."""

    def __getattribute__(self, attr: str):
        if attr in _IMPORT_ATTRS:
            return super().__getattribute__(attr)
        _load(self)
        return getattr(self, attr)

    def __delattr__(self, attr: str) -> None:
        _load(self)
        delattr(self, attr)


def _load(module: types.ModuleType) -> None:
    with _LOAD_LOCK:
        if type(module) is not _LazyModule:  # loaded by another thread meanwhile
            return
        module.__class__ = types.ModuleType
        spec = module.__spec__
        try:
            spec.loader.exec_module(module)
        except BaseException:
            if sys.modules.get(spec.name) is module:
                del sys.modules[spec.name]  # as a failed import: the next import retries
            raise


def lazy_module(name: str) -> None:
    """Register top-level module ``name`` in ``sys.modules`` unexecuted: ``import name`` then
    costs nothing, and its code runs on the first attribute access (``name.init``, ``from name
    import x``, ``import name.sub``).

    Nothing happens when ``name`` is imported already or not installed (``import name`` then
    raises ImportError as before).
    """
    if name in sys.modules:
        return
    spec = importlib.util.find_spec(name)
    if spec is None or not hasattr(spec.loader, "exec_module"):
        return
    module = importlib.util.module_from_spec(spec)
    module.__class__ = _LazyModule
    sys.modules[name] = module
