"""Run megatron-core on a CPU-only machine (gloo), without touching torch for the process.

`activate_cpu_backend()` is the only entry point. It is explicit (the trainer's device setting
calls it, or `megatron_rl.backend.select_device("auto")` when CUDA is absent), idempotent, and a
no-op when CUDA is available. Every redirection below is confined to megatron-core's own modules
(their module-level ``torch`` name, or a function in their namespace); torch itself, transformers
and the rest of the process keep the real ``torch.cuda``.

Shims, what each is for, and which megatron-core versions need it (checked on 0.16.1; the
comments say where 0.19 no longer needs one, the rest apply to both):

1. ``torch.cuda`` seen by megatron modules. Many modules call ``torch.cuda.current_device()``
   for placement, create ``torch.cuda.Stream()``/``Event()`` (alltoall dispatcher, shared
   experts) and enter ``torch.cuda.stream(...)`` contexts. Each loaded ``megatron.core`` module
   gets a proxy ``torch`` whose ``cuda`` attribute maps ``current_device`` to the CPU device,
   streams and events to no-op stand-ins (classes, so annotations still evaluate), ``synchronize``
   and ``empty_cache`` to no-ops and the RNG functions to the CPU generator. Needed by 0.16-0.19.
2. RNG tracker: ``model_parallel_cuda_manual_seed`` and ``CudaRNGStatesTracker`` save and
   restore CUDA generator states. On CPU the tracker forks the CPU generator instead, so
   tensor-parallel initialisation and activation recompute work (0.16-0.19).
3. ``get_default_causal_mask`` builds its mask with ``device="cuda"``; the fused-softmax module
   gets a CPU version, so ``attention_mask=None`` works (0.16-0.19).
4. ``moe_utils``: without Transformer Engine, 0.16.1 never defines ``te_general_gemm`` and the
   ``fused_*`` symbols; `backend/without_te.py` defines them (on CUDA too). Fixed in 0.19.
5. Alltoall dispatcher split sizes: on GPU they are moved to host numpy arrays; CPU tensors were
   left as tensors, which gloo's ``all_to_all_single`` rejects. The dispatcher's
   ``maybe_move_tensor_to_cpu`` is replaced by one that always returns numpy when asked (0.16-0.19).
6. Tensor factories with a literal ``device="cuda"`` (megatron's optimizer, grad scaler, grad
   clipping and grad buffers) allocate on the CPU; with shim 7 (``Tensor.type()`` names, held
   only around optimizer calls) this runs megatron's own optimizer, distributed included: see
   ``backend/cpu_optimizer.py`` (0.16-0.19).
The sequence-parallel norm (torch's fallback norm refuses sequence parallelism) is a layer-spec
swap that applies to any run without Transformer Engine: see ``backend/norm.py``.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import sys
import types
from typing import Any

import torch

from megatron_rl.backend.cpu_optimizer import CPU_FACTORIES, cpu_factory
from megatron_rl.backend.without_te import define_missing_te_symbols

logger = logging.getLogger(__name__)

_CPU = torch.device("cpu")
_STATE: dict[str, Any] = {"active": False}

# Modules imported before the proxy is installed, so that every module megatron_rl uses is covered.
_MEGATRON_MODULES = (
    "megatron.core.parallel_state",
    "megatron.core.tensor_parallel",
    "megatron.core.tensor_parallel.random",
    "megatron.core.tensor_parallel.layers",
    "megatron.core.tensor_parallel.mappings",
    "megatron.core.models.gpt.gpt_model",
    "megatron.core.models.gpt.gpt_layer_specs",
    "megatron.core.transformer.utils",
    "megatron.core.fusions.fused_softmax",
    "megatron.core.transformer.moe.moe_utils",
    "megatron.core.transformer.moe.router",
    "megatron.core.transformer.moe.experts",
    "megatron.core.transformer.moe.shared_experts",
    "megatron.core.transformer.moe.token_dispatcher",
    "megatron.core.transformer.moe.router_replay",
    "megatron.core.distributed",
    "megatron.core.distributed.finalize_model_grads",
    "megatron.core.pipeline_parallel.schedules",
    "megatron.core.utils",
    "megatron.core.optimizer",
    "megatron.core.optimizer.optimizer",
    "megatron.core.optimizer.distrib_optimizer",
    "megatron.core.optimizer.clip_grads",
    "megatron.core.optimizer.grad_scaler",
    "megatron.core.distributed.param_and_grad_buffer",
)


class NullEvent:
    """Stand-in for ``torch.cuda.Event``: CPU work is synchronous, so every wait is a no-op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def record(self, stream: Any = None) -> None:
        del stream

    def synchronize(self) -> None:
        return None

    def wait(self, stream: Any = None) -> None:
        del stream

    def query(self) -> bool:
        return True

    def elapsed_time(self, end_event: Any) -> float:
        del end_event
        return 0.0


