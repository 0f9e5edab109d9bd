"""A "virtual device" for CPU tests: which tensors would sit on the model's device on a GPU.

On a CPU-only machine the model's device and the host are the same device, so a tensor that was
never moved to the model (or handed to an NCCL collective from the host) runs fine. `DeviceGuard`
tells the two apart by *provenance* and raises `WrongDeviceError` where a GPU would have raised
"Expected all tensors to be on the same device".

A tensor is **on the device** (tracked, per storage, so views, ``.data`` and ``detach()`` agree)
when it is, or shares storage with:

* a seed: a parameter, buffer or ``main_grad`` of the model, or a tensor held by the optimizer,
  passed to `DeviceGuard.place`;
* the result of ``Tensor.to(device)`` / ``Tensor.cuda()`` / ``Tensor.to(t)`` with ``device`` the
  model's device (or ``t`` on the device). As on a GPU, a move of a host tensor hands back a new
  tensor (a copy, where the CPU would return the same one) and the source stays host, so code
  that moves a tensor and keeps using the original still fails;
* the result of a factory (``torch.zeros``, ``torch.arange``, ``torch.tensor``...) that names the
  model's device (``device=x.device``, ``device=torch.cuda.current_device()`` in megatron, ...);
* the output of any op that has an on-device tensor among its inputs.

Everything else is **host**: tensors that existed before the guard and were not seeded (rollout
samples), factories that name no device (``torch.zeros(n)``, ``torch.tensor([...])``: the CPU on
a GPU machine too), ``Tensor.cpu()`` (the guard hands back a host copy, as a GPU would), and ops
over host tensors only.

Rules, checked on every aten op (forward, backward and the optimizer step; ``TorchDispatchMode``):

1. An op may not mix an on-device tensor with a host tensor of one or more dimensions. Host 0-d
   tensors are allowed (CUDA accepts CPU scalars); so are host *index* tensors of
   ``index``/``index_put_`` (CUDA accepts CPU indices) and either side of a copy (``copy_`` is how
   data moves between devices).
2. Every tensor entering a collective (``c10d`` ops) must be on the device, 0-d included: the
   trainer's groups are NCCL groups on a GPU, and NCCL takes CUDA tensors only.

What it cannot see (it is not a GPU): a tensor moved or created with an *explicit* ``"cpu"``
device counts as on the device (the model's device is the CPU here, so ``.to("cpu")`` and
``.to(self.device)`` are the same call); factories called from inside autograd's backward or
inside a torch function implemented in Python are not seen by the function mode and default to
on-device; and only the code that runs is checked (one configuration, TP = EP = 1, gloo).
"""

from __future__ import annotations

import traceback
from collections import Counter

import torch
from torch import Tensor
from torch.multiprocessing.reductions import StorageWeakRef
from torch.overrides import TorchFunctionMode
from torch.utils._device import _device_constructors
from torch.utils._python_dispatch import TorchDispatchMode
from torch.utils._pytree import tree_leaves

aten = torch.ops.aten

# the output is the destination or an alias of the input: no device rule, nothing to propagate
# (``_to_copy``, a new tensor, follows the general rule; the function mode handles its device)
_COPIES = {
    aten.copy_.default,
    aten._copy_from.default,
    aten._copy_from_and_resize.default,
    aten.detach.default,
    aten.alias.default,
}
# ops whose ``indices`` argument (position 1) may hold host tensors under CUDA
_INDEXING = {
    aten.index.Tensor,
    aten.index_put.default,
    aten.index_put_.default,
    aten._index_put_impl_.default,
}
# the fresh tensor `torch.tensor(data)` builds below the dispatcher: a factory
_FRESH = {aten.lift_fresh.default, aten.lift_fresh_copy.default}
_COLLECTIVE_NAMESPACES = {"c10d", "_c10d_functional", "c10d_functional"}
_NEW_METHODS = {
    torch.Tensor.new_empty,
    torch.Tensor.new_empty_strided,
    torch.Tensor.new_full,
    torch.Tensor.new_ones,
    torch.Tensor.new_tensor,
    torch.Tensor.new_zeros,
}


