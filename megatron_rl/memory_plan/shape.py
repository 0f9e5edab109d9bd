"""The model being planned: what the plan needs of a HF Qwen3-MoE config, and its parameter
counts."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from megatron_rl.moe_layers import moe_layer_pattern


def load_model_config(model: str | os.PathLike, **overrides: Any):
    """A HF ``Qwen3MoeConfig``: a preset name or a checkpoint folder, with config attributes
    ``overrides`` (e.g. ``num_hidden_layers=2``: the GPU smoke's slice)."""
    from megatron_rl.model.presets import PRESET_NAMES, load_hf_config, preset_config

    name = os.fspath(model)
    if name in PRESET_NAMES:
        return preset_config(name, **overrides)
    if not os.path.exists(name):
        known = ", ".join(PRESET_NAMES)
        raise ValueError(f"model {name!r} is neither a preset ({known}) nor a path")
    config = load_hf_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What the memory plan needs of a HF Qwen3-MoE config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense-layer FFN (mlp_only_layers)
    moe_intermediate_size: int
    num_experts: int
    topk: int
    shared_expert_size: int = 0  # 0: no shared expert
    attention_bias: bool = False
    tied_embeddings: bool = False
    moe_pattern: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, config) -> ModelShape:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=int(config.num_attention_heads),
            num_kv_heads=int(config.num_key_value_heads),
            head_dim=int(head_dim),
            intermediate_size=int(config.intermediate_size),
            moe_intermediate_size=int(config.moe_intermediate_size),
            num_experts=int(getattr(config, "num_experts", 0) or 0),
            topk=int(config.num_experts_per_tok),
            shared_expert_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            moe_pattern=tuple(moe_layer_pattern(config)),
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_pattern)

    # unsplit parameter counts of the pieces of one layer
    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def attention_params(self) -> int:
        """linear_qkv (+ bias) and linear_proj."""
        h = self.hidden_size
        bias = self.qkv_width if self.attention_bias else 0
        return self.qkv_width * h + bias + self.num_heads * self.head_dim * h

    def norm_params(self) -> int:
        """input and pre-MLP RMSNorm (hidden) + q/k RMSNorm (head_dim)."""
        return 2 * self.hidden_size + 2 * self.head_dim

    def expert_params(self) -> int:
        """One routed expert: SwiGLU fc1 (gate + up) and fc2."""
        return 3 * self.moe_intermediate_size * self.hidden_size

    def shared_expert_params(self) -> int:
        """Shared expert fc1 + fc2 and its sigmoid gate ``[1, hidden]``; 0 when absent."""
        if not self.shared_expert_size:
            return 0
        return 3 * self.shared_expert_size * self.hidden_size + self.hidden_size

    def dense_mlp_params(self) -> int:
        return 3 * self.intermediate_size * self.hidden_size

    def total_params(self, *, active: bool = False) -> int:
        """Parameters of the whole model (tied embeddings once); ``active``: top-k experts only."""
        h, n = self.hidden_size, 0
        for sparse in self.moe_pattern:
            n += self.attention_params() + self.norm_params()
            if sparse:
                experts = self.topk if active else self.num_experts
                n += self.num_experts * h + experts * self.expert_params()
                n += self.shared_expert_params()
            else:
                n += self.dense_mlp_params()
        embeddings = 1 if self.tied_embeddings else 2
        return n + embeddings * self.vocab_size * h + h
