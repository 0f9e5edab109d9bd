"""This process's own device memory, by the driver's account (NVML), not the device's.

``cudaMemGetInfo`` counts every process on the GPU: next to co-located SGLang servers it cannot
tell the trainer's residue (its CUDA context, NCCL buffers, torch's cache, anything the offload
missed) from the servers' memory. NVML lists each process's bytes on a device
(``nvmlDeviceGetComputeRunningProcesses``); `process_device_bytes` sums the entries of this
process's PID. It answers None, never a guess: off CUDA, without the ``pynvml`` module
(``nvidia-ml-py``), when NVML cannot start, when the driver withholds per-process bytes (some
MIG and vGPU set-ups), or when NVML does not list this PID (a container's own PID namespace
hides it from the host's driver).
"""

from __future__ import annotations

import logging
import os
from collections.abc import Iterable

import torch

logger = logging.getLogger(__name__)
_WARNED: set[str] = set()


def bytes_of_pid(processes: Iterable, pid: int) -> int | None:
    """Sum of ``usedGpuMemory`` over NVML's process entries with ``pid``; None when none has
    it, or when one of them withholds its bytes (``usedGpuMemory`` None)."""
    used = [p.usedGpuMemory for p in processes if p.pid == pid]
    if not used or any(u is None for u in used):
        return None
    return int(sum(used))


def process_device_bytes(device: torch.device, pid: int | None = None) -> int | None:
    """Bytes process ``pid`` (default: this one) holds on CUDA ``device``; None when that
    cannot be known (module docstring), with one log line per reason."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    try:
        import pynvml
    except ImportError:
        _warn_once("no pynvml module (pip install nvidia-ml-py)")
        return None
    try:
        pynvml.nvmlInit()
        # NVML numbers the physical GPUs; CUDA_VISIBLE_DEVICES may renumber them for torch
        index = torch.cuda._get_nvml_device_index(device)
        handle = pynvml.nvmlDeviceGetHandleByIndex(index)
        processes = pynvml.nvmlDeviceGetComputeRunningProcesses(handle)
    except (pynvml.NVMLError, RuntimeError) as err:  # RuntimeError: a device torch cannot map
        _warn_once(f"NVML: {err}")
        return None
    found = bytes_of_pid(processes, os.getpid() if pid is None else pid)
    if found is None:
        _warn_once("NVML lists no bytes for this process (PID namespace, MIG or vGPU)")
    return found


def _warn_once(reason: str) -> None:
    if reason not in _WARNED:
        _WARNED.add(reason)
        logger.info("this process's device memory is not reported: %s", reason)
