"""Named model shapes, as Hugging Face configs: `Qwen3MoeConfig`, `DeepseekV3Config` or
`Glm4MoeConfig`.

Unknown names raise ValueError listing the known ones (an explicit allowlist); so does a config
of a model family the project does not build (`FAMILIES`).
"""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import DeepseekV3Config, Glm4MoeConfig, Qwen3MoeConfig

# HF ``model_type`` -> (config class, ``architectures`` entry of its config.json)
FAMILIES: dict[str, tuple[type, str]] = {
    "qwen3_moe": (Qwen3MoeConfig, "Qwen3MoeForCausalLM"),
    "deepseek_v3": (DeepseekV3Config, "DeepseekV3ForCausalLM"),
    "glm4_moe": (Glm4MoeConfig, "Glm4MoeForCausalLM"),
}
HFConfig = Qwen3MoeConfig | DeepseekV3Config | Glm4MoeConfig

_PRESETS: dict[str, dict[str, Any]] = {
    # Qwen/Qwen3-30B-A3B's config.json shape.
    "qwen3-30b-a3b": dict(
        vocab_size=151936,
        hidden_size=2048,
        intermediate_size=6144,
        moe_intermediate_size=768,
        num_hidden_layers=48,
        num_attention_heads=32,
        num_key_value_heads=4,
        head_dim=128,
        num_experts=128,
        num_experts_per_tok=8,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=40960,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    ),
    # Qwen3-MoE-shaped, a few seconds per training step on 2 CPU cores.
    "tiny": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        num_experts=8,
        num_experts_per_tok=2,
        norm_topk_prob=True,
        decoder_sparse_step=1,
        mlp_only_layers=[],
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    ),
}

# Qwen/Qwen3-235B-A22B's config.json shape (the rest as Qwen3-30B-A3B's).
_PRESETS["qwen3-235b-a22b"] = dict(
    _PRESETS["qwen3-30b-a3b"],
    hidden_size=4096,
    intermediate_size=12288,
    moe_intermediate_size=1536,
    num_hidden_layers=94,
    num_attention_heads=64,
)

# tiny with one dense layer, tied embeddings and unnormalised top-k: the other code paths.
_PRESETS["tiny-dense-tied"] = dict(
    _PRESETS["tiny"],
    norm_topk_prob=False,
    mlp_only_layers=[0],
    rope_theta=10_000.0,
    tie_word_embeddings=True,
)

# tiny with 64 experts, top-8 and 4 layers: a real train-inference routing mismatch on CPU.
# With --rollout-dtype bfloat16 the in-process engine runs bf16 while the trainer runs fp32. The
# router's 64 logits are close (random init, std ~0.16, so neighbouring order statistics sit
# ~0.005 apart), and bf16's rounding of the hidden state (relative 2**-8, compounding through
# the residual stream) moves them by about as much, so the 8th and 9th experts swap on a few
# percent of token-layers, far more than with "tiny" (8 experts, top-2): measured with
# --routing-replay r3 --routing-record-only (routing/agreement/behaviour/layer_<n>), numbers in
# docs/performance.md ("Routing mismatch of the presets"); see megatron-rl study --preset
# mismatch.
_PRESETS["tiny-mismatch"] = dict(
    _PRESETS["tiny"],
    num_experts=64,
    num_experts_per_tok=8,
    num_hidden_layers=4,
)

# DeepSeek-V3-shaped (multi-latent attention, one dense layer then sigmoid-routed MoE layers with
# group-limited top-k, a shared expert, the score-correction bias): a few seconds per CPU step.
_DEEPSEEK_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-deepseek": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=3,
        first_k_dense_replace=1,
        num_attention_heads=4,
        num_key_value_heads=4,
        q_lora_rank=32,
        kv_lora_rank=16,
        qk_nope_head_dim=16,
        qk_rope_head_dim=8,
        v_head_dim=16,
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=2,
        topk_group=1,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
        max_position_embeddings=512,
        rms_norm_eps=1e-6,
        rope_theta=10_000.0,
        tie_word_embeddings=False,
    ),
}