class NullStream:
    """Stand-in for ``torch.cuda.Stream``; one CPU "stream" that is always idle."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        del args, kwargs

    def wait_stream(self, stream: Any) -> None:
        del stream

    def wait_event(self, event: Any) -> None:
        del event

    def record_event(self, event: Any = None) -> NullEvent:
        return event if event is not None else NullEvent()

    def synchronize(self) -> None:
        return None

    def query(self) -> bool:
        return True

    def __eq__(self, other: object) -> bool:
        return isinstance(other, NullStream)

    def __hash__(self) -> int:
        return 0


_DEFAULT_STREAM = NullStream()


def _get_rng_state(device: Any = None) -> torch.Tensor:
    del device
    return torch.get_rng_state()


def _set_rng_state(new_state: torch.Tensor, device: Any = None, graph_safe: bool = False) -> None:
    del device, graph_safe
    torch.set_rng_state(new_state)


def _manual_seed(seed: int) -> None:
    torch.default_generator.manual_seed(int(seed))


class _CudaOnCpu(types.ModuleType):
    """What megatron modules see as ``torch.cuda`` once the CPU backend is active."""

    def __init__(self) -> None:
        super().__init__("torch.cuda")
        self.Stream = NullStream
        self.Event = NullEvent
        self.random = types.SimpleNamespace(
            get_rng_state=_get_rng_state, set_rng_state=_set_rng_state, manual_seed=_manual_seed
        )

    def __getattr__(self, name: str) -> Any:
        return getattr(torch.cuda, name)

    @staticmethod
    def current_device() -> torch.device:
        return _CPU

    @staticmethod
    def current_stream(device: Any = None) -> NullStream:
        del device
        return _DEFAULT_STREAM

    default_stream = current_stream

    @staticmethod
    def stream(stream: Any) -> contextlib.AbstractContextManager:
        del stream
        return contextlib.nullcontext()

    @staticmethod
    def synchronize(device: Any = None) -> None:
        del device

    @staticmethod
    def empty_cache() -> None:
        return None

    @staticmethod
    def set_device(device: Any) -> None:
        del device

    @staticmethod
    def device_count() -> int:
        return 0

    get_rng_state = staticmethod(_get_rng_state)
    set_rng_state = staticmethod(_set_rng_state)
    manual_seed = staticmethod(_manual_seed)
    manual_seed_all = staticmethod(_manual_seed)


class _TorchForMegatron(types.ModuleType):
    """A ``torch`` that differs from the real one in its ``cuda`` attribute and in tensor
    factories, which allocate on the CPU when asked for ``device="cuda"`` (shim 6)."""

    def __init__(self) -> None:
        super().__init__("torch")
        self.cuda = _CudaOnCpu()
        for name in CPU_FACTORIES:
            setattr(self, name, cpu_factory(getattr(torch, name)))

    def __getattr__(self, name: str) -> Any:
        return getattr(torch, name)


def _cpu_default_causal_mask(sq: int) -> torch.Tensor:
    """Causal mask [sq, sq] on CPU, True above the diagonal (masked), as megatron's version."""
    return torch.triu(torch.ones(sq, sq, device=_CPU), diagonal=1).bool()


def _maybe_move_tensor_to_cpu(
    tensor: Any, as_numpy: bool = False, record_stream: bool = False
) -> Any:
    """Like megatron's helper, but CPU tensors also become numpy arrays when asked (for gloo)."""
    del record_stream
    if torch.is_tensor(tensor):
        tensor = tensor.detach().to(_CPU)
        if as_numpy:
            return tensor.numpy()
    return tensor


