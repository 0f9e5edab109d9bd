"""The parallel layout being planned: parallel sizes, data-parallel size, pipeline layer split,
checked as megatron-core checks them."""

from __future__ import annotations

import dataclasses

from megatron_rl.memory_plan.shape import ModelShape
from megatron_rl.parallel import ParallelConfig


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Parallel sizes (`ParallelConfig`), the data-parallel size and the pipeline layer split."""

    parallel: ParallelConfig
    data_parallel: int = 1
    pipeline_layers: tuple[int, ...] | None = None  # layers per stage; None: an even split

    @classmethod
    def from_world_size(
        cls,
        parallel: ParallelConfig,
        world_size: int,
        pipeline_layers: tuple[int, ...] | None = None,
    ) -> Layout:
        dense = parallel.tensor_parallel * parallel.pipeline_parallel * parallel.context_parallel
        if world_size < 1 or world_size % dense:
            raise ValueError(
                f"world size {world_size} is not a positive multiple of tensor*pipeline*context "
                f"parallel = {dense}"
            )
        return cls(
            parallel=parallel, data_parallel=world_size // dense, pipeline_layers=pipeline_layers
        )

    @property
    def world_size(self) -> int:
        p = self.parallel
        return p.tensor_parallel * p.pipeline_parallel * p.context_parallel * self.data_parallel

    @property
    def expert_data_parallel(self) -> int:
        p = self.parallel
        return self.world_size // (
            p.expert_tensor_parallel * p.expert_parallel * p.pipeline_parallel
        )

    def stage_layers(self, num_layers: int) -> tuple[int, ...]:
        pp = self.parallel.pipeline_parallel
        return self.pipeline_layers or (num_layers // pp,) * pp

    def validate(self, shape: ModelShape) -> None:
        """ValueError naming the first size that megatron-core would reject."""
        p = self.parallel
        tp, ep, etp, pp = (
            p.tensor_parallel,
            p.expert_parallel,
            p.expert_tensor_parallel,
            p.pipeline_parallel,
        )
        if not (isinstance(self.data_parallel, int) and self.data_parallel >= 1):
            raise ValueError(f"data_parallel={self.data_parallel!r}: must be an integer >= 1")
        checks = [
            (shape.num_heads, tp, "num_attention_heads", "tensor parallel"),
            (shape.num_kv_heads, tp, "num_key_value_heads", "tensor parallel"),
            (shape.vocab_size, tp, "vocab_size", "tensor parallel"),
        ]
        if not all(shape.moe_pattern):
            checks.append((shape.intermediate_size, tp, "intermediate_size", "tensor parallel"))
        if shape.shared_expert_size:
            checks.append(
                (shape.shared_expert_size, tp, "shared_expert_intermediate_size", "tensor parallel")
            )
        if shape.num_moe_layers:
            checks += [
                (shape.num_experts, ep, "num_experts", "expert parallel"),
                (
                    shape.moe_intermediate_size,
                    etp,
                    "moe_intermediate_size",
                    "expert tensor parallel",
                ),
            ]
        for value, size, what, parallel in checks:
            if value % size:
                raise ValueError(f"{what}={value} is not divisible by {parallel} size {size}")
        expert_model = etp * ep * pp
        if self.world_size % expert_model:
            raise ValueError(
                f"world size {self.world_size} (tp*pp*cp*dp) is not divisible by expert-tensor * "
                f"expert * pipeline parallel = {etp}*{ep}*{pp}; change EP/ETP or the world size"
            )
        if self.pipeline_layers is None:
            if shape.num_layers % pp:
                raise ValueError(
                    f"num_hidden_layers={shape.num_layers} is not divisible by pipeline parallel "
                    f"size {pp}; give the layers of each stage (pipeline_layers)"
                )
            return
        layers = self.pipeline_layers
        if len(layers) != pp or sum(layers) != shape.num_layers or min(layers) < 1:
            raise ValueError(
                f"pipeline_layers={list(layers)}: need {pp} stages of >= 1 layers summing to "
                f"{shape.num_layers}"
            )
        if len(set(layers[1:-1])) > 1:
            raise ValueError(
                f"pipeline_layers={list(layers)}: megatron-core sets the first and last stage "
                "(decoder_first/last_pipeline_num_layers); the middle stages must be equal"
            )
