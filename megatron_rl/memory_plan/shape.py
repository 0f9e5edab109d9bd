"""The model being planned: what the plan needs of a HF Qwen3-MoE, DeepSeek-V3 or GLM-4.5 config,
and its parameter counts."""

from __future__ import annotations

import dataclasses
import os
from typing import Any

from megatron_rl.moe_layers import moe_layer_pattern, num_routed_experts


def load_model_config(model: str | os.PathLike, **overrides: Any):
    """A HF config of a supported family (`megatron_rl.model.presets.FAMILIES`): a preset name or
    a checkpoint folder, with config attributes ``overrides`` (e.g. ``num_hidden_layers=2``: the
    GPU smoke's slice)."""
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
    """What the memory plan needs of a HF Qwen3-MoE, DeepSeek-V3 or GLM-4.5 config.

    Multi-latent attention (DeepSeek-V3, ``kv_lora_rank > 0``): ``head_dim`` is the query/key
    head size ``qk_nope_head_dim + qk_rope_head_dim``, ``num_kv_heads == num_heads`` and the value
    heads are ``v_head_dim`` wide. Shared experts: Qwen-style (``shared_expert_intermediate_size``,
    with a sigmoid gate) or DeepSeek-style (``n_shared_experts x moe_intermediate_size``, no gate).
    """

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int  # query/key head size (MLA: nope + rope)
    intermediate_size: int  # dense-layer FFN (mlp_only_layers, first_k_dense_replace)
    moe_intermediate_size: int
    num_experts: int
    topk: int
    shared_expert_size: int = 0  # 0: no shared expert
    shared_expert_gate: bool = True  # Qwen-style sigmoid gate [1, hidden] beside it
    attention_bias: bool = False
    qk_norm: bool = True  # per-head q/k RMSNorm (Qwen3 always, GLM-4.5 with use_qk_norm)
    tied_embeddings: bool = False
    moe_pattern: tuple[int, ...] = ()
    # multi-latent attention (0: grouped-query attention)
    q_lora_rank: int = 0  # 0 with MLA: one linear_q_proj instead of q down / up
    kv_lora_rank: int = 0
    qk_rope_head_dim: int = 0
    v_head_dim: int = 0

    @classmethod
    def from_hf(cls, config) -> ModelShape:
        if getattr(config, "kv_lora_rank", None):
            return cls._from_mla(config)
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        shared, gate = _shared_expert(config)
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=int(config.num_attention_heads),
            num_kv_heads=int(config.num_key_value_heads),
            head_dim=int(head_dim),
            intermediate_size=int(config.intermediate_size),
            moe_intermediate_size=int(config.moe_intermediate_size),
            num_experts=num_routed_experts(config),
            topk=int(config.num_experts_per_tok),
            shared_expert_size=shared,
            shared_expert_gate=gate,
            attention_bias=bool(getattr(config, "attention_bias", False)),
            qk_norm=bool(getattr(config, "use_qk_norm", True)),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            moe_pattern=tuple(moe_layer_pattern(config)),
        )

    @classmethod
    def _from_mla(cls, config) -> ModelShape:
        shared, gate = _shared_expert(config)
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=int(config.num_attention_heads),
            num_kv_heads=int(config.num_attention_heads),
            head_dim=int(config.qk_nope_head_dim + config.qk_rope_head_dim),
            intermediate_size=int(config.intermediate_size),
            moe_intermediate_size=int(config.moe_intermediate_size),
            num_experts=num_routed_experts(config),
            topk=int(config.num_experts_per_tok),
            shared_expert_size=shared,
            shared_expert_gate=gate,
            qk_norm=False,
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            moe_pattern=tuple(moe_layer_pattern(config)),
            q_lora_rank=int(config.q_lora_rank or 0),
            kv_lora_rank=int(config.kv_lora_rank),
            qk_rope_head_dim=int(config.qk_rope_head_dim),
            v_head_dim=int(config.v_head_dim),
        )

    @property
    def mla(self) -> bool:
        return self.kv_lora_rank > 0

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_pattern)

    # unsplit widths of the attention's activations (TP splits each by heads)
    @property
    def q_width(self) -> int:
        """Query features per token: ``heads x head_dim`` (MLA: ``heads x (nope + rope)``)."""
        return self.num_heads * self.head_dim

    @property
    def k_width(self) -> int:
        """Key features per token: ``kv_heads x head_dim`` (MLA: every head, nope + rope)."""
        return self.num_kv_heads * self.head_dim

    @property
    def v_width(self) -> int:
        """Value features per token: ``kv_heads x head_dim`` (MLA: ``heads x v_head_dim``)."""
        return self.num_heads * self.v_head_dim if self.mla else self.k_width

    @property
    def out_width(self) -> int:
        """The attention output (linear_proj's input): ``heads x`` the value head size."""
        return self.num_heads * (self.v_head_dim if self.mla else self.head_dim)

    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def mla_tensors(self) -> dict[str, tuple[int, bool]]:
        """MLA's linears, megatron's names -> (unsplit elements, split over TP by heads): q down
        ``[q_lora, h]`` and up ``[heads (nope + rope), q_lora]`` (or one linear_q_proj
        ``[heads (nope + rope), h]``), kv down ``[kv_lora + rope, h]`` and up
        ``[heads (nope + v), kv_lora]``, linear_proj ``[h, heads v]``. The down projections are
        not split by heads (Transformer Engine's spec replicates them over TP, the local spec
        splits their outputs: see `megatron_rl.memory_plan.params.stage_tensors`)."""
        h, n = self.hidden_size, self.num_heads
        nope = self.head_dim - self.qk_rope_head_dim
        out: dict[str, tuple[int, bool]] = {"linear_proj": (h * self.out_width, True)}
        if self.q_lora_rank:
            out["linear_q_down_proj"] = (self.q_lora_rank * h, False)
            out["linear_q_up_proj"] = (self.q_width * self.q_lora_rank, True)
        else:
            out["linear_q_proj"] = (self.q_width * h, True)
        out["linear_kv_down_proj"] = ((self.kv_lora_rank + self.qk_rope_head_dim) * h, False)
        out["linear_kv_up_proj"] = (n * (nope + self.v_head_dim) * self.kv_lora_rank, True)
        return out

    # unsplit parameter counts of the pieces of one layer
    def attention_params(self) -> int:
        """linear_qkv (+ bias) and linear_proj; MLA: its q / kv down and up projections and
        linear_proj (`mla_tensors`)."""
        if self.mla:
            return sum(numel for numel, _ in self.mla_tensors().values())
        h = self.hidden_size
        bias = self.qkv_width if self.attention_bias else 0
        return self.qkv_width * h + bias + self.out_width * h

    def norm_params(self) -> int:
        """input and pre-MLP RMSNorm (hidden) + q/k RMSNorm (head_dim); MLA: the q and kv latent
        RMSNorms (q_lora_rank, kv_lora_rank) instead of q/k."""
        if self.mla:
            return 2 * self.hidden_size + self.q_lora_rank + self.kv_lora_rank
        return 2 * self.hidden_size + (2 * self.head_dim if self.qk_norm else 0)

    def expert_params(self) -> int:
        """One routed expert: SwiGLU fc1 (gate + up) and fc2."""
        return 3 * self.moe_intermediate_size * self.hidden_size

    def shared_expert_params(self) -> int:
        """Shared expert fc1 + fc2 and (Qwen-style) its sigmoid gate ``[1, hidden]``; 0 when
        absent."""
        if not self.shared_expert_size:
            return 0
        gate = self.hidden_size if self.shared_expert_gate else 0
        return 3 * self.shared_expert_size * self.hidden_size + gate

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


def _shared_expert(config) -> tuple[int, bool]:
    """(shared expert FFN size, gated): Qwen's ``shared_expert_intermediate_size`` (gated), or
    DeepSeek-V3 / GLM-4.5's ``n_shared_experts`` fused into one of n x ``moe_intermediate_size``
    (ungated, as `megatron_rl.model.deepseek_v3` builds it); (0, False) without one."""
    qwen = int(getattr(config, "shared_expert_intermediate_size", 0) or 0)
    if qwen:
        return qwen, True
    count = int(getattr(config, "n_shared_experts", 0) or 0)
    return count * int(config.moe_intermediate_size), False
