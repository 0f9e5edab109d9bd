"""LoRA's configuration: rank, alpha, dropout and which of megatron's layers are adapted."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.flags import bad_value, option

# target name -> the megatron submodule names it adapts (the local spec's, in every family)
TARGETS: dict[str, tuple[str, ...]] = {
    "attention_qkv": ("self_attention.linear_qkv",),  # q/k/v fused (Qwen3-MoE)
    "attention_out": ("self_attention.linear_proj",),  # o_proj (every family)
    "mla_up": ("self_attention.linear_q_up_proj", "self_attention.linear_kv_up_proj"),
    "dense_mlp": ("mlp.linear_fc1", "mlp.linear_fc2"),  # dense layers (DeepSeek-V3, GLM-4.5)
    "shared_experts": ("mlp.shared_experts.linear_fc1", "mlp.shared_experts.linear_fc2"),
    "routed_experts": ("mlp.experts",),  # the grouped experts (megatron_rl/lora/experts.py)
}
PRESETS = {
    "attention": ("attention_qkv", "attention_out", "mla_up"),
    # every dense linear layer of the language model
    "all_dense": tuple(t for t in TARGETS if t != "routed_experts"),
    # every linear layer of the language model, routed experts included (slime's
    # moe_language_all; the routers and the output layer are never adapted)
    "all_linear": tuple(TARGETS),
}


@dataclass(frozen=True, kw_only=True, slots=True)
class LoRAConfig:
    """Low-rank adapters on the policy (off while ``lora_rank`` is 0)."""

    lora_rank: int = option(0, help="LoRA's rank r (0: full fine-tuning)")
    lora_alpha: float = option(
        16.0, help="LoRA's alpha: the update is (alpha / r) B A (PEFT's lora_alpha)"
    )
    lora_dropout: float = option(0.0, help="dropout on each adapter's input (training only)")
    lora_experts: str = option(
        "per-expert",
        choices=("per-expert", "shared"),
        help="with routed_experts in --lora-targets: an adapter per expert (Megatron-Bridge, "
        "NeMo-RL) or one shared by a layer's experts (slime)",
    )
    lora_targets: str = option(
        "attention",
        help="comma-separated layers to adapt: presets attention, all_dense, or names "
        f"{', '.join(TARGETS)}",
    )
    lora_sync: str = option(
        "merged",
        choices=("merged", "adapter"),
        help="what a weight sync sends: merged weights W + (alpha/r) B A (every engine), or the "
        "adapters alone, loaded as an SGLang LoRA adapter per version (--rollout-engine sglang, "
        "--weight-sync-transport tensor or disk; servers started with --enable-lora)",
    )

    def __post_init__(self) -> None:
        if self.lora_rank < 0:
            raise bad_value(self, "lora_rank", "must be >= 0 (0: full fine-tuning)")
        if not (math.isfinite(self.lora_alpha) and self.lora_alpha > 0):
            raise bad_value(self, "lora_alpha", "must be a finite number > 0")
        if not (0.0 <= self.lora_dropout < 1.0):
            raise bad_value(self, "lora_dropout", "must be in [0, 1)")
        self.target_modules()  # names checked
        if self.lora_sync == "adapter" and not self.enabled:
            raise bad_value(self, "lora_sync", "'adapter' needs --lora-rank > 0")

    @property
    def enabled(self) -> bool:
        return self.lora_rank > 0

    def target_modules(self) -> tuple[str, ...]:
        """The megatron submodule suffixes ``--lora-targets`` names, in `TARGETS` order."""
        names: list[str] = []
        for part in (p.strip() for p in self.lora_targets.split(",")):
            if part in PRESETS:
                names += PRESETS[part]
            elif part in TARGETS:
                names.append(part)
            else:
                raise bad_value(
                    self,
                    "lora_targets",
                    f"{part!r} is none of the presets {', '.join(PRESETS)} or the targets "
                    f"{', '.join(TARGETS)}",
                )
        return tuple(m for t in TARGETS if t in names for m in TARGETS[t])
