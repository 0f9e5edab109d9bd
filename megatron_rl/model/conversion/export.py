"""Stream a (possibly sharded) megatron GPTModel out as HF or canonical (name, tensor) pairs.

`iter_hf_tensors` is what weight sync to rollout engines uses too: every rank of a TP/EP group
walks the same parameter list, gathers one parameter at a time over TP (and its experts over
EP), and yields full tensors; nothing larger than one gathered parameter is held.
With pipeline parallelism each stage yields its own layers; `iter_hf_tensors_every_stage` yields
every stage's, in stage order, on the ranks of a pipeline group that asked for them: each
tensor is broadcast from its stage over the pipeline group as soon as it is gathered (a header
with name, shape and dtype, then the tensor), so a receiving rank holds one tensor at a time.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Callable, Iterable, Iterator

import torch
import torch.distributed as dist
from megatron.core import parallel_state
from transformers import Qwen3MoeConfig

from megatron_rl.atomic_io import atomic_write_text
from megatron_rl.collectives import any_rank, broadcast_object, group_device
from megatron_rl.model.chunks import as_chunks
from megatron_rl.model.conversion.load import weight_entries
from megatron_rl.model.conversion.names import rank_tensor_maps
from megatron_rl.model.conversion.safetensors_io import write_checkpoint
from megatron_rl.model.conversion.sharding import (
    all_gather,
    model_layout_name,
    model_rank_layout,
    shard_coords,
    with_expert,
)
from megatron_rl.model.conversion.transforms import split, unshard
from megatron_rl.model.presets import hf_architecture, load_hf_config
from megatron_rl.moe_layers import num_routed_experts

logger = logging.getLogger(__name__)

MEGATRON_FORMAT = "megatron_rl-canonical-v1"


def _iter_full(
    model: torch.nn.Module, cfg: Qwen3MoeConfig, experts: bool | None = None
) -> Iterator[tuple]:
    """(TensorMap, full canonical tensor) for every tensor of this rank's pipeline stage (only
    the experts' with ``experts=True``, only the others' with False), chunk by chunk under
    interleaved pipeline parallelism."""
    for chunk in as_chunks(model):
        yield from _iter_full_chunk(chunk, cfg, experts)


def _iter_full_chunk(chunk: torch.nn.Module, cfg, experts: bool | None) -> Iterator[tuple]:
    rank = model_rank_layout(chunk)
    params = weight_entries(chunk)
    num_local_experts = num_routed_experts(cfg) // rank.ep_size
    for tmap in rank_tensor_maps(cfg, model_layout_name(chunk), rank):
        if experts is not None and (tmap.local_expert is not None) != experts:
            continue
        local = params[tmap.param].detach()
        _, group_size = shard_coords(tmap.group, rank)
        full = unshard(tmap, all_gather(local, tmap.group, group_size)) if group_size > 1 else local
        if tmap.local_expert is None:
            yield tmap, full
            continue
        own = rank.ep_rank * num_local_experts + tmap.local_expert
        for ep_rank, tensor in enumerate(all_gather(full, "ep", rank.ep_size)):
            yield with_expert(tmap, own, ep_rank * num_local_experts + tmap.local_expert), tensor


def iter_hf_tensors(
    model: torch.nn.Module,
    hf_config: Qwen3MoeConfig | str | os.PathLike,
    *,
    experts_last: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) for every tensor of this pipeline stage, on every rank.

    ``experts_last``: two passes, the non-expert tensors (gathered over TP) first, then the
    experts' (gathered over expert TP, then EP), so no bucket of a weight sync mixes the two.
    """
    cfg = load_hf_config(hf_config)
    for part in (False, True) if experts_last else (None,):
        for tmap, full in _iter_full(model, cfg, experts=part):
            yield from zip(tmap.hf, split(tmap, full, cfg), strict=True)


