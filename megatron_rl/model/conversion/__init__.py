"""Qwen3-MoE conversion between HF safetensors and megatron-core models (local or TE spec)."""

from megatron_rl.model.conversion.export import (
    iter_canonical_tensors,
    iter_hf_tensors,
    iter_hf_tensors_every_stage,
    save_checkpoint,
)
from megatron_rl.model.conversion.load import detect_format, load_checkpoint
from megatron_rl.model.conversion.names import (
    RankLayout,
    TensorMap,
    expected_canonical_shapes,
    expected_hf_shapes,
    rank_tensor_maps,
)

__all__ = [
    "RankLayout",
    "TensorMap",
    "detect_format",
    "expected_canonical_shapes",
    "expected_hf_shapes",
    "iter_canonical_tensors",
    "iter_hf_tensors",
    "iter_hf_tensors_every_stage",
    "load_checkpoint",
    "rank_tensor_maps",
    "save_checkpoint",
]
