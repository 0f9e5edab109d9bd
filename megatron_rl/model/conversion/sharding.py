"""Which shard of the model this rank holds, and the process groups that split it."""

from __future__ import annotations

import dataclasses

import torch
from megatron.core import parallel_state

from megatron_rl.model.conversion.names import RankLayout


def model_layout_name(model: torch.nn.Module) -> str:
    """ "te" if the model uses Transformer Engine layer names (fused norms), "local_grouped" for
    the local spec with grouped experts (`TorchGroupedMLP`), else "local"."""
    from megatron_rl.model.grouped_experts import TorchGroupedMLP

    if any(k.endswith("layer_norm_weight") for k in model.state_dict()):
        return "te"
    grouped = any(isinstance(m, TorchGroupedMLP) for m in model.modules())
    return "local_grouped" if grouped else "local"


def model_rank_layout(model: torch.nn.Module) -> RankLayout:
    """This rank's `RankLayout`, from ``parallel_state`` and the model's pipeline stage."""
    layers = model.decoder.layers
    return RankLayout(
        tp_rank=parallel_state.get_tensor_model_parallel_rank(),
        tp_size=parallel_state.get_tensor_model_parallel_world_size(),
        ep_rank=parallel_state.get_expert_model_parallel_rank(),
        ep_size=parallel_state.get_expert_model_parallel_world_size(),
        etp_rank=parallel_state.get_expert_tensor_parallel_rank(),
        etp_size=parallel_state.get_expert_tensor_parallel_world_size(),
        layer_offset=layers[0].layer_number - 1 if len(layers) else 0,
        num_layers=len(layers),
        pre_process=model.pre_process,
        post_process=model.post_process,
    )


def shard_coords(group: str | None, rank: RankLayout) -> tuple[int, int]:
    """(rank, size) of ``rank`` within the group that splits a tensor ("tp", "etp" or None)."""
    if group == "tp":
        return rank.tp_rank, rank.tp_size
    if group == "etp":
        return rank.etp_rank, rank.etp_size
    return 0, 1


def process_group(group: str) -> torch.distributed.ProcessGroup:
    """The megatron process group named "tp", "etp" or "ep"."""
    getters = {
        "tp": parallel_state.get_tensor_model_parallel_group,
        "etp": parallel_state.get_expert_tensor_parallel_group,
        "ep": parallel_state.get_expert_model_parallel_group,
    }
    return getters[group]()


def all_gather(tensor: torch.Tensor, group: str, size: int) -> list[torch.Tensor]:
    """Every rank's ``tensor`` (same shape on all ranks) in group-rank order."""
    if size == 1:
        return [tensor]
    tensor = tensor.contiguous()
    out = [torch.empty_like(tensor) for _ in range(size)]
    torch.distributed.all_gather(out, tensor, group=process_group(group))
    return out


def with_expert(tmap, own: int, other: int):
    """``tmap`` renamed from global expert ``own`` to global expert ``other``."""
    return dataclasses.replace(
        tmap,
        canonical=tmap.canonical.replace(f".local_experts.{own}.", f".local_experts.{other}."),
        hf=tuple(n.replace(f".experts.{own}.", f".experts.{other}.") for n in tmap.hf),
    )
