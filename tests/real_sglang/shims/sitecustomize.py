"""Test-only start-up patches for SGLang 0.5.23 on a CPU-only torch (no CUDA driver, no CUDA
libraries). Python imports this module at start-up when its folder is on ``PYTHONPATH`` (the
server's and the router's only, never a test process's). It imports nothing heavy: each patch
runs when its target module is first imported. Line numbers are those of the installed packages.

1. ``torch.cuda.cudart()``: with ``--enable-return-routed-experts`` SGLang allocates the routed
   experts' host buffer in ``sglang/srt/state_capturer/base.py`` (``BaseHostCache.__init__``,
   lines 63-73: ``pin_memory=True``) through ``ALLOC_MEMORY_FUNCS["cpu"]`` =
   ``alloc_with_host_register`` in ``sglang/srt/mem_cache/pool_host/common.py`` (line 330),
   whose ``_cuda_host_register`` (line 143) calls ``torch.cuda.cudart().cudaHostRegister``
   (line 178); ``_cuda_host_unregister_ranges`` (line 202) calls ``cudaHostUnregister`` (line
   207). A CPU build of torch raises "Torch not compiled with CUDA enabled" there. Pinning only
   speeds up device copies, which a CPU server never makes: both calls become no-ops returning
   0 (cudaSuccess); every other cudart attribute still raises.
2. ``torchvision``: ``sglang/srt/configs/__init__.py`` line 71 imports ``sglang/srt/configs/
   nano_nemotron_vl.py`` -> ``sglang/srt/multimodal/internvl_utils.py`` (lines 5, 7), and
   transformers' ``image_utils`` imports it too, unconditionally at start-up. PyPI has only
   CUDA builds of torchvision, whose compiled ops (``torchvision/_C.so``) need
   ``libtorch_cuda.so``; torchvision then runs in pure Python (``extension._has_ops()`` is False
   and each compiled op raises when called), except that ``torchvision/_meta_registrations.py``
   (lines 163, 177) registers fake kernels for ``torchvision::nms`` and ``::qnms`` without that
   guard. Their schemas are declared here first (no kernels), so the import works.
3. ``pin_memory``: SGLang's LoRA code allocates page-locked host buffers unconditionally
   (``sglang/srt/lora/layers.py`` lines 145, 324, 479, 594, 723, 814: ``pin_memory=True`` or
   ``.pin_memory()``; ``lora/lora.py`` 533-539; ``lora/backend/torch_backend.py`` 225-241), and
   a CPU-only torch has no pinned allocator ("pin_memory=True requires a CUDA or other
   accelerator backend"): a server started with ``--enable-lora`` dies at start-up. Pinning only
   speeds host-to-device copies, which a CPU server never makes: when the first of those
   modules (or ``lora_manager``, ``mem_pool``) is imported, torch's factories drop
   ``pin_memory`` and ``Tensor.pin_memory`` returns an unpinned copy (a copy, as pinning
   makes one: returning the tensor itself would keep a sender's shared-memory tensors alive in
   the server, and with them the sender's ``torch_shm_manager``).
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import sys


class _HostRegisterNoOps:
    """``torch.cuda.cudart()`` with register/unregister as no-ops (0 = cudaSuccess)."""

    def __init__(self, real_cudart) -> None:
        self._real_cudart = real_cudart

    @staticmethod
    def cudaHostRegister(ptr, size, flags) -> int:
        return 0

    @staticmethod
    def cudaHostUnregister(ptr) -> int:
        return 0

    @staticmethod
    def cudaGetErrorString(code) -> str:
        return "cudaSuccess" if int(code) == 0 else f"cudaError {int(code)}"

    def __getattr__(self, name):
        return getattr(self._real_cudart(), name)


def _after_torch_cuda(module) -> None:
    stub = _HostRegisterNoOps(module.cudart)
    module.cudart = lambda: stub


_TORCHVISION_SCHEMAS = []  # the Library objects must stay alive


def _before_torchvision_meta_registrations(module) -> None:
    import torch
    import torchvision.extension

    if torchvision.extension._has_ops():  # a working torchvision: nothing to stand in for
        return
    library = torch.library.Library("torchvision", "DEF")  # schemas only, no kernels
    for op in ("nms", "qnms"):
        library.define(f"{op}(Tensor dets, Tensor scores, float iou_threshold) -> Tensor")
    _TORCHVISION_SCHEMAS.append(library)


_PINNED_FACTORIES = (
    "tensor", "empty", "zeros", "ones", "full", "arange", "empty_strided", "empty_like",
    "zeros_like", "ones_like", "full_like",
)  # fmt: skip


def _before_sglang_lora(module) -> None:
    import functools

    import torch

    if torch.cuda.is_available() or getattr(torch.Tensor.pin_memory, "_unpinned", False):
        return  # a real pinned allocator, or patched already

    def unpinned(factory):
        @functools.wraps(factory)
        def call(*args, **kwargs):
            kwargs.pop("pin_memory", None)
            return factory(*args, **kwargs)

        return call

    for name in _PINNED_FACTORIES:
        setattr(torch, name, unpinned(getattr(torch, name)))

    def pin_memory(self, *args, **kwargs):  # a copy, as pinning makes one
        return self.clone()

    pin_memory._unpinned = True
    torch.Tensor.pin_memory = pin_memory


_PATCHES = {  # module -> (run before its code, run after its code)
    "torch.cuda": (None, _after_torch_cuda),
    **{  # sglang/srt/lora is a namespace package: its first module imported
        f"sglang.srt.lora.{name}": (_before_sglang_lora, None)
        for name in ("layers", "lora", "lora_manager", "mem_pool", "backend.torch_backend")
    },
    "torchvision._meta_registrations": (_before_torchvision_meta_registrations, None),
}


class _PatchOnImport(importlib.abc.MetaPathFinder):
    def find_spec(self, fullname, path, target=None):
        if fullname not in _PATCHES:
            return None
        before, after = _PATCHES.pop(fullname)
        spec = importlib.machinery.PathFinder.find_spec(fullname, path)
        if spec is None or spec.loader is None:
            return spec
        exec_module = spec.loader.exec_module

        def exec_and_patch(module):
            if before is not None:
                before(module)
            exec_module(module)
            if after is not None:
                after(module)

        spec.loader.exec_module = exec_and_patch
        return spec


sys.meta_path.insert(0, _PatchOnImport())
