"""Name and shape mapping between Qwen3-MoE HF tensors and megatron-core parameters (the
DeepSeek-V3 layers' names are in `names_deepseek`, GLM-4.5's in `names_glm4_moe`, the rest is
shared).

Three name spaces:
- HF: ``model.layers.{i}.mlp.experts.{e}.gate_proj.weight`` ... (what ``save_pretrained`` and the
  rollout engines use).
- canonical: the megatron *local-spec* name of the unsharded tensor with the global layer and
  expert index (``decoder.layers.{i}.mlp.experts.local_experts.{e}.linear_fc1.weight``). This is
  also the format of a megatron_rl Megatron checkpoint, so one checkpoint loads into either spec
  and any TP/EP layout.
- param: the name in one rank's ``model.state_dict()``, local or Transformer Engine spec, local
  layer and expert index. Layout "local_grouped" is the local spec with grouped experts
  (`megatron_rl.model.grouped_experts`): its stacked expert weights appear as per-expert views
  under Transformer Engine's per-expert names (``mlp.experts.linear_fc1.weight{j}``), see
  `megatron_rl.model.conversion.load.weight_entries`.

A `TensorMap` ties the three together for one rank-local parameter. ``kind`` says how HF tensors
fuse into the canonical one: "plain" (1:1), "qkv" (q, k, v interleaved per query group) or "glu"
(gate and up stacked); ``shard_dim`` is the dimension split over ``group`` ("tp", "etp" or None).
"""

from __future__ import annotations

import dataclasses

from transformers import Qwen3MoeConfig

from megatron_rl.model.config import shared_expert_size
from megatron_rl.model.presets import model_family
from megatron_rl.moe_layers import moe_layer_pattern, num_routed_experts

LAYOUTS = ("local", "local_grouped", "te")


@dataclasses.dataclass(frozen=True, slots=True)
class TensorMap:
    """How one rank-local megatron parameter relates to canonical and HF tensors."""

    param: str
    canonical: str
    hf: tuple[str, ...]
    kind: str = "plain"
    shard_dim: int | None = None
    group: str | None = None
    layer: int | None = None
    local_expert: int | None = None


@dataclasses.dataclass(frozen=True, slots=True)
class RankLayout:
    """Which shard of the model one rank holds (pipeline: layers [layer_offset, +num_layers))."""

    tp_rank: int = 0
    tp_size: int = 1
    ep_rank: int = 0
    ep_size: int = 1
    etp_rank: int = 0
    etp_size: int = 1
    layer_offset: int = 0
    num_layers: int | None = None
    pre_process: bool = True
    post_process: bool = True


def head_dim(hf_config: Qwen3MoeConfig) -> int:
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


def gqa_attention_maps(cfg, te: bool, i: int, li: int, qk_norm: bool = True) -> list[TensorMap]:
    """Maps of the input norm and grouped-query attention of global layer ``i`` (local ``li``):
    fused q/k/v (and their biases iff ``attention_bias``), the q/k norms iff ``qk_norm``."""
    hp, cp, m = f"model.layers.{i}.", f"decoder.layers.{i}.", f"decoder.layers.{li}."
    maps = [
        TensorMap(
            param=m
            + ("self_attention.linear_qkv.layer_norm_weight" if te else "input_layernorm.weight"),
            canonical=cp + "input_layernorm.weight",
            hf=(hp + "input_layernorm.weight",),
        ),
        TensorMap(
            param=m + "self_attention.linear_qkv.weight",
            canonical=cp + "self_attention.linear_qkv.weight",
            hf=tuple(hp + f"self_attn.{x}_proj.weight" for x in "qkv"),
            kind="qkv",
            shard_dim=0,
            group="tp",
        ),
        TensorMap(
            param=m + "self_attention.linear_proj.weight",
            canonical=cp + "self_attention.linear_proj.weight",
            hf=(hp + "self_attn.o_proj.weight",),
            shard_dim=1,
            group="tp",
        ),
    ]
    if qk_norm:
        maps[2:2] = [
            TensorMap(
                param=m + f"self_attention.{x}_layernorm.weight",
                canonical=cp + f"self_attention.{x}_layernorm.weight",
                hf=(hp + f"self_attn.{x}_norm.weight",),
            )
            for x in "qk"
        ]
    if getattr(cfg, "attention_bias", False):
        maps.append(
            TensorMap(
                param=m + "self_attention.linear_qkv.bias",
                canonical=cp + "self_attention.linear_qkv.bias",
                hf=tuple(hp + f"self_attn.{x}_proj.bias" for x in "qkv"),
                kind="qkv",
                shard_dim=0,
                group="tp",
            )
        )
    return maps


def pre_mlp_norm_map(te: bool, sparse: bool, i: int, li: int) -> TensorMap:
    """The norm before the MLP of global layer ``i`` (HF ``post_attention_layernorm``); the TE
    spec fuses a dense layer's into its ``linear_fc1``."""
    te_dense = te and not sparse
    return TensorMap(
        param=f"decoder.layers.{li}."
        + ("mlp.linear_fc1.layer_norm_weight" if te_dense else "pre_mlp_layernorm.weight"),
        canonical=f"decoder.layers.{i}.pre_mlp_layernorm.weight",
        hf=(f"model.layers.{i}.post_attention_layernorm.weight",),
    )


