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

YaRN (arXiv:2309.00071; the release's ``rope_scaling``: factor 40 over 4,096 positions) maps to
megatron's MLA YaRN fields (`yarn_fields`). With s the factor, m(s, a) = 0.1 a ln s + 1 (1 for
s <= 1), d the rope dims and rho = 2 pi / theta_i the rotations over the original length L:
inv_freq_i = theta_i (1 - r_i) + theta_i / s r_i, r_i the linear ramp over the dims
[floor(d ln(L / (2 pi beta_fast)) / (2 ln base)), ceil(... beta_slow ...)]; cos and sin are
multiplied by m(s, mscale) / m(s, mscale_all_dim) and the softmax scale is
m(s, mscale_all_dim)^2 / sqrt(nope + rope). HF (`_compute_yarn_parameters`, `yarn_apply_mscale`)
and megatron (`YarnRotaryEmbedding`, `MLASelfAttention`) compute these alike except where
`check_yarn` refuses.
"""

from __future__ import annotations

from typing import Any

from transformers import DeepseekV3Config

from megatron_rl.model.rope import rope_theta

# HF's group score sums the best two experts of a group; megatron's the best topk / group_topk
HF_GROUP_SCORE_TOPN = 2
# HF builds q_a_layernorm and kv_a_layernorm with DeepseekV3RMSNorm's default eps, not rms_norm_eps
_HF_LATENT_NORM_EPS = 1e-6


def check_deepseek_v3(hf_config: DeepseekV3Config) -> None:
    """ValueError naming the field for what megatron-core cannot compute as HF does."""
    cfg = hf_config
    yarn_fields(cfg)  # refuses rope types and YaRN parameters megatron computes otherwise
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
        **yarn_fields(cfg),
        **sigmoid_router_fields(cfg),
    )


def yarn_fields(hf_config: DeepseekV3Config) -> dict[str, Any]:
    """`MLATransformerConfig`'s rope fields for ``rope_parameters`` (``rope_scaling`` in the
    release's config.json): ``rope_type`` "rope" for HF's "default", "yarn" with its factor,
    original length, betas and mscales for "yarn"; ValueError naming the field otherwise."""
    theta = rope_theta(hf_config, rope_types=("default", "yarn"))
    params = getattr(hf_config, "rope_parameters", None) or {}
    if params.get("rope_type", "default") == "default":
        return dict(rope_type="rope", rotary_base=theta)
    check_yarn(params)
    mscale_all_dim = float(params.get("mscale_all_dim") or 0.0)
    return dict(
        rope_type="yarn",
        rotary_base=theta,
        rotary_scaling_factor=float(params["factor"]),
        original_max_position_embeddings=int(
            params.get("original_max_position_embeddings") or hf_config.max_position_embeddings
        ),
        beta_fast=float(params.get("beta_fast") or 32.0),  # HF's defaults for absent or 0
        beta_slow=float(params.get("beta_slow") or 1.0),
        # HF ignores mscale without mscale_all_dim (attention factor m(s, 1)): megatron's
        # m(s, mscale) / m(s, 0) equals it with mscale 1
        mscale=float(params["mscale"]) if mscale_all_dim else 1.0,
        mscale_all_dim=mscale_all_dim,
    )


def check_yarn(params: dict[str, Any]) -> None:
    """ValueError naming the ``rope_parameters`` entry where HF's YaRN and megatron's differ."""
    if params.get("factor") is None:
        raise ValueError(
            "rope_parameters['factor'] is missing for rope_type 'yarn': HF's MLA softmax scale "
            "needs it; set it (DeepSeek-V3's is 40)"
        )
    if params.get("attention_factor") is not None:
        raise ValueError(
            f"rope_parameters['attention_factor']={params['attention_factor']} is not supported: "
            "megatron derives the YaRN attention factor from factor, mscale and mscale_all_dim; "
            "remove it and give mscale / mscale_all_dim instead"
        )
    if params.get("mscale_all_dim") and not params.get("mscale"):
        raise ValueError(
            f"rope_parameters['mscale']={params.get('mscale')!r} with mscale_all_dim="
            f"{params['mscale_all_dim']} is not supported: HF's attention factor is then "
            "m(factor, 1), megatron's m(factor, mscale) / m(factor, mscale_all_dim); set mscale "
            "(DeepSeek-V3's is 1.0) or leave mscale_all_dim out"
        )
    if not params.get("truncate", True):
        raise ValueError(
            "rope_parameters['truncate']=False is not supported: megatron's MLA YaRN always "
            "rounds the correction range to integers; set truncate=True (HF's default)"
        )
    if params.get("partial_rotary_factor", 1.0) != 1.0:
        raise ValueError(
            f"rope_parameters['partial_rotary_factor']={params['partial_rotary_factor']} is not "
            "supported: megatron's MLA YaRN rotates all qk_rope_head_dim dims; set it to 1.0"
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