# deepseek-ai/DeepSeek-V3's config.json shape (671B; the same numbers as transformers 5.24's
# DeepseekV3Config defaults): 61 layers, the first 3 dense, MLA with q/kv LoRA ranks 1536 / 512,
# 128 heads of nope 128 + rope 64 (values 128), 256 routed experts top-8 in 8 groups (best 4), one
# shared expert; the release's YaRN rope_scaling (factor 40 over 4,096 original positions, betas
# 32 / 1, mscale and mscale_all_dim 1; megatron_rl.model.deepseek_v3.yarn_fields) and its
# max_position_embeddings 163,840. One departure from the published file: the
# multi-token-prediction layer is not built. A config only: no weights.
_DEEPSEEK_PRESETS["deepseek-v3"] = dict(
    vocab_size=129280,
    hidden_size=7168,
    intermediate_size=18432,
    moe_intermediate_size=2048,
    num_hidden_layers=61,
    first_k_dense_replace=3,
    num_attention_heads=128,
    num_key_value_heads=128,
    q_lora_rank=1536,
    kv_lora_rank=512,
    qk_nope_head_dim=128,
    qk_rope_head_dim=64,
    v_head_dim=128,
    n_routed_experts=256,
    num_experts_per_tok=8,
    n_group=8,
    topk_group=4,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=0,
    max_position_embeddings=163840,
    rms_norm_eps=1e-6,
    rope_theta=10_000.0,
    rope_scaling=dict(
        rope_type="yarn",
        factor=40.0,
        original_max_position_embeddings=4096,
        beta_fast=32.0,
        beta_slow=1.0,
        mscale=1.0,
        mscale_all_dim=1.0,
    ),
    tie_word_embeddings=False,
)

# GLM-4.5-shaped (GQA with q/k/v biases, qk-norm and rope on the first half of each head, two
# dense layers, then sigmoid-routed MoE layers with the score-correction bias, a shared expert
# and, unlike GLM-4.5 itself (n_group=1), group-limited top-k: 16 experts in 4 groups, the best 2
# groups, top-4): a few seconds per CPU step.
_GLM_PRESETS: dict[str, dict[str, Any]] = {
    "tiny-glm": dict(
        vocab_size=512,
        hidden_size=64,
        intermediate_size=128,
        moe_intermediate_size=32,
        num_hidden_layers=4,
        first_k_dense_replace=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        head_dim=16,
        partial_rotary_factor=0.5,
        attention_bias=True,
        use_qk_norm=True,
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        num_nextn_predict_layers=0,
        max_position_embeddings=512,
        rms_norm_eps=1e-5,
        rope_theta=1_000_000.0,
        tie_word_embeddings=False,
    ),
}

# zai-org/GLM-4.5's config.json shape (355B): 92 layers, the first 3 dense, hidden 5120, 96 query
# / 8 KV heads of 128 with q/k/v biases and qk-norm, rope on half of each head (theta 1e6), 160
# routed experts top-8 without group limits (n_group 1), one shared expert, FFN 12,288 (dense) /
# 1,536 (experts), vocabulary 151,552, rms_norm_eps 1e-5, routed_scaling_factor 2.5,
# max_position_embeddings 131,072. Taken from the published config.json as the lead's brief
# states it (this machine cannot reach the Hub); transformers 5.24's Glm4MoeConfig defaults agree
# on vocabulary, heads, KV heads, partial rotary, eps and positions and are a smaller model
# otherwise. The multi-token-prediction layer (num_nextn_predict_layers 1 in the release) is not
# built. A config only: no weights.
_GLM_PRESETS["glm-4.5"] = dict(
    vocab_size=151552,
    hidden_size=5120,
    intermediate_size=12288,
    moe_intermediate_size=1536,
    num_hidden_layers=92,
    first_k_dense_replace=3,
    num_attention_heads=96,
    num_key_value_heads=8,
    head_dim=128,
    partial_rotary_factor=0.5,
    attention_bias=True,
    use_qk_norm=True,
    n_routed_experts=160,
    num_experts_per_tok=8,
    n_group=1,
    topk_group=1,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
    num_nextn_predict_layers=0,
    max_position_embeddings=131072,
    rms_norm_eps=1e-5,
    rope_theta=1_000_000.0,
    tie_word_embeddings=False,
)

