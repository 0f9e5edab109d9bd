"""``--colocate``: trainer ranks and SGLang servers on the same GPUs, one phase resident at a time.

The order of slime's colocated loop (servers: SGLang's memory tags, see
`megatron_rl.rollout.memory_occupation`; trainer: `TrainerOffload`), per RL step::

    before_rollout   trainer offload -> barrier -> servers resume [kv_cache, cuda_graph] -> barrier
    (rollout)        servers generate; the trainer holds no device memory
    before_train     barrier -> servers release all -> barrier -> trainer onload
    (train)          old log-probs and the N updates
    before_sync      servers resume [weights]
    (weight sync)    tensor transport, inside a weight-update session (`WeightSync`)

Between steps (checkpoint save, logging) the trainer is resident and the servers hold only
their weights; `release_generation_memory` (before the trainer builds its model) releases the
servers' KV cache and CUDA graphs to reach that state. Only the rank that drives the servers
(``engine`` given: global rank 0) calls them; every rank offloads and onloads its own shard,
and the barriers keep a rank from onloading before the servers released, or the servers from
resuming before every rank offloaded.

The end of the run (`Colocation.close`) leaves the servers as the last step left them: weights
resident, KV cache and CUDA graphs released; nothing is resumed. Resuming them would put the
KV cache and CUDA graphs back on GPUs that still hold every rank's weights, gradients and
optimizer state (torch_memory_saver ends the server when that allocation fails), and doing it
safely would take an offload on every rank and a barrier in ``close``, which also runs on the
error paths, where a barrier can hang a failed rank instead of letting torchrun end the job.
The launcher owns the servers: it starts them with the job and stops them when training ends
(``examples/qwen3_moe/nodes.sh``), so colocated servers serve one run. A server kept past its
run stays released: a next run's `release_generation_memory` would pause paused memory
(torch_memory_saver exits), so restart the servers with the trainer.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

import torch
import torch.distributed as dist

from megatron_rl import stop_signal
from megatron_rl.collectives import max_over_ranks
from megatron_rl.rollout.memory_occupation import CUDA_GRAPH, KV_CACHE, MEMORY_TAGS, WEIGHTS
from megatron_rl.train.offload import TrainerOffload
from megatron_rl.train.process_memory import process_device_bytes

logger = logging.getLogger(__name__)

GENERATION_TAGS = (KV_CACHE, CUDA_GRAPH)  # resumed for a rollout, after the weights are in


class ColocateMemoryError(RuntimeError):
    """The servers' KV cache and CUDA graphs would not fit beside what the trainer left."""


