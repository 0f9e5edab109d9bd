"""The policy's optimizer: megatron-core's own, on GPU and on CPU alike.

The model is wrapped in megatron-core's ``DistributedDataParallel`` (contiguous fp32 grad
buffers, ``main_grad``), and the update is ``get_megatron_optimizer``: Adam with fp32 master
weights for bf16 parameters, megatron's distributed optimizer (optimizer state sharded over the
data-parallel ranks) when ``use_distributed_optimizer``, and global-norm clipping over every
tensor/expert/pipeline-parallel group. On CPU the same code runs through the confined shims of
``backend/cpu_optimizer.py``, so tests exercise what GPUs run.

Non-finite gradients are the one thing megatron does not catch here: with bf16/fp32 and no loss
scale it builds no grad scaler, and ``step()`` applies a NaN gradient and reports success with a
NaN norm. `PolicyOptimizer.step` therefore skips the update (on every rank alike) when a
gradient is non-finite.

On the CPU backend the step is megatron's, in its own three parts (``prepare_grads``, the norm
and clipping, ``step_with_ready_grads``), with the per-tensor Python loops of its torch fallbacks
replaced: the norm (with the finite check folded in) is one ``torch._foreach_norm`` over
megatron's own tensor list, the clipping one scale of the contiguous grad buffers
(`backend/grad_norm.py`: bitwise megatron's norm and clipping, over the same groups), and torch's
AdamW runs its ``fused`` CPU kernel (``--cpu-adam fused``, the default: one pass over each
tensor's state, as TE/apex fuse Adam on GPU; it orders the arithmetic differently from the loop,
~1e-7 of the largest parameter after 5 steps) or its ``foreach`` implementation (``--cpu-adam
foreach``: bitwise megatron's loop); see `cpu_optimizer.foreach_adam`.
On GPU ``step()`` is megatron's own (TE/apex kernels where installed; torch picks foreach
Adam for CUDA tensors by itself), after a chunked finite check of the reduced buffers.
"""

from __future__ import annotations

import contextlib
import logging
import math
import weakref

import torch
from megatron.core.distributed import (
    DistributedDataParallel,
    DistributedDataParallelConfig,
    finalize_model_grads,
)

from megatron_rl.backend.cpu import cpu_backend_active
from megatron_rl.backend.cpu_optimizer import cuda_type_names, foreach_adam
from megatron_rl.backend.grad_check import all_finite
from megatron_rl.backend.grad_norm import GradNormPlan
from megatron_rl.backend.one_rank_grad_sync import skip_one_rank_grad_reduction
from megatron_rl.backend.optimizer_config import OptimizerConfig
from megatron_rl.collectives import all_ranks_agree

logger = logging.getLogger(__name__)

# Every model `wrap_for_training` wrapped and that is still alive (see `release_wrapped_models`).
_WRAPPED: weakref.WeakSet[DistributedDataParallel] = weakref.WeakSet()


def megatron_optimizer_config(config: OptimizerConfig, model_config):
    """megatron-core's ``OptimizerConfig`` for ``config`` and the model's ``TransformerConfig``.

    CPU offload is megatron's ``optimizer_cpu_offload`` (+ ``optimizer_offload_fraction``), which
    megatron runs only through its precision-aware optimizer path
    (``use_precision_aware_optimizer``: distributed optimizer and Adam; Megatron-LM's own argument
    checks require the same); master weights, gradients and Adam moments stay fp32, as without
    offload.
    """
    from megatron.core.optimizer import OptimizerConfig as MegatronOptimizerConfig

    return MegatronOptimizerConfig(
        optimizer="adam",
        lr=config.lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        clip_grad=max(config.clip_grad, 0.0),
        bf16=model_config.bf16,
        params_dtype=model_config.params_dtype,
        use_distributed_optimizer=config.use_distributed_optimizer,
        optimizer_cpu_offload=config.offloads,
        optimizer_offload_fraction=config.offload_fraction if config.offloads else 0.0,
        use_precision_aware_optimizer=config.offloads,
    )


def wrap_for_training(
    model: torch.nn.Module,
    *,
    use_distributed_optimizer: bool = True,
    overlap_grad_reduce: bool = False,
) -> DistributedDataParallel:
    """megatron-core DDP around ``model`` (fp32 grad buffers; sharded for the distributed
    optimizer, which must then be chosen in `OptimizerConfig` too).

    ``overlap_grad_reduce``: bucketed gradient reductions start during the backward of the last
    micro-batch (the caller runs the others under ``model.no_sync()``). Parameter all-gather
    overlap is not offered: megatron would delay it to the next forward, and the weight sync reads
    the parameters right after the update.
    """
    ddp_config = DistributedDataParallelConfig(
        grad_reduce_in_fp32=True,
        use_distributed_optimizer=use_distributed_optimizer,
        overlap_grad_reduce=overlap_grad_reduce,
    )
    wrapped = DistributedDataParallel(model.config, ddp_config, model)
    skip_one_rank_grad_reduction(wrapped)  # a reduction over one rank is the identity
    _WRAPPED.add(wrapped)
    return wrapped