_CONFIG_CLASSES: dict[str, tuple[dict[str, dict[str, Any]], type]] = {
    **{name: (_PRESETS, Qwen3MoeConfig) for name in _PRESETS},
    **{name: (_DEEPSEEK_PRESETS, DeepseekV3Config) for name in _DEEPSEEK_PRESETS},
    **{name: (_GLM_PRESETS, Glm4MoeConfig) for name in _GLM_PRESETS},
}
PRESET_NAMES = tuple(_CONFIG_CLASSES)


def preset_config(name: str, **overrides: Any) -> HFConfig:
    """The HF config of preset ``name`` with keyword ``overrides`` applied."""
    if name not in _CONFIG_CLASSES:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(PRESET_NAMES)}")
    table, config_class = _CONFIG_CLASSES[name]
    kwargs = {**table[name], **overrides}
    rope_parameters = {"rope_type": "default", "rope_theta": kwargs.pop("rope_theta")}
    rope_parameters.update(kwargs.pop("rope_scaling", {}))  # the release's config.json name
    if "partial_rotary_factor" in kwargs:  # transformers 5 keeps it in rope_parameters
        rope_parameters["partial_rotary_factor"] = kwargs.pop("partial_rotary_factor")
    kwargs.setdefault("rope_parameters", rope_parameters)
    return config_class(**kwargs)


def model_family(hf_config: HFConfig) -> str:
    """The HF ``model_type`` of ``hf_config``, one of `FAMILIES` (ValueError otherwise)."""
    family = getattr(hf_config, "model_type", None)
    if family not in FAMILIES:
        raise ValueError(
            f"model_type={family!r} is not supported; supported model families: "
            f"{', '.join(FAMILIES)}"
        )
    return family


def hf_architecture(hf_config: HFConfig) -> str:
    """The ``architectures`` entry of the config.json written for ``hf_config``."""
    return FAMILIES[model_family(hf_config)][1]


def hf_causal_lm_class(hf_config: HFConfig) -> type:
    """transformers' causal-LM class of ``hf_config``'s family (``Qwen3MoeForCausalLM``,
    ``DeepseekV3ForCausalLM`` or ``Glm4MoeForCausalLM``): what the in-process engine runs and the
    weight sync sizes."""
    import transformers

    return getattr(transformers, hf_architecture(hf_config))


def load_hf_config(config: HFConfig | str | os.PathLike) -> HFConfig:
    """Accept a config object, a ``config.json`` path or a checkpoint folder holding one.

    The config's ``model_type`` picks the family (`FAMILIES`); a file without one is read by its
    ``architectures`` entry, and as Qwen3-MoE when it has neither. Any other model type or
    architecture raises ValueError listing the supported families.
    """
    if isinstance(config, Qwen3MoeConfig | DeepseekV3Config | Glm4MoeConfig):
        model_family(config)
        return config
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    family = data.get("model_type") or _family_of_architectures(path, data.get("architectures"))
    if family not in FAMILIES:
        raise ValueError(
            f"{path}: model_type={family!r} is not supported; supported model families: "
            f"{', '.join(FAMILIES)}"
        )
    return FAMILIES[family][0].from_dict(data)


def _family_of_architectures(path: str, architectures: list[str] | None) -> str:
    """The family a config.json without ``model_type`` names in ``architectures`` (Qwen3-MoE
    when it names none); ValueError when it names only architectures of other families."""
    by_architecture = {architecture: family for family, (_, architecture) in FAMILIES.items()}
    for architecture in architectures or []:
        if architecture in by_architecture:
            return by_architecture[architecture]
    if architectures:
        supported = ", ".join(f"{family} ({arch})" for family, (_, arch) in FAMILIES.items())
        raise ValueError(
            f"{path}: architectures={architectures!r} (no model_type) is not supported; "
            f"supported model families: {supported}"
        )
    return "qwen3_moe"
