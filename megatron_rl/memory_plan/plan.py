"""The plan: every pipeline stage's static terms and phases, the peak (static terms plus the
largest phase, fullest stage), the fits / no-fit verdict and its JSON form."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rl.memory_plan.activations import AttentionBytes, attention_bytes
from megatron_rl.memory_plan.layout import Layout
from megatron_rl.memory_plan.options import PlanOptions
from megatron_rl.memory_plan.params import StageParams, grad_buffers, stage_params
from megatron_rl.memory_plan.phases import stage_phases
from megatron_rl.memory_plan.shape import ModelShape
from megatron_rl.memory_plan.static import static_terms
from megatron_rl.memory_plan.terms import GIB, Phase, Term


@dataclasses.dataclass(frozen=True, slots=True)
class StagePlan:
    """A GPU of one pipeline stage: the terms live for the whole step and the phases."""

    params: StageParams
    static: tuple[Term, ...]
    phases: tuple[Phase, ...] = ()

    @property
    def peak_phase(self) -> Phase | None:
        """The phase with the most bytes (ties: the later one)."""
        return max(reversed(self.phases), key=lambda phase: phase.nbytes, default=None)

    @property
    def terms(self) -> tuple[Term, ...]:
        """The static terms and those of the peak phase: what is live at the peak."""
        peak = self.peak_phase
        return self.static + (peak.terms if peak else ())

    @property
    def gpu_bytes(self) -> int:
        return sum(term.nbytes for term in self.terms if term.on_gpu)

    def term(self, name: str) -> Term:
        """The term called ``name`` live at the peak (else the first phase that has one)."""
        every = self.terms + tuple(t for phase in self.phases for t in phase.terms)
        return next(term for term in every if term.name == name)


@dataclasses.dataclass(frozen=True, slots=True)
class MemoryPlan:
    shape: ModelShape
    layout: Layout
    options: PlanOptions
    stages: tuple[StagePlan, ...]
    gpu_gib: float

    @property
    def peak(self) -> StagePlan:
        """The stage whose GPUs need the most memory."""
        return max(self.stages, key=lambda stage: stage.gpu_bytes)

    @property
    def total_bytes(self) -> int:
        return self.peak.gpu_bytes

    @property
    def fits(self) -> bool:
        return self.total_bytes <= self.gpu_gib * GIB

    @property
    def attention(self) -> AttentionBytes:
        """The attention core of one micro-batch (the same on every stage)."""
        return attention_bytes(self.shape, self.layout, self.options)

    def to_dict(self) -> dict[str, Any]:
        p = self.layout.parallel

        def terms(items: tuple[Term, ...]) -> list[dict[str, Any]]:
            return [
                {
                    "name": term.name,
                    "bytes": term.nbytes,
                    "gib": round(term.gib, 4),
                    "exact": term.exact,
                    "on_gpu": term.on_gpu,
                    "note": term.note,
                }
                for term in items
            ]

        def phases(stage: StagePlan) -> list[dict[str, Any]]:
            return [
                {
                    "name": phase.name,
                    "bytes": phase.nbytes,
                    "gib": round(phase.nbytes / GIB, 4),
                    "terms": terms(phase.terms),
                }
                for phase in stage.phases
            ]

        return {
            "model": {
                **dataclasses.asdict(self.shape),
                "total_params": self.shape.total_params(),
                "active_params": self.shape.total_params(active=True),
            },
            "layout": {
                "tensor_parallel": p.tensor_parallel,
                "pipeline_parallel": p.pipeline_parallel,
                "expert_parallel": p.expert_parallel,
                "expert_tensor_parallel": p.expert_tensor_parallel,
                "context_parallel": p.context_parallel,
                "sequence_parallel": p.sequence_parallel,
                "data_parallel": self.layout.data_parallel,
                "expert_data_parallel": self.layout.expert_data_parallel,
                "world_size": self.layout.world_size,
                "pipeline_layers": list(self.layout.stage_layers(self.shape.num_layers)),
            },
            "options": dataclasses.asdict(self.options),
            "stages": [
                {
                    "stage": stage.params.stage,
                    "layers": stage.params.layers,
                    "moe_layers": stage.params.moe_layers,
                    "dense_params": stage.params.dense,
                    "expert_params": stage.params.expert,
                    "adapter_params": stage.params.adapters,
                    "gpu_bytes": stage.gpu_bytes,
                    "gpu_gib": round(stage.gpu_bytes / GIB, 4),
                    "peak_phase": stage.peak_phase.name,
                    "terms": terms(stage.terms),  # static + the peak phase's: they sum to gpu_bytes
                    "phases": phases(stage),
                }
                for stage in self.stages
            ],
            "attention": {"spec": self.options.spec, **dataclasses.asdict(self.attention)},
            "peak_stage": self.peak.params.stage,
            "peak_phase": self.peak.peak_phase.name,
            "total_bytes": self.total_bytes,
            "total_gib": round(self.total_bytes / GIB, 4),
            "gpu_gib": self.gpu_gib,
            "fits": self.fits,
        }


def plan_memory(
    config, layout: Layout, options: PlanOptions | None = None, *, gpu_gib: float = 80.0
) -> MemoryPlan:
    """Per-GPU memory of every pipeline stage of ``layout`` for HF config (or `ModelShape`)."""
    shape = config if isinstance(config, ModelShape) else ModelShape.from_hf(config)
    options = options or PlanOptions()
    layout.validate(shape)
    if gpu_gib <= 0:
        raise ValueError(f"gpu_gib={gpu_gib}: must be > 0")
    if options.spec == "local" and layout.parallel.context_parallel > 1:
        raise ValueError(
            "the local spec has no context parallelism (megatron's DotProductAttention asserts "
            "context_parallel_size == 1); use spec='te'"
        )
    stages = []
    for stage in range(layout.parallel.pipeline_parallel):
        lora = options.lora()
        params = stage_params(shape, layout, stage, spec=options.spec, lora=lora)
        buffers = grad_buffers(
            shape,
            layout,
            stage,
            distributed_optimizer=options.distributed_optimizer,
            spec=options.spec,
            lora=lora,
        )
        static, elements = static_terms(shape, layout, options, params, buffers)
        phases = stage_phases(shape, layout, options, params, buffers, elements)
        stages.append(StagePlan(params, tuple(static), tuple(phases)))
    return MemoryPlan(shape, layout, options, tuple(stages), float(gpu_gib))