def release_wrapped_models() -> None:
    """Break the reference cycles that keep every wrapped model alive.

    megatron-core's DDP hooks each parameter's gradient accumulator with a closure holding the
    DDP, and the model keeps the last forward's autograd graph (e.g. the MoE token dispatcher's
    ``probs``), which reaches those accumulators: a cycle through autograd's C++ nodes that
    Python's collector cannot see. Such a model is never freed, and it keeps its process groups
    alive after they are destroyed: gloo runs two threads per group, and each idle group costs
    ~0.15% of a core (measured: 200 groups, 0.3 core). Dropping the accumulators and the graphs
    the modules hold frees the model once its last outside reference goes; its gradients no
    longer reach the buffers. Call this only when the models are done with
    (`destroy_distributed` does).
    """
    for model in list(_WRAPPED):
        model.grad_accs.clear()
        for module in model.modules():
            _drop_autograd_graphs(module)
    _WRAPPED.clear()


def _drop_autograd_graphs(module: torch.nn.Module) -> None:
    """Set to None every tensor attribute of ``module``, or of a plain (non-module) object it
    holds, that carries an autograd graph (parameters and buffers are leaves: kept)."""
    owners = [module] + [
        value
        for value in vars(module).values()
        if hasattr(value, "__dict__") and not isinstance(value, (torch.nn.Module, type))
    ]
    for owner in owners:
        for name, value in list(vars(owner).items()):
            if isinstance(value, torch.Tensor) and value.grad_fn is not None:
                setattr(owner, name, None)


class PolicyOptimizer:
    """``zero_grad()`` before the micro-batches, ``step()`` after their backward passes."""

    def __init__(self, model: DistributedDataParallel, config: OptimizerConfig) -> None:
        from megatron.core.optimizer import get_megatron_optimizer

        sharded_buffers = model.ddp_config.use_distributed_optimizer
        if sharded_buffers != config.use_distributed_optimizer:
            raise ValueError(
                f"OptimizerConfig.use_distributed_optimizer={config.use_distributed_optimizer} "
                f"but the model was wrapped with use_distributed_optimizer={sharded_buffers}; "
                "pass the same choice to wrap_for_training"
            )
        self.model = model
        self.config = config
        if config.offloads and cpu_backend_active():
            raise ValueError(
                "--optimizer-cpu-offload needs CUDA: megatron's HybridDeviceOptimizer moves the "
                "optimizer state between GPU and host memory (on the CPU backend it already is "
                "in host memory); drop the flag"
            )
        megatron_config = megatron_optimizer_config(config, model.config)
        with self._megatron_calls():
            self.inner = get_megatron_optimizer(megatron_config, [model])
        self._torch_optimizers = [
            sub.optimizer
            for sub in self.inner.chained_optimizers
            if isinstance(getattr(sub, "optimizer", None), torch.optim.Optimizer)
        ]
        self._create_state()
        # the buffer-level norm/clip/finite check (built on the first step) where megatron runs
        # its torch fallbacks, its grads are fp32 buffer views and nothing else sits between
        # its norm and its update; the same choice on every rank
        self._buffer_step = (
            cpu_backend_active()
            and model.ddp_config.grad_reduce_in_fp32
            and _plain_adam_step(megatron_config)
        )
        self._plan: GradNormPlan | None = None
        logger.info(
            "optimizer: megatron %s Adam%s",
            "distributed" if sharded_buffers else "non-distributed",
            f", {config.offload_fraction:.0%} of its state on the CPU" if config.offloads else "",
        )

    def _create_state(self) -> None:
        """Adam's moments from construction, not from the first step: zeros at step 0, what
        Adam creates lazily, so the first update is unchanged (tested). The first ``--colocate``
        offload then already holds every byte a later step holds, and its host arena is built
        once instead of again after step 1. megatron's own ``init_state_fn`` (what its
        checkpoint loading runs) makes the moments, for torch's Adam and for TE's FusedAdam
        (``initialize_state``); torch's Adam also keeps a per-parameter step count, set here."""
        with self._megatron_calls():
            for sub in self.inner.chained_optimizers:
                inner, init = getattr(sub, "optimizer", None), getattr(sub, "init_state_fn", None)
                if inner is None or init is None:
                    continue
                init(inner, sub.config)
                if isinstance(inner, torch.optim.Adam | torch.optim.AdamW):
                    _add_step_counts(inner)

    @staticmethod
    def _megatron_calls():
        """The CPU shim megatron's optimizer needs around each call (nothing on GPU)."""
        return cuda_type_names() if cpu_backend_active() else contextlib.nullcontext()

    @property
    def param_groups(self) -> list[dict]:
        return self.inner.param_groups

    def set_lr(self, lr: float) -> None:
        """Every parameter group's learning rate (the warmup sets it before each step)."""
        for group in self.param_groups:
            group["lr"] = lr

    def zero_grad(self) -> None:
        self.model.zero_grad_buffer()
        self.inner.zero_grad()

    def step(self) -> float | None:
        """Finalise grads (DP/SP/embedding reductions), clip, update; returns the grad norm.

        When any gradient is non-finite on any rank, nothing is updated and None is returned on
        every rank (the caller zeroes the gradients and counts the skip; the reductions have
        completed).
        """
        finalize_model_grads([self.model])
        if not self._buffer_step:
            if not all_ranks_agree(self._grads_finite()):
                return None
            with self._megatron_calls():
                succeeded, grad_norm, _ = self.inner.step()
            return _checked(succeeded, grad_norm)
        # megatron's ChainedOptimizer.step, its norm and clipping over the buffers
        with self._megatron_calls():
            self.inner.prepare_grads()  # grads onto the optimizers' params: buffer views
            if self._plan is None:
                self._plan = GradNormPlan.build(self.inner)
            grad_norm = self._plan.norm()  # non-finite iff a gradient is, on every rank alike
            if not math.isfinite(grad_norm):
                return None
            self._plan.clip_(grad_norm)
            with foreach_adam(self._torch_optimizers, fused=self.config.cpu_adam == "fused"):
                succeeded = self.inner.step_with_ready_grads()
        return _checked(succeeded, grad_norm)

    def skip(self) -> None:
        """Skip this update: complete the gradient reductions every rank entered (under
        ``--overlap-grad-reduce`` megatron's DDP launched them asynchronously during the last
        micro-batch's backward; left un-waited, the next update asserts "Should not have
        multiple communication calls outstanding at once"), then zero the gradients.
        Collective: every rank calls it when the step is skipped."""
        finalize_model_grads([self.model])
        self.zero_grad()

    def _grads_finite(self) -> bool:
        """Whether this rank's reduced gradient buffers hold only finite values."""
        buffers = self.model.buffers + self.model.expert_parallel_buffers
        return all_finite(buffer.grad_data for buffer in buffers)  # chunked: no buffer copy

    def state_dict(self) -> dict:
        with self._megatron_calls():
            return self.inner.state_dict()