class WrongDeviceError(RuntimeError):
    """A tensor reached an op (model, loss, collective) on the wrong (virtual) device."""


def _tensors(tree) -> list[torch.Tensor]:
    return [t for t in tree_leaves(tree) if isinstance(t, torch.Tensor)]


def _describe(t: torch.Tensor) -> str:
    return f"{str(t.dtype).removeprefix('torch.')}{list(t.shape)}"


def _where() -> str:
    """The innermost frames of megatron_rl and megatron code that led to the op."""
    frames = [
        f
        for f in traceback.extract_stack()[:-3]
        if "megatron" in f.filename and "tests/" not in f.filename
    ]
    return "\n".join(f"  {f.filename}:{f.lineno} in {f.name}: {f.line}" for f in frames[-4:])


class DeviceGuard:
    """Context manager: raises `WrongDeviceError` where a GPU would see mixed devices.

    ``device`` is the model's device (the trainer's ``self.device``; a CPU device in tests). Seed
    the tensors that live on it with `place` before entering.
    """

    def __init__(self, device: torch.device | str) -> None:
        self.device = torch.device(device)
        if self.device.type != "cpu":
            raise ValueError("DeviceGuard emulates a model device on a CPU-only test run")
        self._on_device: dict[int, StorageWeakRef] = {}
        self.violations: list[str] = []
        self.ops_checked: Counter[str] = Counter()  # aten/c10d op name -> calls checked
        self._modes = (_PropagateAndCheck(self), _Placement(self))

    # ------------------------------------------------------------------ bookkeeping
    def place(self, *objects) -> DeviceGuard:
        """Mark tensors as on the device: tensors, modules (parameters, buffers, ``main_grad``),
        and containers/objects of tensors (optimizer state), recursively."""
        seen: set[int] = set()
        for obj in objects:
            self._place(obj, seen)
        return self

    def _place(self, obj, seen: set[int]) -> None:
        if id(obj) in seen or obj is None or isinstance(obj, (str, bytes, int, float, bool)):
            return
        seen.add(id(obj))
        if isinstance(obj, torch.Tensor):
            self.mark(obj)
            for extra in (getattr(obj, "main_grad", None), obj.grad if obj.is_leaf else None):
                if isinstance(extra, torch.Tensor):
                    self.mark(extra)
            return
        if isinstance(obj, torch.nn.Module):
            for tensor in [*torch.nn.Module.parameters(obj), *torch.nn.Module.buffers(obj)]:
                self._place(tensor, seen)
        if isinstance(obj, dict):
            children = [*obj.keys(), *obj.values()]
        elif isinstance(obj, (list, tuple, set)):
            children = list(obj)
        elif hasattr(obj, "__dict__") and type(obj).__module__.split(".")[0] in (
            "megatron",
            "megatron_rl",
            "torch",
        ):
            children = list(vars(obj).values())
        else:
            return
        for child in children:
            self._place(child, seen)

    def mark(self, tensor: torch.Tensor) -> None:
        storage = _storage(tensor)
        if storage is not None and storage._cdata not in self._on_device:
            self._on_device[storage._cdata] = StorageWeakRef(storage)
            if len(self._on_device) % 4096 == 0:
                self._prune()

    def unmark(self, tensor: torch.Tensor) -> None:
        storage = _storage(tensor)
        if storage is not None:
            self._on_device.pop(storage._cdata, None)

    def on_device(self, tensor: torch.Tensor) -> bool:
        storage = _storage(tensor)
        # a live storage's address is unique: the weak references keep dead ones from reuse
        return storage is not None and storage._cdata in self._on_device

    def _prune(self) -> None:
        for key in [k for k, ref in self._on_device.items() if ref.expired()]:
            del self._on_device[key]

    def names_device(self, device) -> bool:
        return device is not None and torch.device(device).type == self.device.type

    def fail(self, message: str) -> None:
        self.violations.append(message)
        raise WrongDeviceError(message)

    # ------------------------------------------------------------------ context
    def __enter__(self) -> DeviceGuard:
        for mode in self._modes:
            mode.__enter__()
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        for mode in reversed(self._modes):
            mode.__exit__(exc_type, exc, tb)
        if exc_type is None and self.violations:  # raised inside code that swallowed it
            raise WrongDeviceError(self.violations[0])


