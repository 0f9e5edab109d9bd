"""Qwen3-MoE policy on megatron-core: presets, config translation, builder, HF conversion."""

from megatron_rl.model.builder import build_model, causal_lm_logits, resolve_spec
from megatron_rl.model.config import ModelOptions, load_hf_config, to_transformer_config
from megatron_rl.model.presets import PRESET_NAMES, preset_config

__all__ = [
    "PRESET_NAMES",
    "ModelOptions",
    "build_model",
    "causal_lm_logits",
    "load_hf_config",
    "preset_config",
    "resolve_spec",
    "to_transformer_config",
]
