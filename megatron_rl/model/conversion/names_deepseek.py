"""Name and shape mapping of the DeepSeek-V3 decoder layers (HF `DeepseekV3ForCausalLM` <->
megatron-core MLA layers); the embedding, final norm, LM head and routed experts are mapped as
for Qwen3-MoE in `names`.

Per layer ``i`` (HF ``model.layers.{i}.`` -> megatron ``decoder.layers.{i}.``), all 1:1 ("plain"):

=====================================  ===========================================  ==========
HF                                     megatron (local spec; TE spec where it differs) TP split
=====================================  ===========================================  ==========
input_layernorm.weight                 input_layernorm.weight                         -
self_attn.q_a_proj.weight              self_attention.linear_q_down_proj.weight       0 (TE: -)
self_attn.q_a_layernorm.weight         self_attention.q_layernorm.weight              -
                                       (TE: linear_q_up_proj.layer_norm_weight)
self_attn.q_b_proj.weight              self_attention.linear_q_up_proj.weight         0 (heads)
self_attn.q_proj.weight (no q LoRA)    self_attention.linear_q_proj.weight            0 (heads)
self_attn.kv_a_proj_with_mqa.weight    self_attention.linear_kv_down_proj.weight      0 (TE: -)
self_attn.kv_a_layernorm.weight        self_attention.kv_layernorm.weight             -
                                       (TE: linear_kv_up_proj.layer_norm_weight)
self_attn.kv_b_proj.weight             self_attention.linear_kv_up_proj.weight        0 (heads)
self_attn.o_proj.weight                self_attention.linear_proj.weight              1
post_attention_layernorm.weight        pre_mlp_layernorm.weight (TE dense layer:      -
                                       mlp.linear_fc1.layer_norm_weight)
mlp.{gate,up,down}_proj (dense)        mlp.linear_fc1 (glu) / mlp.linear_fc2          0 / 1
mlp.gate.weight                        mlp.router.weight                              -
mlp.gate.e_score_correction_bias       mlp.router.expert_bias                         -
mlp.shared_experts.{gate,up,down}_proj mlp.shared_experts.linear_fc1 / linear_fc2     0 / 1
mlp.experts.{e}.*                      as Qwen3-MoE (`names.expert_maps`)
=====================================  ===========================================  ==========

The row layouts agree without permutation: q_b_proj's rows are per head [nope; rope], kv_b_proj's
per head [k_nope; v], kv_a_proj_with_mqa's [c_kv; k_rope], as megatron splits them; both apply
rope to the interleaved pairs of the rope part (HF ``rope_interleave=True``).

Multi-token-prediction layers (``model.layers.{L + j}.*`` for j < ``num_nextn_predict_layers``,
L = ``num_hidden_layers``) are not part of the model: `mtp_hf_names` picks them out so the loader
can skip them.
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from transformers import DeepseekV3Config

from megatron_rl.model.conversion.names import RankLayout, TensorMap, expert_maps, mlp_maps
from megatron_rl.moe_layers import moe_layer_pattern

_LAYER_INDEX = re.compile(r"^model\.layers\.(\d+)\.")


def _attention_maps(cfg: DeepseekV3Config, te: bool, i: int, li: int) -> list[TensorMap]:
    hp, cp = f"model.layers.{i}.self_attn.", f"decoder.layers.{i}.self_attention."
    m = f"decoder.layers.{li}.self_attention."
    down_dim, down_group = (None, None) if te else (0, "tp")  # TE: TELinear, duplicated
    rows = [  # (megatron leaf, te leaf, HF leaf, shard dim, group)
        ("linear_kv_down_proj.weight", None, "kv_a_proj_with_mqa", down_dim, down_group),
        (
            "kv_layernorm.weight",
            "linear_kv_up_proj.layer_norm_weight",
            "kv_a_layernorm",
            None,
            None,
        ),
        ("linear_kv_up_proj.weight", None, "kv_b_proj", 0, "tp"),
        ("linear_proj.weight", None, "o_proj", 1, "tp"),
    ]
    if cfg.q_lora_rank is None:
        rows.insert(0, ("linear_q_proj.weight", None, "q_proj", 0, "tp"))
    else:
        rows[:0] = [
            ("linear_q_down_proj.weight", None, "q_a_proj", down_dim, down_group),
            (
                "q_layernorm.weight",
                "linear_q_up_proj.layer_norm_weight",
                "q_a_layernorm",
                None,
                None,
            ),
            ("linear_q_up_proj.weight", None, "q_b_proj", 0, "tp"),
        ]
    return [
        TensorMap(
            param=m + (te_leaf if te and te_leaf else leaf),
            canonical=cp + leaf,
            hf=(hp + hf_leaf + ".weight",),
            shard_dim=dim,
            group=group,
        )
        for leaf, te_leaf, hf_leaf, dim, group in rows
    ]


def deepseek_layer_maps(
    cfg: DeepseekV3Config, layout: str, rank: RankLayout, i: int, li: int
) -> list[TensorMap]:
    """Maps of global layer ``i`` held as local layer ``li`` (layout "local", "local_grouped"
    or "te")."""
    hp, cp, m = f"model.layers.{i}.", f"decoder.layers.{i}.", f"decoder.layers.{li}."
    te = layout == "te"
    sparse = moe_layer_pattern(cfg)[i] == 1
    maps = [
        TensorMap(
            param=m + "input_layernorm.weight",
            canonical=cp + "input_layernorm.weight",
            hf=(hp + "input_layernorm.weight",),
        ),
        *_attention_maps(cfg, te, i, li),
        TensorMap(
            param=m
            + (
                "mlp.linear_fc1.layer_norm_weight"
                if te and not sparse
                else "pre_mlp_layernorm.weight"
            ),
            canonical=cp + "pre_mlp_layernorm.weight",
            hf=(hp + "post_attention_layernorm.weight",),
        ),
    ]
    if not sparse:
        return maps + mlp_maps(m + "mlp.", cp + "mlp.", hp + "mlp.", "tp")
    return maps + sigmoid_moe_maps(cfg, layout, rank, i, li)


def sigmoid_moe_maps(cfg, layout: str, rank: RankLayout, i: int, li: int) -> list[TensorMap]:
    """The MoE block of DeepSeek-V3 and GLM-4.5 (global layer ``i``, local ``li``): the sigmoid
    router with its score-correction bias, the routed experts, the ``n_shared_experts`` shared
    experts (one fused MLP)."""
    hp, cp, m = f"model.layers.{i}.", f"decoder.layers.{i}.", f"decoder.layers.{li}."
    maps = [
        TensorMap(param=m + f"mlp.router.{leaf}", canonical=cp + f"mlp.router.{leaf}", hf=(hf,))
        for leaf, hf in (
            ("weight", hp + "mlp.gate.weight"),
            ("expert_bias", hp + "mlp.gate.e_score_correction_bias"),
        )
    ]
    maps += expert_maps(cfg, layout, rank, i, li)
    if cfg.n_shared_experts:
        maps += mlp_maps(
            m + "mlp.shared_experts.", cp + "mlp.shared_experts.", hp + "mlp.shared_experts.", "tp"
        )
    return maps


def deepseek_hf_shape(name: str, cfg: DeepseekV3Config) -> tuple[int, ...]:
    """The shape of the HF tensor ``name`` of a DeepSeek-V3 decoder layer under ``cfg``."""
    h, n = cfg.hidden_size, cfg.num_attention_heads
    qk = cfg.qk_nope_head_dim + cfg.qk_rope_head_dim
    leaf = name.rsplit(".", 2)[-2] + "." + name.rsplit(".", 1)[-1]
    if ".mlp.experts." in name:
        ffn = cfg.moe_intermediate_size
    elif ".mlp.shared_experts." in name:
        ffn = cfg.moe_intermediate_size * cfg.n_shared_experts
    else:
        ffn = cfg.intermediate_size
    table = {
        "q_proj.weight": (n * qk, h),
        "q_a_proj.weight": (cfg.q_lora_rank, h),
        "q_a_layernorm.weight": (cfg.q_lora_rank,),
        "q_b_proj.weight": (n * qk, cfg.q_lora_rank),
        "kv_a_proj_with_mqa.weight": (cfg.kv_lora_rank + cfg.qk_rope_head_dim, h),
        "kv_a_layernorm.weight": (cfg.kv_lora_rank,),
        "kv_b_proj.weight": (n * (cfg.qk_nope_head_dim + cfg.v_head_dim), cfg.kv_lora_rank),
        "o_proj.weight": (h, n * cfg.v_head_dim),
        "gate_proj.weight": (ffn, h),
        "up_proj.weight": (ffn, h),
        "down_proj.weight": (h, ffn),
        "gate.weight": (cfg.n_routed_experts, h),
        "gate.e_score_correction_bias": (cfg.n_routed_experts,),
        "embed_tokens.weight": (cfg.vocab_size, h),
        "lm_head.weight": (cfg.vocab_size, h),
    }
    return table.get(leaf, (h,))  # the remaining tensors are the [H] norms


def mtp_hf_names(cfg: DeepseekV3Config, names: Iterable[str]) -> list[str]:
    """The names among ``names`` that belong to multi-token-prediction layers (layer index in
    [num_hidden_layers, num_hidden_layers + num_nextn_predict_layers))."""
    first = cfg.num_hidden_layers
    last = first + int(getattr(cfg, "num_nextn_predict_layers", 0) or 0)
    found = []
    for name in names:
        match = _LAYER_INDEX.match(name)
        if match and first <= int(match.group(1)) < last:
            found.append(name)
    return found
