"""The weight-update process group between a trainer rank and rollout servers.

What SGLang's ``init_weights_update_group`` builds on the server side: a process group of its
own (not the default group, so the trainer's Megatron groups stay untouched), rendezvous through
a ``TCPStore`` hosted by the trainer (rank 0) at ``master_address:master_port``. gloo on CPU,
NCCL on GPU. Rank 0 broadcasts every tensor of a bucket in order; servers receive into fresh
tensors of the announced names, dtypes and shapes.
"""

from __future__ import annotations

import datetime
from collections.abc import Sequence

import torch
import torch.distributed as dist

BACKENDS = ("gloo", "nccl")


def join_weight_group(
    *,
    backend: str,
    master_address: str,
    master_port: int,
    rank: int,
    world_size: int,
    timeout_s: float = 120.0,
) -> dist.ProcessGroup:
    """Create this side's process group (blocks until all ``world_size`` ranks joined)."""
    if backend not in BACKENDS:
        raise ValueError(f"backend={backend!r}: choose one of {BACKENDS}")
    if not 0 <= rank < world_size:
        raise ValueError(f"rank={rank} is outside [0, world_size={world_size})")
    timeout = datetime.timedelta(seconds=timeout_s)
    store = dist.TCPStore(
        master_address, master_port, world_size, is_master=rank == 0, timeout=timeout
    )
    store = dist.PrefixStore("megatron_rl_weights", store)
    if backend == "gloo":
        return dist.ProcessGroupGloo(store, rank, world_size, timeout)
    return dist.ProcessGroupNCCL(store, rank, world_size)  # pragma: no cover - needs CUDA


def broadcast_tensor(group: dist.ProcessGroup, tensor: torch.Tensor) -> None:
    """Broadcast ``tensor`` from rank 0 of ``group`` in place."""
    options = dist.BroadcastOptions()
    options.rootRank = 0
    group.broadcast([tensor], options).wait()


def dtype_name(dtype: torch.dtype) -> str:
    """SGLang's dtype strings: ``torch.bfloat16`` -> ``"bfloat16"``."""
    return str(dtype).removeprefix("torch.")


def receive_bucket(
    group: dist.ProcessGroup,
    names: Sequence[str],
    dtypes: Sequence[str],
    shapes: Sequence[Sequence[int]],
    device: str = "cpu",
) -> list[tuple[str, torch.Tensor]]:
    """Receiver side of one bucket: one broadcast per tensor, in the announced order."""
    if not len(names) == len(dtypes) == len(shapes):
        raise ValueError(
            f"bucket announces {len(names)} names, {len(dtypes)} dtypes, {len(shapes)} shapes"
        )
    out = []
    for name, dtype, shape in zip(names, dtypes, shapes, strict=True):
        tensor = torch.empty(tuple(shape), dtype=getattr(torch, dtype), device=device)
        broadcast_tensor(group, tensor)
        out.append((name, tensor))
    return out
