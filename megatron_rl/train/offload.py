"""The trainer's device memory, given up around a rollout and taken back before the update.

`TrainerOffload.offload()` copies every storage behind the policy's parameters, module buffers,
megatron DDP's contiguous ``param_data`` / ``grad_data`` buffers (``main_grad`` views included)
and the optimizer's tensors (its fp32 main parameters and their ``.grad``, Adam's ``exp_avg`` and
``exp_avg_sq``) into one host arena (pinned on GPU), then frees the device storage with
``untyped_storage().resize_(0)``; `onload()` resizes each storage back and copies its bytes in.
megatron DDP's gradient buffers (``grad_data``, with the ``main_grad`` views into them) are freed
but not copied: the trainer zeroes them before every update (``zero_grad``), so their bytes at
the end of a step are never read again, and `onload()` gives them back zeroed (as megatron's own
``reload_from_cpu`` does). Their bytes never cross the bus: fp32 gradients are 4 bytes per
parameter, beside 2 of bf16 weights and 12 / DP of the distributed Adam's state. Every tensor
keeps its identity
and its views (a parameter that views ``param_data``, an
optimizer's ``main_grad`` view), so nothing has to be re-pointed, and any use of an offloaded
tensor fails loudly ("setStorage: ... requiring a storage size ..."). Views are handled by
working on the underlying storages, each once.

**One host arena per rank** (`HostArena`): every storage's copy is a slice of one host tensor of
exactly the bytes needed (each copy starting at a multiple of `ARENA_ALIGN`), allocated at the
first offload and reused while the set of storages and their sizes stay the same. On GPU the
arena is ordinary host memory registered once with ``cudaHostRegister``. torch's pinned
allocator (``pin_memory=True``, one call per storage) would instead round every copy up to a
power of two (up to 2x the host memory the memory plan counts) and pay one ``cudaHostAlloc`` per
storage, thousands of them for a large MoE rank.

On a CPU run the "device" is the CPU: the host copy is a second CPU tensor and the freed
storage really is freed, so the accounting of `resident_bytes` and the failure on use are the
same as on GPU.

Why not megatron-core's own (0.16.1) offload: ``_ParamAndGradBuffer.offload_to_cpu`` /
``reload_from_cpu`` (``distributed/param_and_grad_buffer.py``; ``DistributedDataParallel.
offload_grad_buffers`` / ``restore_grad_buffers``) use the same ``storage().resize_(0)`` trick
but keep the params' host copy as ``param_data.cpu().pin_memory()``, which on a CPU tensor is the
tensor itself (freed with it) or fails without CUDA, and they zero the gradients on reload;
``MegatronOptimizer.offload_to_cpu`` / ``restore_from_cpu`` (``optimizer/optimizer.py``) move
only CUDA tensors and re-bind ``p.data`` / state entries to new tensors, which detaches optimizer
parameters that view the DDP buffers (the non-distributed fp32 optimizer's). This module does
what they do, for every storage at once, on both devices.
"""

from __future__ import annotations

import logging
from collections.abc import Iterator

import torch

logger = logging.getLogger(__name__)

ARENA_ALIGN = 512  # bytes; every storage's host copy starts at a multiple