def _storage(tensor: torch.Tensor):
    try:
        return tensor.untyped_storage()
    except (RuntimeError, NotImplementedError):  # sparse, nested: no single storage
        return None


class _PropagateAndCheck(TorchDispatchMode):
    """Every aten op: check the rules, then mark the outputs of on-device inputs."""

    def __init__(self, guard: DeviceGuard) -> None:
        super().__init__()
        self.guard = guard

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        guard = self.guard
        guard.ops_checked[str(func)] += 1
        inputs = _tensors((args, kwargs))
        if func in _COPIES:
            return func(*args, **kwargs)
        on_device = [t for t in inputs if guard.on_device(t)]
        if func.namespace in _COLLECTIVE_NAMESPACES:
            host = [t for t in inputs if not guard.on_device(t)]
            if host:
                guard.fail(
                    f"collective {func} got host tensor(s) {[_describe(t) for t in host]}; "
                    f"NCCL takes tensors on the model's device only\n{_where()}"
                )
            return func(*args, **kwargs)
        if on_device:
            indices = _tensors(args[1]) if func in _INDEXING and len(args) > 1 else []
            host = [
                t
                for t in inputs
                if t.dim() > 0 and not guard.on_device(t) and not any(t is i for i in indices)
            ]
            if host:
                guard.fail(
                    f"{func} mixes tensor(s) on the model's device "
                    f"{[_describe(t) for t in on_device]} with host tensor(s) "
                    f"{[_describe(t) for t in host]}\n{_where()}"
                )
        out = func(*args, **kwargs)
        if on_device:
            for tensor in _tensors(out):
                guard.mark(tensor)
        elif not inputs or func in _FRESH:
            # a factory the function mode did not see defaults to the device; a 0-d one is a
            # wrapped Python scalar (``x[i] = True``), which goes wherever it is used
            for tensor in _tensors(out):
                if tensor.dim() > 0:
                    guard.mark(tensor)
        return out


class _Placement(TorchFunctionMode):
    """Python-level calls that say where a tensor goes: moves, ``.cpu()`` and factories."""

    def __init__(self, guard: DeviceGuard) -> None:
        super().__init__()
        self.guard = guard
        self.constructors = _device_constructors()

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        guard = self.guard
        if func is torch.Tensor.type:
            # the CPU backend patches ``Tensor.type`` around optimizer steps, and torch hands a
            # mode the *patched* function: running it here too would rename twice
            return torch._C.TensorBase.type(*args, **kwargs)
        if func is torch.Tensor.cpu:  # a GPU hands back a host copy
            out = func(*args, **kwargs)
            if guard.on_device(out):
                out = out.clone()
                guard.unmark(out)
            return out
        out = func(*args, **kwargs)
        if func in (torch.Tensor.to, torch.Tensor.cuda):
            if func is torch.Tensor.cuda:
                moved = True
            elif isinstance(target := args[1] if len(args) > 1 else kwargs.get("other"), Tensor):
                moved = guard.on_device(target)
            else:
                moved = guard.names_device(torch._C._nn._parse_to(*args[1:], **kwargs)[0])
            if moved and not guard.on_device(out):
                # a GPU makes a new tensor on the device and leaves the host one where it was
                # (the CPU hands back the same tensor): code that keeps using the host tensor
                # after the move must still fail
                out = out.clone() if out is args[0] else out
                guard.mark(out)
        elif func in self.constructors or func in _NEW_METHODS:
            if func in _NEW_METHODS and "device" not in kwargs:
                return out  # a new tensor on its source's device: the dispatch mode decides
            if _tensors((args[1:] if func in _NEW_METHODS else args, kwargs)):
                return out  # e.g. as_tensor(tensor) may alias its input: leave it as it is
            for tensor in _tensors(out):
                if guard.names_device(kwargs.get("device")):
                    guard.mark(tensor)
                else:
                    guard.unmark(tensor)  # no device named: the host's default
        return out
