"""The rope base of an HF config, and which rope types a family's megatron model computes as HF.

transformers 5 keeps the rope settings in ``rope_parameters`` (``rope_type``, ``rope_theta`` and
the scaling entries, read from ``rope_scaling`` in older config.json files); 4.x kept
``rope_theta`` beside it. Qwen3-MoE and GLM-4.5 are built with the default rope only; DeepSeek-V3's
multi-latent attention also takes YaRN (`megatron_rl.model.deepseek_v3.yarn_fields`).
"""

from __future__ import annotations

from typing import Any


def rope_theta(hf_config: Any, rope_types: tuple[str, ...] = ("default",)) -> float:
    """The rope base of ``hf_config``; ValueError when its ``rope_type`` is not in ``rope_types``
    (the types the caller's model computes as HF does)."""
    params = getattr(hf_config, "rope_parameters", None) or {}
    rope_type = params.get("rope_type", "default")
    if rope_type not in rope_types:
        family = getattr(hf_config, "model_type", None)
        raise ValueError(
            f"rope_parameters['rope_type']={rope_type!r} is not supported for {family}; "
            f"supported: {', '.join(repr(name) for name in rope_types)}"
        )
    theta = params.get("rope_theta", getattr(hf_config, "rope_theta", None))
    if theta is None:
        raise ValueError("the HF config has neither rope_parameters['rope_theta'] nor rope_theta")
    return float(theta)
