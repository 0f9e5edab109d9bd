"""megatron-core's own optimizer (plain and distributed) on the CPU, through two confined shims.

The GPU path runs ``get_megatron_optimizer``: mixed-precision master weights, the distributed
optimizer's sharded state, global-norm clipping over every model-parallel group, its checkpoint
format. So that the same code runs in CPU tests, two obstacles of megatron-core 0.16-0.19 are
removed, both confined to megatron-core:

1. Tensor factories with ``device="cuda"``. ``optimizer.py``, ``distrib_optimizer.py``,
   ``clip_grads.py``, ``grad_scaler.py`` and ``param_and_grad_buffer.py`` allocate flags, norms
   and scales with a literal ``device='cuda'``. The ``torch`` proxy that the CPU backend gives
   megatron's modules (see ``backend/cpu.py``) maps that device to the CPU in ``tensor``,
   ``zeros``, ``ones``, ``empty``, ``full``, ``arange`` and their ``*_like`` forms
   (`CPU_FACTORIES`); the real ``torch`` is untouched.
2. Tensor type names. megatron checks ``param.type()`` against ``'torch.cuda.FloatTensor'`` (and
   the half/bf16 names) when it builds its parameter groups and before clipping. Inside
   `cuda_type_names` a CPU tensor's ``type()`` (no arguments) reports the CUDA name. This is a
   process-wide patch of ``torch.Tensor.type``, so it is held only around the optimizer's
   construction, ``step()`` and state-dict calls (`PolicyOptimizer` does that), never longer.

Without TE/apex megatron's Adam is ``torch.optim.AdamW``, whose default on CPU tensors is its
per-tensor Python loop (torch picks ``foreach`` only for CUDA). `foreach_adam` switches its
parameter groups to torch's ``foreach`` implementation for the duration of a step: the same
operations in the same order, one C++ loop over the tensors (bitwise the same parameters and
moments; ``tests/backend/test_foreach_adam.py``). The groups get their own value back afterwards,
so state dicts and checkpoints are unchanged. torch's ``fused`` CPU kernel (``fused=True``) is
faster still (one pass over each tensor's state instead of one per operation: 2.2x foreach's
Adam on tiny-mismatch, ``megatron-rl bench optimizer --fused``) but orders the arithmetic
differently: ~6e-8 of the largest parameter after 5 steps, not bitwise. The trainer uses fused
by default (``--cpu-adam fused``; TE and apex fuse Adam on GPU too) and foreach with
``--cpu-adam foreach``, for runs that must equal megatron's own loop bit for bit.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Callable, Iterator
from typing import Any

import torch

CPU_FACTORIES = (
    "tensor",
    "zeros",
    "ones",
    "empty",
    "full",
    "arange",
    "zeros_like",
    "ones_like",
    "empty_like",
    "full_like",
)

_LOCK = threading.RLock()
_DEPTH = [0]
_REAL_TYPE = torch.Tensor.type


def _on_cpu(device: Any) -> Any:
    """``device`` with every CUDA device replaced by the CPU (None and CPU pass through)."""
    if isinstance(device, int):
        return torch.device("cpu")
    if device is not None and torch.device(device).type == "cuda":
        return torch.device("cpu")
    return device


def cpu_factory(factory: Callable) -> Callable:
    """``factory`` that allocates on the CPU whenever it is asked for a CUDA device."""

    def allocate(*args: Any, **kwargs: Any) -> Any:
        if "device" in kwargs:
            kwargs["device"] = _on_cpu(kwargs["device"])
        return factory(*args, **kwargs)

    allocate.__name__ = getattr(factory, "__name__", "factory")
    return allocate


def _cuda_type(self: torch.Tensor, dtype: Any = None, non_blocking: bool = False, **kwargs):
    if dtype is None and not kwargs and self.device.type == "cpu":
        name = _REAL_TYPE(self)  # idempotent: a torch function mode may route back through us
        return name if name.startswith("torch.cuda.") else name.replace("torch.", "torch.cuda.", 1)
    return _REAL_TYPE(self, dtype, non_blocking, **kwargs)


@contextlib.contextmanager
def foreach_adam(optimizers: list[torch.optim.Optimizer], *, fused: bool = False) -> Iterator[None]:
    """Within the block, torch's Adam/AdamW ``optimizers`` step with ``foreach=True`` (``fused``:
    with ``fused=True``) wherever their group left the choice to torch (``foreach`` and
    ``fused`` unset); the groups' own values come back after."""
    key = "fused" if fused else "foreach"
    switched = [
        group
        for optimizer in optimizers
        if isinstance(optimizer, torch.optim.Adam)  # AdamW is an Adam subclass
        for group in optimizer.param_groups
        if group.get("foreach") is None and group.get("fused") is None
    ]
    for group in switched:
        group[key] = True
    try:
        yield
    finally:
        for group in switched:
            group[key] = None


@contextlib.contextmanager
def cuda_type_names() -> Iterator[None]:
    """Within the block, ``cpu_tensor.type()`` reads ``'torch.cuda.FloatTensor'`` etc."""
    with _LOCK:
        if _DEPTH[0] == 0:
            torch.Tensor.type = _cuda_type
        _DEPTH[0] += 1
    try:
        yield
    finally:
        with _LOCK:
            _DEPTH[0] -= 1
            if _DEPTH[0] == 0:
                torch.Tensor.type = _REAL_TYPE
