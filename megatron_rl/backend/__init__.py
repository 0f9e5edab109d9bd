"""Everything megatron-core needs to run on this machine: device, process groups, optimizer."""

from megatron_rl.backend.cpu import (
    activate_cpu_backend,
    cpu_backend_active,
    cuda_available,
    select_device,
)
from megatron_rl.backend.distributed import ParallelConfig, destroy_distributed, init_distributed

__all__ = [
    "ParallelConfig",
    "activate_cpu_backend",
    "cpu_backend_active",
    "cuda_available",
    "destroy_distributed",
    "init_distributed",
    "select_device",
]
