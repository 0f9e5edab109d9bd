"""Tame third-party import-time side effects that cost a user of this package and tell them nothing.

megatron-core warns at import that Transformer Engine / Apex are absent and falls back to torch
(always the case on CPU, and a deliberate choice on GPU without them); it also warns about its own
deprecated defaults. It also wraps its small fused elementwise functions in ``torch.compile`` at
import, which loads torch._dynamo and torch._inductor for one function that this package's model
reaches: about 2 s of CPU time at the CLI's start (torch._dynamo alone is imported later anyway,
by torch's optimizers). And its timers module imports ``torch.utils.tensorboard`` (0.5-0.7 s:
tensorboard, protobuf) for a writer type this package never hands it.

Entry points (``python -m megatron_rl.train``, tools) call `quiet_third_party_warnings`,
`eager_megatron_fusions` and `defer_megatron_tensorboard` before importing megatron; the library
never does any of them itself, so users embedding it keep every warning, megatron's own choice of
fuser and its eager import.
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
MEGATRON_TIMERS = "megatron.core.timers"
"""The megatron-core module that imports ``torch.utils.tensorboard.SummaryWriter`` at import."""
TORCH_TENSORBOARD = "torch.utils.tensorboard"


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


class _DelegatingLoader(importlib.abc.Loader):
    """Delegates to megatron's own loader; subclasses add a step to ``exec_module``."""

    def __init__(self, loader) -> None:
        self._loader = loader

    def __getattr__(self, name: str):  # get_source, get_filename, ... for tracebacks, inspect
        return getattr(self._loader, name)

    def create_module(self, spec):
        return self._loader.create_module(spec)


class _DisableFuserAfterExec(_DelegatingLoader):
    """Calls the module's ``disable_jit_fuser()`` after executing it."""

    def exec_module(self, module) -> None:
        self._loader.exec_module(module)
        disable = getattr(module, "disable_jit_fuser", None)
        if callable(disable):
            disable()


def defer_megatron_tensorboard() -> bool:
    """Have ``megatron.core.timers`` import without importing ``torch.utils.tensorboard``, in this
    process; call before megatron is imported.

    megatron-core's timers module runs ``from torch.utils.tensorboard import SummaryWriter`` (a
    fallback to None when that fails) only to recognise a writer passed to ``Timers.write``. The
    module is executed with that import failing, as when tensorboard is not installed, and its
    ``SummaryWriter`` then becomes `DeferredSummaryWriter`, which imports torch's class at its
    first use (``isinstance``, a call): megatron behaves as before, and tensorboard is imported
    only by the run that writes events (``--tensorboard-dir``).

    Returns False, changing nothing, when either module is imported already.
    """
    if MEGATRON_TIMERS in sys.modules or TORCH_TENSORBOARD in sys.modules:
        return False
    if not any(isinstance(f, _DeferTensorBoardFinder) for f in sys.meta_path):
        sys.meta_path.insert(0, _DeferTensorBoardFinder())
    return True


def _torch_summary_writer() -> type:
    from torch.utils.tensorboard import SummaryWriter

    return SummaryWriter


class _DeferredType(type):
    def __instancecheck__(cls, instance) -> bool:
        return isinstance(instance, _torch_summary_writer())

    def __subclasscheck__(cls, subclass) -> bool:
        return issubclass(subclass, _torch_summary_writer())

    def __call__(cls, *args, **kwargs):
        return _torch_summary_writer()(*args, **kwargs)


class DeferredSummaryWriter(metaclass=_DeferredType):
    """``torch.utils.tensorboard.SummaryWriter`` imported on first use: ``isinstance(w, cls)``
    and ``cls(...)`` answer as the real class does."""


class _DeferTensorBoardFinder(importlib.abc.MetaPathFinder):
    """Finds ``megatron.core.timers`` through the other finders, once, and returns its spec with
    a loader that executes it while ``torch.utils.tensorboard`` cannot be imported."""

    def find_spec(self, fullname, path, target=None):
        if fullname != MEGATRON_TIMERS:
            return None
        sys.meta_path.remove(self)  # one use; also keeps the lookup below from recursing
        spec = importlib.util.find_spec(fullname)
        if spec is not None and spec.loader is not None:
            spec.loader = _ExecWithoutTensorBoard(spec.loader)
        return spec


class _ExecWithoutTensorBoard(_DelegatingLoader):
    """Executes the module with ``sys.modules["torch.utils.tensorboard"] = None`` (an import of
    it raises ImportError), then lets its ``SummaryWriter`` be `DeferredSummaryWriter`."""

    def exec_module(self, module) -> None:
        if TORCH_TENSORBOARD in sys.modules:  # imported meanwhile: nothing left to save
            self._loader.exec_module(module)
            return
        sys.modules[TORCH_TENSORBOARD] = None
        try:
            self._loader.exec_module(module)
        finally:
            if TORCH_TENSORBOARD in sys.modules and sys.modules[TORCH_TENSORBOARD] is None:
                del sys.modules[TORCH_TENSORBOARD]
        installed = importlib.util.find_spec("tensorboard") is not None
        if installed and getattr(module, "SummaryWriter", False) is None:
            module.SummaryWriter = DeferredSummaryWriter
