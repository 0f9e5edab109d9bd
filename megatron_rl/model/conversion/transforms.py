"""Tensor transforms between HF tensors, canonical megatron tensors and per-rank shards.

Formulas (nq query heads, ng query groups, d head dim, H hidden, I FFN size):
- qkv: canonical [ng * (nq/ng + 2) * d, H] = per group g: [q heads of g; k_g; v_g] stacked.
- glu: canonical [2I, H] = [gate; up]; a TP shard of it is [gate_r; up_r] (each split alone).
- plain: identity. A shard along ``shard_dim`` is the r-th of ``size`` equal chunks.
"""

from __future__ import annotations

import torch
from transformers import Qwen3MoeConfig

from megatron_rl.model.conversion.names import TensorMap, head_dim
from megatron_rl.model.presets import model_family


def hf_shape(name: str, cfg: Qwen3MoeConfig) -> tuple[int, ...]:
    """The shape of the HF tensor ``name`` under ``cfg``."""
    family = model_family(cfg)
    if family == "deepseek_v3":
        from megatron_rl.model.conversion.names_deepseek import deepseek_hf_shape

        return deepseek_hf_shape(name, cfg)
    if family == "glm4_moe":
        from megatron_rl.model.conversion.names_glm4_moe import glm4_moe_hf_shape

        return glm4_moe_hf_shape(name, cfg)
    if ".mlp.experts." in name:
        ffn = cfg.moe_intermediate_size
    elif ".shared_expert." in name:
        ffn = int(cfg.shared_expert_intermediate_size)
    else:
        ffn = cfg.intermediate_size
    table = gqa_hf_shapes(cfg, head_dim(cfg), ffn)
    table["gate.weight"] = (cfg.num_experts, cfg.hidden_size)
    table["shared_expert_gate.weight"] = (1, cfg.hidden_size)
    return table.get(hf_leaf(name), (cfg.hidden_size,))  # the remaining tensors are the [H] norms


def hf_leaf(name: str) -> str:
    """The last two parts of an HF tensor name (``q_proj.weight``): what its shape depends on."""
    return name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]


def gqa_hf_shapes(cfg, d: int, ffn: int) -> dict[str, tuple[int, ...]]:
    """Shapes by `hf_leaf` of a GQA transformer's HF tensors (embeddings, q/k/v/o with biases and
    q/k norms of head dim ``d``, a gated MLP of width ``ffn``); the families add their routers."""
    h = cfg.hidden_size
    q, kv = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    return {
        "embed_tokens.weight": (cfg.vocab_size, h),
        "lm_head.weight": (cfg.vocab_size, h),
        "q_proj.weight": (q, h),
        "k_proj.weight": (kv, h),
        "v_proj.weight": (kv, h),
        "q_proj.bias": (q,),
        "k_proj.bias": (kv,),
        "v_proj.bias": (kv,),
        "o_proj.weight": (h, q),
        "q_norm.weight": (d,),
        "k_norm.weight": (d,),
        "gate_proj.weight": (ffn, h),
        "up_proj.weight": (ffn, h),
        "down_proj.weight": (h, ffn),
    }


def canonical_shape(tmap: TensorMap, cfg: Qwen3MoeConfig) -> tuple[int, ...]:
    """Shape of the unsharded canonical tensor of ``tmap``."""
    shapes = [hf_shape(name, cfg) for name in tmap.hf]
    if tmap.kind == "plain":
        return shapes[0]
    return (sum(s[0] for s in shapes), *shapes[0][1:])


def fuse(tmap: TensorMap, hf_tensors: list[torch.Tensor], cfg: Qwen3MoeConfig) -> torch.Tensor:
    """HF tensor(s) of ``tmap`` -> the canonical tensor."""
    if tmap.kind == "plain":
        return hf_tensors[0]
    if tmap.kind == "glu":
        return torch.cat(hf_tensors, dim=0)
    q, k, v = hf_tensors
    ng = cfg.num_key_value_heads
    rest = q.shape[1:]
    return torch.cat([t.reshape(ng, -1, *rest) for t in (q, k, v)], dim=1).reshape(-1, *rest)


def split(tmap: TensorMap, tensor: torch.Tensor, cfg: Qwen3MoeConfig) -> list[torch.Tensor]:
    """Canonical tensor of ``tmap`` -> its HF tensor(s), contiguous, in ``tmap.hf`` order."""
    if tmap.kind == "plain":
        return [tensor.contiguous()]
    if tmap.kind == "glu":
        return [t.contiguous() for t in torch.chunk(tensor, 2, dim=0)]
    ng, d = cfg.num_key_value_heads, head_dim(cfg)
    q_per_group = cfg.num_attention_heads // ng
    rest = tensor.shape[1:]
    grouped = tensor.reshape(ng, (q_per_group + 2) * d, *rest)
    q, k, v = torch.split(grouped, [q_per_group * d, d, d], dim=1)
    return [t.reshape(-1, *rest).contiguous() for t in (q, k, v)]


def shard(tmap: TensorMap, tensor: torch.Tensor, rank: int, size: int) -> torch.Tensor:
    """The ``rank``-th of ``size`` shards of a canonical tensor, as megatron lays it out."""
    if tmap.shard_dim is None or size == 1:
        return tensor
    if tensor.shape[tmap.shard_dim] % size:
        raise ValueError(
            f"{tmap.canonical}: dim {tmap.shard_dim} of {tuple(tensor.shape)} "
            f"is not divisible by {size} ranks"
        )
    if tmap.kind == "glu":
        gate, up = torch.chunk(tensor, 2, dim=0)
        return torch.cat([gate.chunk(size, 0)[rank], up.chunk(size, 0)[rank]], dim=0)
    return tensor.chunk(size, dim=tmap.shard_dim)[rank]


def unshard(tmap: TensorMap, shards: list[torch.Tensor]) -> torch.Tensor:
    """Inverse of `shard`: the canonical tensor from all ranks' shards (rank order)."""
    if tmap.shard_dim is None or len(shards) == 1:
        return shards[0]
    if tmap.kind == "glu":
        halves = [torch.chunk(s, 2, dim=0) for s in shards]
        return torch.cat([h[0] for h in halves] + [h[1] for h in halves], dim=0)
    return torch.cat(shards, dim=tmap.shard_dim)
