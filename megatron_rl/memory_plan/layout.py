"""The parallel layout being planned: parallel sizes, data-parallel size, pipeline layer split and
virtual pipeline (model chunks per pipeline rank), checked as megatron-core checks them."""

from __future__ import annotations

import dataclasses

from megatron_rl.memory_plan.shape import ModelShape
from megatron_rl.parallel import ParallelConfig


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Layout:
    """Parallel sizes (`ParallelConfig`), the data-parallel size, the pipeline layer split and
    the virtual pipeline size (megatron's ``virtual_pipeline_model_parallel_size``: model chunks
    per pipeline rank, each stage's layers split evenly over them; 1: plain 1F1B)."""

    parallel: ParallelConfig
    data_parallel: int = 1
    pipeline_layers: tuple[int, ...] | None = None  # layers per stage; None: an even split
    virtual_pipeline: int = 1

    @classmethod
    def from_world_size(
        cls,
        parallel: ParallelConfig,
        world_size: int,
        pipeline_layers: tuple[int, ...] | None = None,
        virtual_pipeline: int = 1,
    ) -> Layout:
        dense = parallel.tensor_parallel * parallel.pipeline_parallel * parallel.context_parallel
        if world_size < 1 or world_size % dense:
            raise ValueError(
                f"world size {world_size} is not a positive multiple of tensor*pipeline*context "
                f"parallel = {dense}"
            )
        return cls(
            parallel=parallel,
            data_parallel=world_size // dense,
            pipeline_layers=pipeline_layers,
            virtual_pipeline=virtual_pipeline,
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

    def chunk_layers(self, num_layers: int) -> tuple[tuple[tuple[int, int], ...], ...]:
        """``[pp_rank][chunk] -> (first global layer, layer count)``: one chunk per rank, its
        stage, without a virtual pipeline; else megatron's interleaved split
        (`megatron_rl.model.stages.virtual_chunk_layers`: chunk ``c`` of rank ``r`` is virtual
        stage ``c * PP + r``, ``stage layers / V`` layers each)."""
        stages = self.stage_layers(num_layers)
        if self.virtual_pipeline == 1:
            return tuple(((sum(stages[:r]), n),) for r, n in enumerate(stages))
        from megatron_rl.model.stages import virtual_chunk_layers

        pp = self.parallel.pipeline_parallel
        first, last = (stages[0], stages[-1]) if self.pipeline_layers else (None, None)
        return virtual_chunk_layers(num_layers, pp, self.virtual_pipeline, first, last)

    def rank_layers(self, num_layers: int, stage: int) -> tuple[int, ...]:
        """The global layer numbers pipeline rank ``stage`` holds, in chunk order."""
        return tuple(
            layer
            for first, count in self.chunk_layers(num_layers)[stage]
            for layer in range(first, first + count)
        )

    def validate(self, shape: ModelShape) -> None:
        """ValueError naming the first size that megatron-core would reject."""
        p = self.parallel
        tp, ep, etp, pp = (
            p.tensor_parallel,
            p.expert_parallel,
            p.expert_tensor_parallel,
            p.pipeline_parallel,
        )
        for name in ("data_parallel", "virtual_pipeline"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        if self.virtual_pipeline > 1 and pp == 1:
            raise ValueError(
                f"virtual_pipeline={self.virtual_pipeline} needs pipeline parallel size > 1 "
                "(megatron's interleaved schedule)"
            )
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
        self._validate_stages(shape)
        self.chunk_layers(shape.num_layers)  # ValueError where a stage's layers do not split

    def _validate_stages(self, shape: ModelShape) -> None:
        pp = self.parallel.pipeline_parallel
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
