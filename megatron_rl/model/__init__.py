"""Qwen3-MoE policy on megatron-core: presets, config translation, builder, HF conversion,
and the pipeline layer split (``stages``). The per-GPU memory plan is `megatron_rl.memory_plan`.

Names are imported on first use, so that light modules (``stages``, ``presets``) load without
megatron-core.
"""

from __future__ import annotations

from megatron_rl.lazy_exports import lazy_getattr

_HOMES = {
    "PRESET_NAMES": "megatron_rl.model.presets",
    "preset_config": "megatron_rl.model.presets",
    "ModelOptions": "megatron_rl.model.options",
    "load_hf_config": "megatron_rl.model.presets",
    "to_transformer_config": "megatron_rl.model.config",
    "build_model": "megatron_rl.model.builder",
    "causal_lm_logits": "megatron_rl.model.builder",
    "resolve_spec": "megatron_rl.model.builder",
}

__all__ = sorted(_HOMES)


__getattr__ = lazy_getattr("megatron_rl.model", _HOMES, globals())