class HostArena:
    """One host buffer holding a copy of each of a fixed list of storage sizes.

    ``sizes``: bytes per storage, in order; ``views[i]`` is storage i's slice (``sizes[i]`` bytes,
    starting at a multiple of `ARENA_ALIGN`); ``nbytes`` is the buffer's size, at most
    ``sum(sizes) + len(sizes) * ARENA_ALIGN`` (and one `ARENA_ALIGN` more is allocated, to align
    its start). ``pin``: register the buffer with CUDA
    (``cudaHostRegister``: page-locked, exactly ``nbytes``) so that copies to and from the GPU
    run at full bus speed; `release()` unregisters it."""

    def __init__(self, sizes: list[int], *, pin: bool = False) -> None:
        offsets, end = [], 0
        for size in sizes:
            if size <= 0:
                raise ValueError(f"HostArena: storage sizes must be positive, got {size}")
            offsets.append(end)
            end += -(-size // ARENA_ALIGN) * ARENA_ALIGN
        # torch aligns CPU allocations to 64 bytes: over-allocate and start at an aligned byte
        raw = torch.empty(end + ARENA_ALIGN, dtype=torch.uint8)
        start = -raw.data_ptr() % ARENA_ALIGN
        self.buffer = raw[start : start + end]
        self.views = [self.buffer[o : o + n] for o, n in zip(offsets, sizes, strict=True)]
        self.pinned = False
        if pin and end:
            _cuda_check(torch.cuda.cudart().cudaHostRegister(self.buffer.data_ptr(), end, 0))
            self.pinned = True

    @property
    def nbytes(self) -> int:
        return self.buffer.numel()

    def release(self) -> None:
        """Unregister a pinned buffer (the memory itself goes with the last reference)."""
        if self.pinned:
            _cuda_check(torch.cuda.cudart().cudaHostUnregister(self.buffer.data_ptr()))
            self.pinned = False


def _cuda_check(result) -> None:
    code = getattr(result, "value", result)
    if code != 0:
        raise RuntimeError(f"host memory registration failed: CUDA error {result}")


class TrainerOffload:
    """``offload()`` / ``onload()`` of a megatron DDP model and its optimizer; see the module
    docstring. ``optimizer``: a `PolicyOptimizer`, a megatron optimizer (chained or not) or a
    torch optimizer. ``device``: where the trainer computes (default: the parameters')."""

    def __init__(self, model: torch.nn.Module, optimizer, *, device=None) -> None:
        self.model = model
        self.optimizer = optimizer
        first = next(model.parameters())
        self.device = torch.device(device) if device is not None else first.device
        # (storage, host copy or None for a gradient buffer, its device bytes)
        self._held: list[tuple[torch.UntypedStorage, torch.Tensor | None, int]] = []
        # kept across steps (pinning tens of GB anew for every rollout costs seconds) while the
        # storages and their sizes are the same; ``host_allocations`` counts the arenas made
        self._arena: HostArena | None = None
        self._arena_key: tuple[tuple[int, int], ...] = ()
        self.host_allocations = 0
        self.copied_bytes = 0  # the last offload's bytes copied to host (gradients are not)

    @property
    def offloaded(self) -> bool:
        return bool(self._held)

    @property
    def host_bytes(self) -> int:
        """Bytes of the host arena (0 before the first offload)."""
        return self._arena.nbytes if self._arena is not None else 0

    def resident_bytes(self) -> int:
        """Bytes of the tracked tensors' storages (each counted once) held on ``self.device``."""
        return sum(s.nbytes() for s in self._storages() if s.device == self.device)

    def offload(self) -> int:
        """Copy every tracked storage to host memory (the gradient buffers excepted: module
        docstring) and free it on the device; the device bytes freed.

        RuntimeError if already offloaded (an onload was missed)."""
        if self._held:
            raise RuntimeError("TrainerOffload.offload() twice: the trainer is already offloaded")
        pin = self.device.type == "cuda"
        if pin:
            torch.cuda.synchronize(self.device)  # kernels still reading the buffers finish
        storages = [s for s in self._storages() if s.device == self.device and s.nbytes() > 0]
        scratch = self._gradient_storages()
        kept = [s for s in storages if s._cdata not in scratch]
        hosts = iter(self._arena_for(kept, pin=pin).views)
        freed = 0
        for storage in storages:
            nbytes = storage.nbytes()
            host = None if storage._cdata in scratch else next(hosts)
            if host is not None:
                host.copy_(_bytes_of(storage))
            storage.resize_(0)
            self._held.append((storage, host, nbytes))
            freed += nbytes
        self.copied_bytes = sum(h.numel() for _, h, _ in self._held if h is not None)
        if pin:
            torch.cuda.empty_cache()  # the freed blocks go back to the driver, for the servers
        logger.debug("trainer offloaded: %d bytes from %d storages", freed, len(self._held))
        return freed

    def onload(self) -> int:
        """Re-allocate every offloaded storage on the device and copy its bytes back (the
        gradient buffers come back zeroed); the device bytes restored. RuntimeError if nothing
        is offloaded."""
        if not self._held:
            raise RuntimeError("TrainerOffload.onload() without offload()")
        restored = 0
        for storage, host, nbytes in self._held:
            storage.resize_(nbytes)
            if host is None:  # a gradient buffer: zeroed, as before the next update anyway
                _bytes_of(storage).zero_()
            else:
                _bytes_of(storage).copy_(host)
            restored += nbytes
        self._held = []
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
        return restored

    def close(self) -> None:
        """Give the host arena back (unregistered on GPU). RuntimeError while offloaded: the
        arena then holds the only copy of the trainer's state."""
        if self._held:
            raise RuntimeError("TrainerOffload.close() while offloaded: onload() first")
        if self._arena is not None:
            self._arena.release()
        self._arena, self._arena_key = None, ()

    def _arena_for(self, storages: list[torch.UntypedStorage], *, pin: bool) -> HostArena:
        """The arena for these storages: the last one while they and their sizes are the same
        (a storage's ``_cdata`` is its allocation's identity), else a new one."""
        key = tuple((s._cdata, s.nbytes()) for s in storages)
        if self._arena is None or key != self._arena_key:
            if self._arena is not None:
                self._arena.release()
                self._arena = None  # the old buffer goes before the new one is made
            self._arena = HostArena([n for _, n in key], pin=pin)
            self._arena_key = key
            self.host_allocations += 1
        return self._arena

    # ------------------------------------------------------------------ tracked tensors
    def _storages(self) -> list[torch.UntypedStorage]:
        """The distinct storages behind every tracked tensor (views share one)."""
        seen: dict[int, torch.UntypedStorage] = {}
        for tensor in self._tensors():
            storage = tensor.untyped_storage()
            seen.setdefault(storage._cdata, storage)  # the StorageImpl: one per allocation
        for storage, _, _ in self._held:  # offloaded ones (nbytes 0) stay tracked
            seen.setdefault(storage._cdata, storage)
        return list(seen.values())

    def _gradient_storages(self) -> set[int]:
        """The ``_cdata`` of megatron DDP's gradient buffers' storages (freed, never copied)."""
        return {
            buffer.grad_data.untyped_storage()._cdata
            for buffer in _ddp_buffers(self.model)
            if isinstance(getattr(buffer, "grad_data", None), torch.Tensor)
        }

    def _tensors(self) -> Iterator[torch.Tensor]:
        model = self.model
        module = getattr(model, "module", model)  # DDP's ``buffers`` list shadows the method
        yield from module.parameters()
        yield from module.buffers()
        for param in module.parameters():
            for name in ("main_grad", "grad"):
                extra = getattr(param, name, None)
                if isinstance(extra, torch.Tensor):
                    yield extra
        for buffer in _ddp_buffers(model):
            for name in ("param_data", "grad_data"):
                data = getattr(buffer, name, None)
                if isinstance(data, torch.Tensor):
                    yield data
        for torch_optimizer in _torch_optimizers(self.optimizer):
            for group in torch_optimizer.param_groups:
                for param in group["params"]:
                    yield param
                    if param.is_leaf and param.grad is not None:  # views: their base's
                        yield param.grad
            for state in torch_optimizer.state.values():
                yield from (v for v in state.values() if isinstance(v, torch.Tensor))


def _bytes_of(storage: torch.UntypedStorage) -> torch.Tensor:
    """A uint8 tensor over all of ``storage``."""
    out = torch.empty(0, dtype=torch.uint8, device=storage.device)
    return out.set_(storage, 0, (storage.nbytes(),), (1,))


def _ddp_buffers(model) -> list:
    """megatron DDP's ``_ParamAndGradBuffer`` objects (dense and expert-parallel); none for a
    plain module. (DDP's ``buffers`` attribute shadows ``nn.Module.buffers``.)"""
    dense = model.__dict__.get("buffers", [])
    experts = model.__dict__.get("expert_parallel_buffers", [])
    return list(dense) + list(experts)


def _torch_optimizers(optimizer) -> list[torch.optim.Optimizer]:
    """The torch optimizers under a `PolicyOptimizer`, a megatron (chained) optimizer or a torch
    optimizer."""
    inner = getattr(optimizer, "inner", optimizer)
    chained = getattr(inner, "chained_optimizers", None)
    members = chained if chained is not None else [inner]
    out = []
    for member in members:
        torch_optimizer = member if isinstance(member, torch.optim.Optimizer) else None
        torch_optimizer = torch_optimizer or getattr(member, "optimizer", None)
        if torch_optimizer is not None:
            out.append(torch_optimizer)
    return out