def _make_cpu_rng_tracker_class(base: type) -> type:
    class CpuRNGStatesTracker(base):  # type: ignore[misc, valid-type]
        """``CudaRNGStatesTracker`` whose named states are CPU generator states."""

        @contextlib.contextmanager
        def fork(self, name: str = "model-parallel-rng"):
            if name not in self.states_:
                raise RuntimeError(f"rng state {name!r} was never added to the tracker")
            orig_state = torch.get_rng_state()
            orig_name = self._current_state_name
            if orig_name != "default-rng":
                self.states_[orig_name] = orig_state
            torch.set_rng_state(self.states_[name])
            self._current_state_name = name
            try:
                yield
            finally:
                self.states_[name] = torch.get_rng_state()
                if orig_name != "default-rng":
                    orig_state = self.states_[orig_name]
                torch.set_rng_state(orig_state)
                self._current_state_name = orig_name

    return CpuRNGStatesTracker


DEVICES = ("auto", "cpu", "cuda")


def cuda_available() -> bool:
    """Whether this process computes on CUDA (the only question other modules ask about it)."""
    return torch.cuda.is_available() and not _STATE["active"]


def select_device(device: str = "auto") -> torch.device:
    """Resolve the trainer's device setting; activate the CPU backend when it is the CPU.

    Args:
        device: "auto" (CUDA when present, else CPU), "cpu" or "cuda".

    Returns:
        ``torch.device("cuda", LOCAL_RANK)`` (and makes it current) or ``torch.device("cpu")``.
    """
    if device not in DEVICES:
        raise ValueError(f"device={device!r}: choose one of {DEVICES}")
    has_cuda = torch.cuda.is_available()
    if device == "cuda" and not has_cuda:
        raise ValueError("device='cuda' but CUDA is not available; use device='cpu' or 'auto'")
    if device == "cuda" or (device == "auto" and has_cuda):
        local_rank = int(os.environ.get("LOCAL_RANK", 0))
        torch.cuda.set_device(local_rank)
        return torch.device("cuda", local_rank)
    activate_cpu_backend(force=True)
    return _CPU


def cpu_backend_active() -> bool:
    """True once `activate_cpu_backend` has installed the shims in this process."""
    return bool(_STATE["active"])


_TORCH_PROXY = _TorchForMegatron()


def _redirect_loaded_modules() -> int:
    """Point the ``torch`` name of every loaded megatron-core module at the proxy."""
    patched = 0
    for mod_name, module in list(sys.modules.items()):
        if mod_name.startswith("megatron.core") and getattr(module, "torch", None) is torch:
            module.torch = _TORCH_PROXY
            patched += 1
    return patched


def activate_cpu_backend(force: bool = False) -> bool:
    """Install the CPU shims into megatron-core's modules.

    Args:
        force: install even when CUDA is available (tests only; never needed in training).

    Calling it again is cheap and also covers megatron-core modules imported since.

    Returns:
        True if the shims are active after the call, False if CUDA is present (no-op).
    """
    if _STATE["active"]:
        _redirect_loaded_modules()  # megatron modules imported since the first call
        return True
    if torch.cuda.is_available() and not force:
        logger.info("CUDA is available: CPU backend not activated")
        return False
    for name in _MEGATRON_MODULES:
        importlib.import_module(name)

    define_missing_te_symbols()

    patched = _redirect_loaded_modules()

    random_mod = sys.modules["megatron.core.tensor_parallel.random"]
    random_mod._get_cuda_rng_state = lambda device="cuda", clone=False, graph_safe=False: (
        torch.get_rng_state()
    )
    random_mod._set_cuda_rng_state = _set_rng_state
    random_mod.CudaRNGStatesTracker = _make_cpu_rng_tracker_class(random_mod.CudaRNGStatesTracker)
    random_mod.initialize_rng_tracker(force_reset=True)

    fused_softmax = sys.modules["megatron.core.fusions.fused_softmax"]
    fused_softmax.get_default_causal_mask = _cpu_default_causal_mask
    dispatcher = sys.modules["megatron.core.transformer.moe.token_dispatcher"]
    dispatcher.maybe_move_tensor_to_cpu = _maybe_move_tensor_to_cpu

    _STATE["active"] = True
    logger.info("CPU backend active: %d megatron-core modules redirected", patched)
    return True