def _layer_maps(cfg: Qwen3MoeConfig, layout: str, rank: RankLayout, i: int, li: int) -> list:
    """Maps of global layer ``i`` held as local layer ``li``."""
    hp, cp, m = f"model.layers.{i}.", f"decoder.layers.{i}.", f"decoder.layers.{li}."
    sparse = moe_layer_pattern(cfg)[i] == 1
    maps = gqa_attention_maps(cfg, layout == "te", i, li)
    maps.append(pre_mlp_norm_map(layout == "te", sparse, i, li))
    if not sparse:
        maps += mlp_maps(m + "mlp.", cp + "mlp.", hp + "mlp.", "tp")
        return maps
    maps.append(
        TensorMap(
            param=m + "mlp.router.weight",
            canonical=cp + "mlp.router.weight",
            hf=(hp + "mlp.gate.weight",),
        )
    )
    maps += expert_maps(cfg, layout, rank, i, li)
    if shared_expert_size(cfg):
        maps += mlp_maps(
            m + "mlp.shared_experts.", cp + "mlp.shared_experts.", hp + "mlp.shared_expert.", "tp"
        )
        maps.append(
            TensorMap(
                param=m + "mlp.shared_experts.gate_weight",
                canonical=cp + "mlp.shared_experts.gate_weight",
                hf=(hp + "mlp.shared_expert_gate.weight",),
            )
        )
    return maps


def expert_maps(cfg, layout: str, rank: RankLayout, i: int, li: int) -> list[TensorMap]:
    """Maps of this rank's routed experts of global layer ``i`` (local layer ``li``)."""
    hp, cp, m = f"model.layers.{i}.", f"decoder.layers.{i}.", f"decoder.layers.{li}."
    per_expert_names = layout in ("te", "local_grouped")
    num_local = num_routed_experts(cfg) // rank.ep_size
    maps = []
    for j in range(num_local):
        e = rank.ep_rank * num_local + j
        for fc, hf_names, kind, dim in (
            ("linear_fc1", ("gate_proj", "up_proj"), "glu", 0),
            ("linear_fc2", ("down_proj",), "plain", 1),
        ):
            param = m + (
                f"mlp.experts.{fc}.weight{j}"
                if per_expert_names
                else f"mlp.experts.local_experts.{j}.{fc}.weight"
            )
            maps.append(
                TensorMap(
                    param=param,
                    canonical=cp + f"mlp.experts.local_experts.{e}.{fc}.weight",
                    hf=tuple(hp + f"mlp.experts.{e}.{x}.weight" for x in hf_names),
                    kind=kind,
                    shard_dim=dim,
                    group="etp",
                    layer=i,
                    local_expert=j,
                )
            )
    return maps


def mlp_maps(param_prefix: str, canonical_prefix: str, hf_prefix: str, group: str) -> list:
    return [
        TensorMap(
            param=param_prefix + "linear_fc1.weight",
            canonical=canonical_prefix + "linear_fc1.weight",
            hf=(hf_prefix + "gate_proj.weight", hf_prefix + "up_proj.weight"),
            kind="glu",
            shard_dim=0,
            group=group,
        ),
        TensorMap(
            param=param_prefix + "linear_fc2.weight",
            canonical=canonical_prefix + "linear_fc2.weight",
            hf=(hf_prefix + "down_proj.weight",),
            shard_dim=1,
            group=group,
        ),
    ]


def rank_tensor_maps(
    hf_config: Qwen3MoeConfig, layout: str = "local", rank: RankLayout | None = None
) -> list[TensorMap]:
    """The `TensorMap` of every parameter one rank holds, in a rank-independent order.

    Ranks of one TP/EP group get lists of equal length whose i-th entries are the same tensor
    (TP) or the same local expert slot (EP), so collectives can walk them in lockstep.
    """
    if layout not in LAYOUTS:
        raise ValueError(f"layout={layout!r}: choose one of {LAYOUTS}")
    rank = rank or RankLayout()
    num_layers = rank.num_layers if rank.num_layers is not None else hf_config.num_hidden_layers
    maps: list[TensorMap] = []
    if rank.pre_process:
        maps.append(
            TensorMap(
                param="embedding.word_embeddings.weight",
                canonical="embedding.word_embeddings.weight",
                hf=("model.embed_tokens.weight",),
                shard_dim=0,
                group="tp",
            )
        )
    layer_maps = _layer_maps
    family = model_family(hf_config)
    if family == "deepseek_v3":
        from megatron_rl.model.conversion.names_deepseek import deepseek_layer_maps as layer_maps
    elif family == "glm4_moe":
        from megatron_rl.model.conversion.names_glm4_moe import glm4_moe_layer_maps as layer_maps
    for li in range(num_layers):
        maps += layer_maps(hf_config, layout, rank, rank.layer_offset + li, li)
    if rank.post_process:
        maps.append(
            TensorMap(
                param="decoder.final_layernorm.weight",
                canonical="decoder.final_layernorm.weight",
                hf=("model.norm.weight",),
            )
        )
        if not hf_config.tie_word_embeddings:
            maps.append(
                TensorMap(
                    param="output_layer.weight",
                    canonical="output_layer.weight",
                    hf=("lm_head.weight",),
                    shard_dim=0,
                    group="tp",
                )
            )
    return maps


def expected_hf_shapes(hf_config: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the HF checkpoint of ``hf_config`` and its shape."""
    from megatron_rl.model.conversion.transforms import hf_shape

    return {name: hf_shape(name, hf_config) for t in rank_tensor_maps(hf_config) for name in t.hf}


def expected_canonical_shapes(hf_config: Qwen3MoeConfig) -> dict[str, tuple[int, ...]]:
    """Every tensor of the canonical (Megatron checkpoint) form and its shape."""
    from megatron_rl.model.conversion.transforms import canonical_shape

    return {t.canonical: canonical_shape(t, hf_config) for t in rank_tensor_maps(hf_config)}
