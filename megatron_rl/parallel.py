"""Parallel layout of a Megatron job: one validated config, importable without megatron-core.

The backend passes it to megatron's ``parallel_state``; the routing layer uses it to account for
what each rank holds.
"""

from __future__ import annotations

import dataclasses
import sys

from megatron_rl.flags import bad_value, option


@dataclasses.dataclass(kw_only=True, slots=True)
class ParallelConfig:
    """Model-parallel sizes; data parallel is whatever remains of the world size.

    ``expert_tensor_parallel`` None: 1 with expert parallelism (experts kept whole, as megatron's
    and slime's MoE recipes do), ``tensor_parallel`` without it. With ``expert_parallel == 1``
    megatron-core treats expert weights as dense parameters (``allreduce=True``): their
    gradients are reduced over the dense data-parallel group only, so the tensor-parallel ranks,
    which route different tokens under sequence parallelism, must split the experts the way they
    split dense layers (``expert_tensor_parallel == tensor_parallel``); otherwise each rank keeps
    the expert gradient of its own tokens (measured: half of the true gradient's terms missing).
    """

    tensor_parallel: int = option(1, name="tensor-model-parallel-size", help="TP size")
    expert_parallel: int = option(1, name="expert-model-parallel-size", help="EP size")
    pipeline_parallel: int = option(1, name="pipeline-model-parallel-size", help="PP size")
    context_parallel: int = option(1, name="context-parallel-size", help="CP size")
    expert_tensor_parallel: int | None = None  # None: see the class docstring
    sequence_parallel: bool | None = option(
        None, help="shard activations over the TP ranks (needs TP > 1; None: on with TP > 1)"
    )
    seed: int = option(1234, help="seed of the model, the sampler and the rollouts")

    def __post_init__(self) -> None:
        if self.expert_tensor_parallel is None:
            self.expert_tensor_parallel = 1 if self.expert_parallel > 1 else self.tensor_parallel
        for name in (
            "tensor_parallel",
            "expert_parallel",
            "pipeline_parallel",
            "context_parallel",
            "expert_tensor_parallel",
        ):
            value = getattr(self, name)
            if not isinstance(value, int) or value < 1:
                raise bad_value(self, name, "must be an integer >= 1")
        if self.expert_parallel == 1 and self.expert_tensor_parallel != self.tensor_parallel:
            raise ValueError(
                f"ParallelConfig.expert_tensor_parallel={self.expert_tensor_parallel} with "
                f"expert_parallel=1 must equal tensor_parallel={self.tensor_parallel}: megatron "
                "reduces expert gradients like dense ones when experts are not expert-parallel; "
                "leave it unset (None) or use expert_parallel > 1"
            )
        if self.sequence_parallel is None:
            self.sequence_parallel = self.tensor_parallel > 1
        if self.sequence_parallel and self.tensor_parallel == 1:
            raise ValueError(
                "--sequence-parallel needs --tensor-model-parallel-size > 1 "
                "(ParallelConfig.sequence_parallel, tensor_parallel)"
            )

    def check_world_size(self, world_size: int) -> None:
        """Raise ValueError if ``world_size`` is not a multiple of the model-parallel sizes."""
        dense = self.tensor_parallel * self.pipeline_parallel * self.context_parallel
        expert = self.expert_parallel * self.expert_tensor_parallel * self.pipeline_parallel
        for what, size in (("tensor*pipeline*context", dense), ("expert*pipeline", expert)):
            if world_size % size:
                raise ValueError(
                    f"world size {world_size} is not divisible by {what} parallel size {size}; "
                    "change ParallelConfig or the number of ranks"
                )


def initialized_parallel_state():
    """megatron's ``parallel_state`` when it is imported and its groups are initialised, else
    None. Imports nothing: a process that never imported megatron has no megatron groups."""
    module = sys.modules.get("megatron.core.parallel_state")
    if module is None or not module.model_parallel_is_initialized():
        return None
    return module