def iter_hf_tensors_every_stage(
    model: torch.nn.Module,
    hf_config: Qwen3MoeConfig | str | os.PathLike,
    *,
    wanted: bool,
    experts_last: bool = False,
) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, full tensor) of every pipeline stage, stage by stage (``experts_last``: each
    stage's as `iter_hf_tensors` with it).

    Collective over the pipeline group (every rank calls it, each with its own ``wanted``): a
    rank whose pipeline group has any ``wanted`` rank receives the other stages' tensors; in
    the other groups each rank yields only its own stage's (its TP/EP gathers still run).
    Without pipeline parallelism this is `iter_hf_tensors`.
    """
    if parallel_state.get_pipeline_model_parallel_world_size() == 1:
        yield from iter_hf_tensors(model, hf_config, experts_last=experts_last)
        return
    group = parallel_state.get_pipeline_model_parallel_group()
    stage_ranks = dist.get_process_group_ranks(group)
    own_stage = parallel_state.get_pipeline_model_parallel_rank()
    share = any_rank(wanted, group)
    for stage, src in enumerate(stage_ranks):
        if stage == own_stage:
            for name, tensor in iter_hf_tensors(model, hf_config, experts_last=experts_last):
                if share:
                    tensor = tensor.contiguous()
                    broadcast_object((name, tuple(tensor.shape), tensor.dtype), src, group)
                    dist.broadcast(tensor, src=src, group=group)
                yield name, tensor
            if share:
                broadcast_object(None, src, group)  # this stage is done
        elif share:
            while (header := broadcast_object(None, src, group)) is not None:
                name, shape, dtype = header
                tensor = torch.empty(shape, dtype=dtype, device=group_device(group))
                dist.broadcast(tensor, src=src, group=group)
                yield name, tensor


def iter_canonical_tensors(
    model: torch.nn.Module, hf_config: Qwen3MoeConfig | str | os.PathLike
) -> Iterator[tuple[str, torch.Tensor]]:
    """(canonical Megatron name, full tensor) for every tensor of this pipeline stage."""
    cfg = load_hf_config(hf_config)
    for tmap, full in _iter_full(model, cfg):
        yield tmap.canonical, full.contiguous()


def save_checkpoint(
    model: torch.nn.Module,
    hf_config: Qwen3MoeConfig | str | os.PathLike,
    folder: str | os.PathLike,
    *,
    fmt: str = "hf",
    max_shard_bytes: int = 2 * 1024**3,
    progress: Callable[[Iterable], Iterable] | None = None,
) -> None:
    """Write the model as an HF ("hf") or canonical Megatron ("megatron") checkpoint.

    Collective: every rank must call it; global rank 0 writes ``folder`` (safetensors shards and
    ``config.json``). The "megatron" format needs pipeline parallel size 1; "hf" gathers every
    pipeline stage (`iter_hf_tensors_every_stage`).
    """
    if fmt not in ("hf", "megatron"):
        raise ValueError(f"fmt={fmt!r}: choose 'hf' or 'megatron'")
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() != 1
    if fmt == "megatron" and pipelined:
        raise ValueError("fmt='megatron' needs pipeline parallel size 1; use fmt='hf'")
    cfg = load_hf_config(hf_config)
    is_writer = not dist.is_initialized() or dist.get_rank() == 0
    if fmt == "hf":
        tensors = iter_hf_tensors_every_stage(model, cfg, wanted=is_writer)
    else:
        tensors = iter_canonical_tensors(model, cfg)
    if is_writer:
        folder = os.fspath(folder)
        os.makedirs(folder, exist_ok=True)
        stream = progress(tensors) if progress else tensors
        meta = {"megatron_rl": MEGATRON_FORMAT} if fmt == "megatron" else {}
        write_checkpoint(stream, folder, max_shard_bytes=max_shard_bytes, metadata=meta)
        config = {**cfg.to_dict(), "architectures": [hf_architecture(cfg)]}
        atomic_write_text(os.path.join(folder, "config.json"), json.dumps(config, indent=2))
        logger.info("wrote %s checkpoint to %s", fmt, folder)
    else:
        for _ in tensors:
            pass
    if dist.is_initialized():
        dist.barrier()
