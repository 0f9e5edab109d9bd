"""The optimizer's configuration (importable without megatron-core: ``--help`` stays fast)."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.flags import bad_value, option


@dataclass(frozen=True, kw_only=True, slots=True)
class OptimizerConfig:
    """Adam and megatron's gradient handling."""

    lr: float = option(1e-6, help="learning rate")
    lr_warmup_iters: int = option(
        0,
        help="linear warmup over this many steps (--train-iters units): step s (0-based) uses "
        "lr * min(1, (s + 1) / warmup), as megatron's scheduler (EPIC's protocol: 10)",
    )
    weight_decay: float = option(0.0, help="decoupled weight decay")
    adam_beta1: float = option(0.9, help="Adam beta1")
    adam_beta2: float = option(0.999, help="Adam beta2")
    adam_eps: float = option(1e-8, help="Adam epsilon")
    clip_grad: float = option(
        1.0, help="clip the global gradient L2 norm to this (>= 0; 0: no clipping, as megatron)"
    )
    use_distributed_optimizer: bool = option(True, help="shard Adam state over DP ranks")
    overlap_grad_reduce: bool = option(
        False, help="reduce data-parallel gradients during the last micro-batch's backward"
    )
    # megatron's HybridDeviceOptimizer: this fraction of the (sharded) Adam state and its update
    # lives in host memory and runs on the CPU (needs CUDA and the distributed optimizer)
    cpu_offload: bool = option(
        False,
        name="optimizer-cpu-offload",
        help="megatron's optimizer CPU offload: Adam state and update in host memory (CUDA only; "
        "needs --use-distributed-optimizer)",
    )
    offload_fraction: float = option(
        1.0,
        name="optimizer-offload-fraction",
        help="share of the offloaded optimizer state (0..1); 0 offloads nothing, so the "
        "flag above is then a no-op (a launcher that always passes it runs on CPU this way)",
    )
    # torch's AdamW kernel on the CPU backend (megatron's Adam without TE/apex is torch's AdamW)
    cpu_adam: str = option(
        "fused",
        choices=("fused", "foreach"),
        help="CPU backend's Adam kernel: fused (one pass over each tensor's state, as TE/apex "
        "fuse it on GPU; ~1e-7 of the largest parameter from foreach after 5 steps) or foreach "
        "(bitwise megatron's per-tensor loop); no effect on GPU",
    )

    @property
    def offloads(self) -> bool:
        """Whether any of the Adam state goes to host memory (the flag, with a share > 0)."""
        return self.cpu_offload and self.offload_fraction > 0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise bad_value(self, "lr", "must be a finite number > 0")
        if not (isinstance(self.lr_warmup_iters, int) and self.lr_warmup_iters >= 0):
            raise bad_value(self, "lr_warmup_iters", "must be an integer >= 0 (0: no warmup)")
        for name in ("adam_beta1", "adam_beta2"):
            if not 0.0 <= getattr(self, name) < 1.0:
                raise bad_value(self, name, "must be in [0, 1)")
        if not (math.isfinite(self.weight_decay) and self.weight_decay >= 0):
            raise bad_value(self, "weight_decay", "must be a finite number >= 0")
        if not (math.isfinite(self.adam_eps) and self.adam_eps > 0):
            raise bad_value(self, "adam_eps", "must be a finite number > 0")
        if not (math.isfinite(self.clip_grad) and self.clip_grad >= 0):
            raise bad_value(
                self, "clip_grad", "must be a finite number >= 0 (0 turns clipping off)"
            )
        if self.cpu_adam not in ("fused", "foreach"):
            raise bad_value(self, "cpu_adam", "must be 'fused' or 'foreach'")
        if not 0.0 <= self.offload_fraction <= 1.0:
            raise bad_value(self, "offload_fraction", "must be in [0, 1]")
        if self.cpu_offload and not self.use_distributed_optimizer:
            raise ValueError(
                "--optimizer-cpu-offload (cpu_offload) needs --use-distributed-optimizer "
                "(use_distributed_optimizer): megatron offloads through the precision-aware path "
                "of its distributed optimizer"
            )


def step_lr(config: OptimizerConfig, step: int) -> float:
    """The learning rate of (0-based) step ``step``: ``lr * min(1, (step + 1) / warmup)``."""
    if config.lr_warmup_iters == 0:
        return config.lr
    return config.lr * min(1.0, (step + 1) / config.lr_warmup_iters)
