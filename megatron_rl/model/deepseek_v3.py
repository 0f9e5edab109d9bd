"""HF `DeepseekV3Config` -> the architecture fields of megatron-core's `MLATransformerConfig`.

The DeepSeek-V3 layer (arXiv:2412.19437, sections 2.1 and 2.1.2):
- multi-latent attention: q = W_qb RMSNorm(W_qa x) (or W_q x without ``q_lora_rank``),
  [c_kv; k_rope] = W_kva x, [k_nope; v] = W_kvb RMSNorm(c_kv); per head q and k are
  [nope (``qk_nope_head_dim``); rope (``qk_rope_head_dim``)], rope on the interleaved pairs of
  the rope part, softmax scale 1 / sqrt(nope + rope);
- the first ``first_k_dense_replace`` layers dense (FFN ``intermediate_size``), the others MoE:
  s = sigmoid(W_g x) over ``n_routed_experts``; the top-k is chosen on s + b (b the
  ``e_score_correction_bias``, megatron's ``expert_bias``) within the ``topk_group`` best of
  ``n_group`` groups (a group's score: the sum of its two best s + b); the gate weights are the
  chosen s (without b), normalised to sum 1, times ``routed_scaling_factor``;
- ``n_shared_experts`` shared SwiGLU experts of ``moe_intermediate_size`` each (one fused expert
  of n * ``moe_intermediate_size``), ungated, added to the routed output.

Multi-token-prediction layers (``num_nextn_predict_layers``) are not built: their weights are
skipped on load (`megatron_rl.model.conversion.names_deepseek.mtp_hf_names`).
"""

from __future__ import annotations

from typing import Any

from transformers import DeepseekV3Config

# HF's group score sums the best two experts of a group; megatron's the best topk / group_topk
HF_GROUP_SCORE_TOPN = 2
# HF builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps, not rms_norm_eps
_HF_LATENT_NORM_EPS = 1e-6


def check_deepseek_v3(hf_config: DeepseekV3Config) -> None:
    """ValueError naming the field for what megatron-core cannot compute as HF does."""
    cfg = hf_config
    params = getattr(cfg, "rope_parameters", None) or {}
    if params.get("rope_type", "default") != "default":
        raise ValueError(
            f"rope_parameters['rope_type']={params['rope_type']!r} is not supported for "
            "deepseek_v3 yet (YaRN is not mapped); use 'default'"
        )
    if not getattr(cfg, "rope_interleave", True):
        raise ValueError(
            "rope_interleave=False is not supported: megatron's MLA rope is interleaved"
        )
    if cfg.rms_norm_eps != _HF_LATENT_NORM_EPS:
        raise ValueError(
            f"rms_norm_eps={cfg.rms_norm_eps} is not supported: HF's q_a_layernorm and "
            f"kv_a_layernorm always use eps {_HF_LATENT_NORM_EPS}, megatron's MLA norms use "
            f"rms_norm_eps; set rms_norm_eps={_HF_LATENT_NORM_EPS} (DeepSeek-V3's value)"
        )
    if getattr(cfg, "attention_bias", False):
        raise ValueError("attention_bias=True is not supported: megatron's MLA has no q/kv biases")
    check_sigmoid_router(cfg)


def check_sigmoid_router(cfg) -> None:
    """ValueError naming the field for what megatron's sigmoid router (DeepSeek-V3's, shared by
    GLM-4.5) cannot compute as HF does: unnormalised top-k weights, groups HF scores otherwise."""
    if not cfg.norm_topk_prob and cfg.num_experts_per_tok > 1:
        raise ValueError(
            "norm_topk_prob=False is not supported: megatron's sigmoid router always normalises "
            "the top-k weights; set norm_topk_prob=True"
        )
    groups = int(cfg.n_group or 1)
    if groups > 1:
        if cfg.n_routed_experts % groups:
            raise ValueError(
                f"n_routed_experts={cfg.n_routed_experts} is not divisible by n_group={groups}"
            )
        if cfg.num_experts_per_tok != HF_GROUP_SCORE_TOPN * cfg.topk_group:
            raise ValueError(
                f"num_experts_per_tok={cfg.num_experts_per_tok} must be {HF_GROUP_SCORE_TOPN} * "
                f"topk_group={cfg.topk_group} when n_group > 1: HF scores a group by its best two "
                "experts, megatron by its best num_experts_per_tok / topk_group"
            )


def deepseek_v3_fields(hf_config: DeepseekV3Config) -> dict[str, Any]:
    """The `MLATransformerConfig` keyword arguments that state the DeepSeek-V3 architecture."""
    check_deepseek_v3(hf_config)
    cfg = hf_config
    return dict(
        num_query_groups=cfg.num_attention_heads,
        qk_layernorm=True,  # q_a_layernorm, kv_a_layernorm
        q_lora_rank=cfg.q_lora_rank,
        kv_lora_rank=cfg.kv_lora_rank,
        qk_head_dim=cfg.qk_nope_head_dim,
        qk_pos_emb_head_dim=cfg.qk_rope_head_dim,
        v_head_dim=cfg.v_head_dim,
        rope_type="rope",
        rotary_base=float(cfg.rope_parameters["rope_theta"]),
        **sigmoid_router_fields(cfg),
    )


def sigmoid_router_fields(cfg) -> dict[str, Any]:
    """`TransformerConfig` keyword arguments of the sigmoid, group-limited router and the
    shared experts (DeepSeek-V3's; GLM-4.5 has the same MoE block)."""
    groups = int(cfg.n_group or 1)
    return dict(
        num_moe_experts=cfg.n_routed_experts,
        moe_ffn_hidden_size=cfg.moe_intermediate_size,
        moe_router_score_function="sigmoid",
        # aux-loss-free balancing: expert_bias (e_score_correction_bias) moves by 1e-3 a step
        # from the counts of the routes used, the replayed ones under R2/R3 (docs/model.md)
        moe_router_enable_expert_bias=True,
        moe_router_num_groups=groups if groups > 1 else None,
        moe_router_group_topk=cfg.topk_group if groups > 1 else None,
        moe_router_topk_scaling_factor=float(cfg.routed_scaling_factor),
        moe_shared_expert_intermediate_size=(
            cfg.moe_intermediate_size * cfg.n_shared_experts if cfg.n_shared_experts else None
        ),
        moe_shared_expert_gate=False,
    )
