"""Qwen3-MoE policy on megatron-core: presets, config translation, builder, HF conversion,
and the per-GPU memory plan (``memory``).

Names are imported on first use, so that light modules (``memory``, ``presets``) load without
megatron-core.
"""

from __future__ import annotations

import importlib

_HOMES = {
    "PRESET_NAMES": "megatron_rl.model.presets",
    "preset_config": "megatron_rl.model.presets",
    "ModelOptions": "megatron_rl.model.config",
    "load_hf_config": "megatron_rl.model.presets",
    "to_transformer_config": "megatron_rl.model.config",
    "build_model": "megatron_rl.model.builder",
    "causal_lm_logits": "megatron_rl.model.builder",
    "resolve_spec": "megatron_rl.model.builder",
}

__all__ = sorted(_HOMES)


def __getattr__(name: str):
    if name not in _HOMES:
        raise AttributeError(f"module 'megatron_rl.model' has no attribute {name!r}")
    value = getattr(importlib.import_module(_HOMES[name]), name)
    globals()[name] = value
    return value
