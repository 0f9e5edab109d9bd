"""Name and shape mapping of the GLM-4.5 decoder layers (HF `Glm4MoeForCausalLM` <-> megatron-core
GQA layers with DeepSeek-V3's MoE block); embedding, final norm, LM head and routed experts are
mapped as for Qwen3-MoE in `names`.

Per layer ``i`` (HF ``model.layers.{i}.`` -> megatron ``decoder.layers.{i}.``):

=====================================  ===========================================  ==========
HF                                     megatron (local spec; TE spec where it differs) TP split
=====================================  ===========================================  ==========
input_layernorm.weight                 input_layernorm.weight                         -
                                       (TE: self_attention.linear_qkv.layer_norm_weight)
self_attn.{q,k,v}_proj.weight          self_attention.linear_qkv.weight ("qkv")       0
self_attn.{q,k,v}_proj.bias            self_attention.linear_qkv.bias ("qkv"), iff    0
                                       attention_bias
self_attn.{q,k}_norm.weight            self_attention.{q,k}_layernorm.weight, iff     -
                                       use_qk_norm
self_attn.o_proj.weight                self_attention.linear_proj.weight              1
post_attention_layernorm.weight        pre_mlp_layernorm.weight (TE dense layer:      -
                                       mlp.linear_fc1.layer_norm_weight)
mlp.{gate,up,down}_proj (dense)        mlp.linear_fc1 (glu) / mlp.linear_fc2          0 / 1
mlp.gate.weight                        mlp.router.weight                              -
mlp.gate.e_score_correction_bias       mlp.router.expert_bias                         -
mlp.shared_experts.{gate,up,down}_proj mlp.shared_experts.linear_fc1 / linear_fc2     0 / 1
mlp.experts.{e}.*                      as Qwen3-MoE (`names.expert_maps`)
=====================================  ===========================================  ==========

"qkv" interleaves q, k and v per query group as for Qwen3-MoE (`transforms.fuse`); the rows of
a head keep HF's order, so the partial rotary's first rotated dims are the same dims on both sides.
Multi-token-prediction layers (``model.layers.{L + j}.*``) are skipped on load as for
DeepSeek-V3 (`names_deepseek.mtp_hf_names`).
"""

from __future__ import annotations

from transformers import Glm4MoeConfig

from megatron_rl.model.conversion.names import (
    RankLayout,
    TensorMap,
    gqa_attention_maps,
    mlp_maps,
    pre_mlp_norm_map,
)
from megatron_rl.model.conversion.names_deepseek import sigmoid_moe_maps
from megatron_rl.model.conversion.transforms import gqa_hf_shapes, hf_leaf
from megatron_rl.model.glm4_moe import head_dim
from megatron_rl.moe_layers import moe_layer_pattern


def glm4_moe_layer_maps(
    cfg: Glm4MoeConfig, layout: str, rank: RankLayout, i: int, li: int
) -> list[TensorMap]:
    """Maps of global layer ``i`` held as local layer ``li`` (layout "local", "local_grouped"
    or "te")."""
    te, sparse = layout == "te", moe_layer_pattern(cfg)[i] == 1
    maps = gqa_attention_maps(cfg, te, i, li, qk_norm=bool(cfg.use_qk_norm))
    maps.append(pre_mlp_norm_map(te, sparse, i, li))
    if not sparse:
        hp, cp, m = (
            f"model.layers.{i}.mlp.",
            f"decoder.layers.{i}.mlp.",
            f"decoder.layers.{li}.mlp.",
        )
        return maps + mlp_maps(m, cp, hp, "tp")
    return maps + sigmoid_moe_maps(cfg, layout, rank, i, li)


def glm4_moe_hf_shape(name: str, cfg: Glm4MoeConfig) -> tuple[int, ...]:
    """The shape of the HF tensor ``name`` of a GLM-4.5 model under ``cfg``."""
    if ".mlp.experts." in name:
        ffn = cfg.moe_intermediate_size
    elif ".mlp.shared_experts." in name:
        ffn = cfg.moe_intermediate_size * cfg.n_shared_experts
    else:
        ffn = cfg.intermediate_size
    table = gqa_hf_shapes(cfg, head_dim(cfg), ffn)
    table["gate.weight"] = (cfg.n_routed_experts, cfg.hidden_size)
    table["gate.e_score_correction_bias"] = (cfg.n_routed_experts,)
    return table.get(hf_leaf(name), (cfg.hidden_size,))  # the remaining tensors are the [H] norms
