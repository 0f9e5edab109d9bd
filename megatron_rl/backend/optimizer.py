"""The one place that chooses the optimizer: megatron's distributed Adam on GPU, AdamW on CPU.

Both paths share everything else: the model is wrapped in megatron-core's
``DistributedDataParallel`` (contiguous grad buffers, ``main_grad``), and megatron's
``finalize_model_grads`` all-reduces data-parallel, sequence-parallel-norm and embedding grads.
On CPU, megatron's optimizers allocate on 'cuda' and its grad clipping asserts CUDA tensor types,
so the step is a plain ``torch.optim.AdamW`` over the parameters, reading ``main_grad``.
"""

from __future__ import annotations

import dataclasses
import logging

import torch
from megatron.core import parallel_state
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)

from megatron_rl.backend.cpu import cuda_available
from megatron_rl.collectives import all_ranks_agree

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True)
class OptimizerConfig:
    """Adam hyper-parameters; ``clip_grad`` <= 0 disables clipping."""

    lr: float = 1e-6
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.999
    adam_eps: float = 1e-8
    clip_grad: float = 1.0

    def __post_init__(self) -> None:
        if not self.lr > 0:
            raise ValueError(f"OptimizerConfig.lr={self.lr}: must be > 0")
        for name in ("adam_beta1", "adam_beta2"):
            value = getattr(self, name)
            if not 0.0 <= value < 1.0:
                raise ValueError(f"OptimizerConfig.{name}={value}: must be in [0, 1)")
        if self.weight_decay < 0 or self.adam_eps <= 0:
            raise ValueError("OptimizerConfig: weight_decay must be >= 0 and adam_eps > 0")


def wrap_for_training(model: torch.nn.Module) -> DistributedDataParallel:
    """megatron-core DDP around ``model`` (grad buffers in fp32, distributed optimizer on GPU)."""
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=cuda_available(),
        overlap_grad_reduce=False,
    )
    return DistributedDataParallel(model.config, ddp_config, model)


class PolicyOptimizer:
    """``zero_grad()`` before the microbatches, ``step()`` after their backward passes."""

    def __init__(self, model: DistributedDataParallel, config: OptimizerConfig) -> None:
        self.model = model
        self.config = config
        self._megatron = None
        self._torch = None
        if cuda_available():
            from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig
            from megatron.core.optimizer import get_megatron_optimizer

            self._megatron = get_megatron_optimizer(
                MegatronOptimizerConfig(
                    optimizer="adam",
                    lr=config.lr,
                    weight_decay=config.weight_decay,
                    adam_beta1=config.adam_beta1,
                    adam_beta2=config.adam_beta2,
                    adam_eps=config.adam_eps,
                    clip_grad=max(config.clip_grad, 0.0),
                    bf16=model.config.bf16,
                    params_dtype=model.config.params_dtype,
                    use_distributed_optimizer=True,
                ),
                [model],
            )
        else:
            mp_size = parallel_state.get_model_parallel_group().size()
            ep_size = parallel_state.get_expert_model_parallel_world_size()
            if config.clip_grad > 0 and (mp_size > 1 or ep_size > 1):
                raise ValueError(
                    "OptimizerConfig.clip_grad > 0 on CPU needs model-parallel size 1 (the global "
                    "grad norm over TP/EP shards is megatron's CUDA-only code); set clip_grad=0"
                )
            self._torch = torch.optim.AdamW(
                [p for p in model.parameters() if p.requires_grad],
                lr=config.lr,
                betas=(config.adam_beta1, config.adam_beta2),
                eps=config.adam_eps,
                weight_decay=config.weight_decay,
            )
        logger.info("optimizer: %s", "megatron distributed Adam" if self._megatron else "AdamW")

    @property
    def inner(self):
        """The optimizer doing the update: megatron's (GPU) or ``torch.optim.AdamW`` (CPU)."""
        return self._megatron or self._torch

    @property
    def param_groups(self) -> list[dict]:
        return (self._megatron or self._torch).param_groups

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        (self._megatron or self._torch).zero_grad()

    def step(self) -> float | None:
        """Finalise grads (DP/SP/embedding all-reduces), clip, update; returns the grad norm.

        When any gradient is non-finite on any rank, nothing is updated and None is returned
        (every rank decides the same; the caller zeroes the gradients and logs the skip).
        """
        finalize_model_grads([self.model])
        if self._megatron is not None:
            update_successful, grad_norm, _ = self._megatron.step()
            return float(grad_norm) if update_successful and grad_norm is not None else None
        params = [p for p in self.model.parameters() if p.requires_grad]
        for param in params:
            main_grad = getattr(param, "main_grad", None)
            if main_grad is not None:
                param.grad = (
                    main_grad if main_grad.dtype == param.dtype else main_grad.to(param.dtype)
                )
        grads = [p.grad for p in params if p.grad is not None]
        grad_norm = torch.linalg.vector_norm(torch.stack([g.float().norm() for g in grads]))
        if not all_ranks_agree(bool(torch.isfinite(grad_norm))):
            return None
        if self.config.clip_grad > 0:
            torch.nn.utils.clip_grad_norm_(params, self.config.clip_grad)
        self._torch.step()
        return float(grad_norm)


def build_optimizer(model: DistributedDataParallel, config: OptimizerConfig) -> PolicyOptimizer:
    """The optimizer for this device (see the module docstring)."""
    return PolicyOptimizer(model, config)
