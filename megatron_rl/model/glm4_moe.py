"""HF `Glm4MoeConfig` -> the architecture fields of megatron-core's `TransformerConfig`.

The GLM-4.5 layer (transformers' ``Glm4MoeForCausalLM``; arXiv:2508.06471):
- grouped-query attention: ``num_attention_heads`` query heads over ``num_key_value_heads``
  key/value heads of ``head_dim``, q/k/v biases iff ``attention_bias`` (no o_proj bias),
  per-head RMSNorm of q and k before rope iff ``use_qk_norm``, softmax scale 1 / sqrt(head_dim);
- partial rotary: rope on the first r = int(head_dim * ``partial_rotary_factor``) dims of each
  head in the rotate-half layout (pairs (j, j + r/2), inverse frequencies theta^(-2j/r)), the
  other head_dim - r dims pass unrotated. megatron's ``rotary_percent`` (a `GPTModel` argument,
  `rotary_percent`) computes the same: rot_dim = int(kv_channels * rotary_percent), the first
  rot_dim dims, ``_rotate_half`` without interleaving;
- the first ``first_k_dense_replace`` layers dense (FFN ``intermediate_size``), the others MoE
  with DeepSeek-V3's router: s = sigmoid(W_g x) over ``n_routed_experts``, top-k on s + b
  (``e_score_correction_bias``, megatron's ``expert_bias``) within the ``topk_group`` best of
  ``n_group`` groups (a group's score: the sum of its two best s + b), gate weights the chosen s
  normalised to sum 1 (``norm_topk_prob``), times ``routed_scaling_factor``;
- ``n_shared_experts`` ungated shared SwiGLU experts (one fused expert of n *
  ``moe_intermediate_size``) added to the routed output.

Multi-token-prediction layers (``num_nextn_predict_layers``) are not built; their weights are
skipped on load as for DeepSeek-V3.
"""

from __future__ import annotations

from typing import Any

from transformers import Glm4MoeConfig

from megatron_rl.model.deepseek_v3 import check_sigmoid_router, sigmoid_router_fields


def head_dim(hf_config: Glm4MoeConfig) -> int:
    """Per-head size: ``head_dim`` when the config has one, hidden / heads otherwise (as HF)."""
    return getattr(hf_config, "head_dim", None) or (
        hf_config.hidden_size // hf_config.num_attention_heads
    )


def rotary_percent(hf_config: Glm4MoeConfig) -> float:
    """The rotated fraction of each head (``partial_rotary_factor``; HF's default 0.5)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    factor = params.get("partial_rotary_factor", getattr(hf_config, "partial_rotary_factor", 0.5))
    return float(factor)


def check_glm4_moe(hf_config: Glm4MoeConfig) -> None:
    """ValueError naming the field for what megatron-core cannot compute as HF does."""
    cfg = hf_config
    factor, dim = rotary_percent(cfg), head_dim(cfg)
    rot_dim = int(dim * factor)
    if not 0.0 < factor <= 1.0 or rot_dim % 2:
        raise ValueError(
            f"partial_rotary_factor={factor}: needs 0 < factor <= 1 and an even number of rotated "
            f"dims (head_dim={dim} gives {rot_dim})"
        )
    check_sigmoid_router(cfg)


def glm4_moe_fields(hf_config: Glm4MoeConfig) -> dict[str, Any]:
    """The `TransformerConfig` keyword arguments that state the GLM-4.5 architecture (the rotary
    fraction is a `GPTModel` argument instead: `rotary_percent`)."""
    check_glm4_moe(hf_config)
    cfg = hf_config
    return dict(
        num_query_groups=cfg.num_key_value_heads,
        kv_channels=head_dim(cfg),
        qk_layernorm=bool(cfg.use_qk_norm),
        add_qkv_bias=bool(cfg.attention_bias),
        **sigmoid_router_fields(cfg),
    )
