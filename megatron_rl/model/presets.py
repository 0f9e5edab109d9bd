"""Named Qwen3-MoE model shapes, as Hugging Face `Qwen3MoeConfig` objects.

Unknown names raise ValueError listing the known ones (an explicit allowlist).
"""

from __future__ import annotations

import json
import os
from typing import Any

from transformers import Qwen3MoeConfig

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
# docs/performance.md ("Routing mismatch of the presets"); see tools/compare_runs.py --preset
# mismatch.
_PRESETS["tiny-mismatch"] = dict(
    _PRESETS["tiny"],
    num_experts=64,
    num_experts_per_tok=8,
    num_hidden_layers=4,
)

PRESET_NAMES = tuple(_PRESETS)


def preset_config(name: str, **overrides: Any) -> Qwen3MoeConfig:
    """The `Qwen3MoeConfig` of preset ``name`` with keyword ``overrides`` applied."""
    if name not in _PRESETS:
        raise ValueError(f"unknown model preset {name!r}; known presets: {', '.join(_PRESETS)}")
    kwargs = {**_PRESETS[name], **overrides}
    rope_theta = kwargs.pop("rope_theta")
    kwargs.setdefault("rope_parameters", {"rope_type": "default", "rope_theta": rope_theta})
    return Qwen3MoeConfig(**kwargs)


def load_hf_config(config: Qwen3MoeConfig | str | os.PathLike) -> Qwen3MoeConfig:
    """Accept a config object, a ``config.json`` path or a checkpoint folder holding one."""
    if isinstance(config, Qwen3MoeConfig):
        return config
    path = os.fspath(config)
    if os.path.isdir(path):
        path = os.path.join(path, "config.json")
    with open(path, encoding="utf-8") as handle:
        data = json.load(handle)
    if data.get("model_type") not in (None, "qwen3_moe"):
        raise ValueError(f"{path}: model_type={data.get('model_type')!r}, expected 'qwen3_moe'")
    return Qwen3MoeConfig.from_dict(data)