def _add_step_counts(adam: torch.optim.Optimizer) -> None:
    """torch's Adam/AdamW per-parameter ``step`` (0, as its first step would create it: a
    float32 scalar, on the parameter's device when fused or capturable) and ``max_exp_avg_sq``
    under amsgrad, where the moments exist already."""
    scalar = torch.float64 if torch.get_default_dtype() == torch.float64 else torch.float32
    for group in adam.param_groups:
        on_device = group.get("fused") or group.get("capturable")
        for param in group["params"]:
            state = adam.state[param]
            if "exp_avg" not in state or "step" in state:
                continue
            device = param.device if on_device else torch.device("cpu")
            state["step"] = torch.zeros((), dtype=scalar, device=device)
            if group.get("amsgrad"):
                state["max_exp_avg_sq"] = torch.zeros_like(
                    param, memory_format=torch.preserve_format
                )


def _plain_adam_step(config) -> bool:
    """Whether megatron's step is prepare, norm, clip, update and nothing more for ``config``
    (megatron's ``OptimizerConfig``): no loss scale, no zero counting, no precision-aware Adam."""
    return not (
        config.fp16
        or config.loss_scale
        or config.log_num_zeros_in_grad
        or config.use_precision_aware_optimizer
    )


def _checked(succeeded: bool, grad_norm: float | None) -> float:
    """``grad_norm`` of an update megatron made after finite gradients; RuntimeError if it
    reports a failed update or a non-finite norm."""
    if not succeeded or grad_norm is None or not math.isfinite(grad_norm):
        raise RuntimeError(
            f"megatron's optimizer step returned success={succeeded}, grad norm={grad_norm} "
            "after finite gradients: the update may be partial; stop and resume from the last "
            "checkpoint"
        )
    return float(grad_norm)


def build_optimizer(model: DistributedDataParallel, config: OptimizerConfig) -> PolicyOptimizer:
    """megatron-core's optimizer for ``model`` (see the module docstring)."""
    return PolicyOptimizer(model, config)