class Colocation:
    """The memory hand-over of one trainer rank; ``engine``: the SGLang client on the rank that
    drives the servers (``release_memory`` / ``resume_memory``), None on the others."""

    def __init__(
        self,
        offload: TrainerOffload,
        engine=None,
        *,
        group=None,
        generation_bytes: int | None = None,
        free_bytes: Callable[[], int | None] | None = None,
    ) -> None:
        """``generation_bytes``: what the servers' KV cache and CUDA graphs take on this rank's
        GPU (`release_generation_memory` measured it; None: unknown, nothing is checked);
        ``free_bytes``: the device's free bytes now (default `free_device_bytes`)."""
        self.offload = offload
        self.engine = engine
        self.group = group  # the barrier's process group (None: every rank)
        self.generation_bytes = generation_bytes
        self.free_bytes = free_bytes or (lambda: free_device_bytes(offload.device))
        self._metrics: dict[str, float] = {}
        # the servers' released tags, as this side left them (`release_generation_memory`
        # released the generation tags before the model was built)
        self.released: set[str] = set(GENERATION_TAGS)

    def before_rollout(self) -> None:
        """Trainer offload, then the servers' KV cache and CUDA graphs back."""
        t = time.perf_counter()
        freed = self.offload.offload()
        self._metrics["colocate/offload_s"] = time.perf_counter() - t
        self._metrics["colocate/offloaded_bytes"] = float(freed)
        self._metrics["colocate/copied_bytes"] = float(self.offload.copied_bytes)
        self._metrics["colocate/host_arena_bytes"] = float(self.offload.host_bytes)
        self._metrics["colocate/host_allocations"] = float(self.offload.host_allocations)
        self._metrics.update(device_memory_metrics(self.offload.device))
        self._barrier()
        self._check_room()  # every rank, before any server resumes
        if self.engine is not None:
            self.engine.resume_memory(list(GENERATION_TAGS))
        self.released -= set(GENERATION_TAGS)
        self._barrier()  # every rank generates its own share: none before the resume

    def before_train(self) -> None:
        """Once every rank's rollout is over (each rank generates its own share on the
        servers, and SGLang releases only an idle server), the servers release everything,
        then the trainer onloads. The trainer's bytes still on the device (they were, the whole
        rollout) are recorded first."""
        resident = self.offload.resident_bytes()
        self._metrics["colocate/trainer_resident_bytes_during_rollout"] = float(resident)
        self._barrier()
        if self.engine is not None:
            self.engine.release_memory(None)  # no tags: kv_cache, weights and cuda_graph
        self.released = set(MEMORY_TAGS)
        self._barrier()
        t = time.perf_counter()
        self.offload.onload()
        self._metrics["colocate/onload_s"] = time.perf_counter() - t

    def before_sync(self) -> None:
        """The servers take their weights back (SGLang loads into them)."""
        if self.engine is not None:
            self.engine.resume_memory([WEIGHTS])
        self.released.discard(WEIGHTS)

    def close(self) -> None:
        """The run is over: no memory moves, the servers keep ``released`` released (see the
        module docstring for why nothing is resumed) and the trainer's state stays where it is
        (resident after a finished step; on host after an error mid-rollout, when onloading
        next to the servers' KV cache could fail). No server call and no collective, so this
        is safe on an error path."""
        if not self.offload.offloaded:
            self.offload.close()  # the host arena goes; after an error mid-rollout it holds
            # the trainer's only copy and stays
        if self.engine is not None and self.released:
            logger.info(
                "colocated run over: the servers keep %s released (their launcher stops them)",
                sorted(self.released),
            )

    def metrics(self) -> dict[str, float]:
        """``colocate/offload_s``, ``colocate/onload_s``, ``colocate/offloaded_bytes`` (device
        bytes freed), ``colocate/copied_bytes`` (of them, copied to host: not the gradient
        buffers, `TrainerOffload`),
        ``colocate/host_arena_bytes`` (the host copy's one buffer), ``colocate/host_allocations``
        (arenas made so far: 1 while the trainer's storages keep their sizes),
        ``colocate/trainer_resident_bytes_during_rollout`` (tracked tensors still on the
        device: 0 by construction) and, on CUDA, what the device itself reports once the
        trainer is offloaded: ``colocate/device_free_bytes`` (``mem_get_info``: what the servers
        can take), ``colocate/device_reserved_bytes`` (torch's caching allocator, after
        ``empty_cache``) and ``colocate/device_untracked_bytes`` (used by this process or others
        but not by torch's allocator: CUDA context, NCCL buffers, the servers), and
        ``colocate/process_device_bytes``: this process's own bytes by NVML's per-process
        account (`megatron_rl.train.process_memory`: the trainer's residue without the
        servers'; NaN where NVML cannot say, with one log line why)."""
        return dict(self._metrics)

    def _check_room(self) -> None:
        """`ColocateMemoryError` on every rank when any rank's GPU has less free memory than
        the servers' KV cache and CUDA graphs took there at start-up: resuming them would make
        torch_memory_saver end the server (a dead server, not an error). A collective."""
        free = self.free_bytes()
        if self.generation_bytes is None or free is None:
            return
        shortfall = float(self.generation_bytes - free)
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            (shortfall,) = max_over_ranks([shortfall], group=self.group)
        if shortfall > 0:
            raise ColocateMemoryError(
                f"--colocate: a GPU has {shortfall / 2**30:.2f} GiB less free memory after the "
                "trainer's offload than the servers' KV cache and CUDA graphs took at start-up "
                f"({self.generation_bytes / 2**30:.2f} GiB here, {free / 2**30:.2f} GiB free): "
                "resuming them would end the server. The trainer left memory behind "
                "(colocate/device_untracked_bytes); lower the servers' --mem-fraction-static (the "
                "launchers' MEM_FRACTION) or the trainer's footprint"
            )

    def _barrier(self) -> None:
        if dist.is_initialized() and dist.get_world_size(self.group) > 1:
            with stop_signal.hard_wait("waiting for every rank at a --colocate hand-over"):
                dist.barrier(group=self.group)


def release_generation_memory(engine=None, group=None, device=None) -> int | None:
    """Before the trainer builds its model: the servers (started with everything resident)
    release what generation alone needs, their KV cache and CUDA graphs, so the trainer's
    model and optimizer never share the GPUs with them (slime releases its engines before it
    builds its actors). ``engine``: the SGLang client on the rank that drives the servers, None
    on the others; collective over ``group``. Returns the bytes that freed on this rank's GPU
    ``device`` (what a resume will need there again; None off CUDA)."""
    before = free_device_bytes(device) if device is not None else None
    if engine is not None:
        engine.release_memory(list(GENERATION_TAGS))
    if dist.is_initialized():
        dist.barrier(group=group)
    after = free_device_bytes(device) if device is not None else None
    return None if before is None or after is None else max(0, after - before)


def free_device_bytes(device: torch.device) -> int | None:
    """The device's free bytes (``cudaMemGetInfo``, every process counted); None off CUDA."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return int(torch.cuda.mem_get_info(device)[0])


def device_memory_metrics(device: torch.device) -> dict[str, float]:
    """The device's own account after an offload (see `Colocation.metrics`); none off CUDA."""
    if device.type != "cuda":
        return {}
    free, total = torch.cuda.mem_get_info(device)
    reserved = torch.cuda.memory_reserved(device)
    own = process_device_bytes(device)  # None: NVML cannot say (logged once); NaN, every rank
    return {
        "colocate/device_free_bytes": float(free),
        "colocate/device_reserved_bytes": float(reserved),
        "colocate/device_untracked_bytes": float(total - free - reserved),
        "colocate/process_device_bytes": float("nan") if own is None else float(own),
    }
