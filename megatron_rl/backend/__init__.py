"""Everything megatron-core needs to run on this machine: device, process groups, optimizer.

Names are imported on first use, so that the light modules (``optimizer_config``) load without
megatron-core.
"""

from __future__ import annotations

from megatron_rl.lazy_exports import lazy_getattr

_HOMES = {
    "ParallelConfig": "megatron_rl.parallel",
    "activate_cpu_backend": "megatron_rl.backend.cpu",
    "cpu_backend_active": "megatron_rl.backend.cpu",
    "cuda_available": "megatron_rl.backend.cpu",
    "select_device": "megatron_rl.backend.cpu",
    "destroy_distributed": "megatron_rl.backend.distributed",
    "init_distributed": "megatron_rl.backend.distributed",
}

__all__ = sorted(_HOMES)


__getattr__ = lazy_getattr("megatron_rl.backend", _HOMES, globals())
