"""Small collectives every layer needs, allocated on the process group's own device.

NCCL groups only take CUDA tensors and gloo groups only CPU tensors, so each function builds its
tensor on `group_device` (the current CUDA device for NCCL, the CPU otherwise). Every function is
also correct without torch.distributed initialised (a single process is its own world), so the
same code runs in unit tests, on a laptop and on a cluster. Importable without megatron-core.

All of them are collectives: every rank of ``group`` (default: the world) must call them at the
same point, with the same arguments' shapes (same metric keys for `mean_over_ranks`).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch
import torch.distributed as dist


def is_distributed() -> bool:
    """Whether torch.distributed has a default process group."""
    return dist.is_available() and dist.is_initialized()


def rank_and_world_size(group: dist.ProcessGroup | None = None) -> tuple[int, int]:
    """``(rank, world size)`` in ``group``; ``(0, 1)`` without torch.distributed."""
    if not is_distributed():
        return 0, 1
    return dist.get_rank(group), dist.get_world_size(group)


def group_device(group: dist.ProcessGroup | None = None) -> torch.device:
    """The device a tensor must live on to enter a collective of ``group``."""
    if is_distributed() and dist.get_backend(group) == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")


def sum_over_ranks(values: Sequence[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Element-wise float64 sum of ``values`` over the ranks of ``group``."""
    if not is_distributed() or dist.get_world_size(group) == 1:
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=group_device(group))
    dist.all_reduce(tensor, group=group)
    return tensor.tolist()


def max_over_ranks(values: Sequence[float], group: dist.ProcessGroup | None = None) -> list[float]:
    """Element-wise float64 maximum of ``values`` over the ranks of ``group``."""
    if not is_distributed() or dist.get_world_size(group) == 1:
        return [float(v) for v in values]
    tensor = torch.tensor(list(values), dtype=torch.float64, device=group_device(group))
    dist.all_reduce(tensor, op=dist.ReduceOp.MAX, group=group)
    return tensor.tolist()


def broadcast_object(obj, src: int, group: dist.ProcessGroup | None = None):
    """``obj`` of global rank ``src`` on every rank of ``group`` (a picklable object)."""
    if not is_distributed() or dist.get_world_size(group) == 1:
        return obj
    payload = [obj]
    dist.broadcast_object_list(payload, src=src, group=group)
    return payload[0]


def any_rank(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when ``flag`` is true on at least one rank of ``group``."""
    return _reduce_flag(flag, dist.ReduceOp.MAX, group) if is_distributed() else bool(flag)


def all_ranks_agree(flag: bool, group: dist.ProcessGroup | None = None) -> bool:
    """True on every rank when ``flag`` is true on all ranks of ``group``."""
    return _reduce_flag(flag, dist.ReduceOp.MIN, group) if is_distributed() else bool(flag)


def _reduce_flag(flag: bool, op, group) -> bool:
    if dist.get_world_size(group) == 1:  # a reduction over one rank is the flag itself
        return bool(flag)
    value = torch.tensor([int(bool(flag))], dtype=torch.int32, device=group_device(group))
    dist.all_reduce(value, op=op, group=group)
    return bool(value.item())


def mean_over_ranks(
    metrics: Mapping[str, float], group: dist.ProcessGroup | None = None
) -> dict[str, float]:
    """Every metric averaged over the ranks of ``group``; a non-finite mean becomes NaN.

    The ranks must hold the same keys (checked: a missing key would silently pair the wrong
    numbers, so the key sets are compared first).
    """
    keys = sorted(metrics)
    _, world = rank_and_world_size(group)
    if world > 1:
        gathered = all_gather_objects(keys, group)
        if any(other != keys for other in gathered):
            every, common = set().union(*gathered), set(keys).intersection(*gathered)
            raise RuntimeError(f"ranks report different metric keys: {sorted(every - common)}")
    totals = sum_over_ranks([float(metrics[k]) for k in keys], group)
    means = (v / world if math.isfinite(v) else float("nan") for v in totals)
    return dict(zip(keys, means, strict=True))


def all_gather_objects(obj, group: dist.ProcessGroup | None = None) -> list:
    """``[obj of rank 0, obj of rank 1, ...]`` of ``group`` (picklable objects)."""
    _, world = rank_and_world_size(group)
    if world == 1:
        return [obj]
    gathered: list = [None] * world
    dist.all_gather_object(gathered, obj, group=group)
    return gathered


def barrier(group: dist.ProcessGroup | None = None) -> None:
    """Wait for every rank of ``group`` (a no-op without torch.distributed)."""
    if is_distributed():
        dist.barrier(group=group)
