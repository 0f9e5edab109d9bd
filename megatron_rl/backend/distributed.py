"""torch.distributed + megatron-core ``parallel_state`` set-up and teardown.

gloo on CPU, nccl on GPU. The parallel sizes come from a `ParallelConfig`; megatron-core's
``parallel_state`` builds every group, the model builder only reads them.
"""

from __future__ import annotations

import logging
import os

import torch
import torch.distributed as dist
from megatron.core import parallel_state, tensor_parallel

from megatron_rl import stop_signal
from megatron_rl.backend.cpu import select_device
from megatron_rl.parallel import ParallelConfig

logger = logging.getLogger(__name__)

_GROUPS_MEGATRON_LEAVES_SET = (
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP",
    "_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP_GLOO",
)


def init_distributed(
    parallel: ParallelConfig,
    *,
    rank: int | None = None,
    world_size: int | None = None,
    init_method: str | None = None,
    device: str = "auto",
) -> torch.device:
    """Initialise the default process group, megatron's parallel groups and its RNG tracker.

    Args:
        parallel: model-parallel sizes.
        rank, world_size: default to the RANK/WORLD_SIZE environment (torchrun), else 0/1.
        init_method: e.g. ``file:///tmp/rdzv`` or ``tcp://host:port``; defaults to ``env://``
            when MASTER_ADDR is set (torchrun), else (single process) a store this process
            binds on a local port the OS picks (``tcp://127.0.0.1:0``: no port is picked free
            and bound later, which another process could take in between).
        device: "auto", "cpu" or "cuda" (see `select_device`).

    Returns:
        The device this rank computes on.
    """
    rank = int(os.environ.get("RANK", 0)) if rank is None else rank
    world_size = int(os.environ.get("WORLD_SIZE", 1)) if world_size is None else world_size
    parallel.check_world_size(world_size)
    compute_device = select_device(device)
    # a rank whose peers are late waits here in C: a stop signal ends it (stop_signal.hard_wait)
    with stop_signal.hard_wait(f"waiting for the rendezvous of {world_size} ranks (rank {rank})"):
        if not dist.is_initialized():
            if init_method is None:
                init_method = "env://" if "MASTER_ADDR" in os.environ else "tcp://127.0.0.1:0"
            backend = "nccl" if compute_device.type == "cuda" else "gloo"
            if world_size > 1:
                logger.info("rank %d: joining %d ranks (%s)", rank, world_size, init_method)
            dist.init_process_group(
                backend=backend, init_method=init_method, rank=rank, world_size=world_size
            )
        parallel_state.initialize_model_parallel(
            tensor_model_parallel_size=parallel.tensor_parallel,
            pipeline_model_parallel_size=parallel.pipeline_parallel,
            context_parallel_size=parallel.context_parallel,
            expert_model_parallel_size=parallel.expert_parallel,
            expert_tensor_parallel_size=parallel.expert_tensor_parallel,
        )
    # The CPU generator too: megatron initialises some weights on the CPU (the MoE routers) and
    # its model-parallel seeding only reaches the CUDA generators on a GPU; without this two
    # fresh processes of one run would build different routers (megatron-LM's _set_random_seed
    # seeds torch's default generator the same way). On CPU the next call reseeds it likewise.
    torch.manual_seed(parallel.seed)
    tensor_parallel.model_parallel_cuda_manual_seed(parallel.seed)
    logger.info("rank %d/%d initialised on %s with %s", rank, world_size, compute_device, parallel)
    return compute_device


def destroy_distributed() -> None:
    """Tear down megatron's parallel groups and the default process group (idempotent).

    The models wrapped for training are released too (`release_wrapped_models`), so that they
    and the groups they hold are freed. Two more holders in megatron 0.16 are emptied: its
    ``destroy_model_parallel`` leaves ``_INTRA_PARTIAL_DATA_PARALLEL_GROUP_WITH_CP[_GLOO]`` set,
    and ``RotaryEmbedding.forward``'s class-wide ``lru_cache`` keeps its last 32 callers (each
    holding its context-parallel group).
    """
    from megatron.core.models.common.embeddings.rotary_pos_embedding import RotaryEmbedding

    from megatron_rl.backend.optimizer import release_wrapped_models

    release_wrapped_models()
    RotaryEmbedding.forward.cache_clear()
    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()
    for name in _GROUPS_MEGATRON_LEAVES_SET:
        setattr(parallel_state, name, None)
    if dist.is_initialized():
        dist.destroy_process_group()
