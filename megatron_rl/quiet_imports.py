"""Tame third-party import-time side effects that cost a user of this package and tell them nothing.

megatron-core warns at import that Transformer Engine / Apex are absent and falls back to torch
(always the case on CPU, and a deliberate choice on GPU without them); it also warns about its own
deprecated defaults. It also wraps its small fused elementwise functions in ``torch.compile`` at
import, which loads torch._dynamo and torch._inductor for one function that this package's model
reaches: about 2 s of CPU time at the CLI's start (torch._dynamo alone is imported later anyway,
by torch's optimizers).

Entry points (``python -m megatron_rl.train``, tools) call `quiet_third_party_warnings` and
`eager_megatron_fusions` before importing megatron; the library never does either itself, so
users embedding it keep every warning and megatron's own choice of fuser.
"""

from __future__ import annotations

import importlib.abc
import importlib.util
import sys
import warnings

_SILENCED = (
    r"Transformer Engine and Apex are not installed\..*",
    r"Apex is not installed\..*",
    r"Transformer Engine is not installed\..*",
    r"full scope is deprecated\..*",
)

MEGATRON_JIT = "megatron.core.jit"
"""The megatron-core module whose ``jit_fuser`` decorates its fused elementwise functions."""


def quiet_third_party_warnings() -> None:
    """Ignore the known uninformative warnings of megatron-core (this process only)."""
    for pattern in _SILENCED:
        warnings.filterwarnings("ignore", message=pattern, category=UserWarning)


def eager_megatron_fusions() -> bool:
    """Have megatron-core's ``@jit_fuser`` functions stay plain Python functions (eager torch)
    instead of ``torch.compile`` wrappers, in this process; call before megatron is imported.

    megatron-core binds ``megatron.core.jit.jit_fuser = torch.compile`` and decorates about 20
    functions with it while ``megatron.core`` is imported; each decoration imports torch._dynamo
    and torch._inductor. The model built here (no bias-activation fusion, no flex dispatcher)
    reaches one of them, the router's ``_apply_expert_bias`` (an integer count of routed tokens,
    a no-op without expert bias), whose eager result is the same; eager also skips dynamo's guard
    check on every router call. The switch is megatron's own `disable_jit_fuser`, run right after
    ``megatron.core.jit`` executes and before any module reads ``jit_fuser``.

    Returns False, changing nothing, when ``megatron.core.jit`` is imported already (its users
    are decorated by then); a megatron without `disable_jit_fuser` keeps its fuser.
    """
    if MEGATRON_JIT in sys.modules:
        return False
    if not any(isinstance(f, _EagerFuserFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _EagerFuserFinder())
    return True


class _EagerFuserFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.jit`` through the other finders, once, and returns its spec with a
    loader that calls the module's ``disable_jit_fuser()`` after executing it."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MEGATRON_JIT:
            return None
        sys.meta_path.remove(self)  # one use; also keeps the lookup below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _DisableFuserAfterExec(spec.loader)
        return spec


class _DisableFuserAfterExec(importlib.abc.Loader):
    """Delegates to megatron's own loader; only ``exec_module`` adds a step after it."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str):  # get_source, get_filename, ... for tracebacks, inspect
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        disable = getattr(module, "disable_jit_fuser", None)
        if callable(disable):
            disable()
