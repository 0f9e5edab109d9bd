"""The plan: every pipeline stage's static terms and phases, the peak (static terms plus the
largest phase, fullest stage), the pipeline schedule (in flight, bubble), the fits / no-fit verdict
and its JSON form."""

from __future__ import annotations

import dataclasses
from typing import Any

from megatron_rl.memory_plan.activations import (
    AttentionBytes,
    StoredActivations,
    attention_bytes,
    stored_activations,
)
from megatron_rl.memory_plan.layout import Layout
from megatron_rl.memory_plan.options import PlanOptions
from megatron_rl.memory_plan.params import StageParams, grad_buffers, stage_params
from megatron_rl.memory_plan.phases import stage_phases
from megatron_rl.memory_plan.schedule import bubble_fraction, bubble_share
from megatron_rl.memory_plan.shape import ModelShape
from megatron_rl.memory_plan.static import static_terms
from megatron_rl.memory_plan.terms import GIB, Phase, Term
from megatron_rl.model.stages import interleaved_group_size


@dataclasses.dataclass(frozen=True, slots=True)
class StagePlan:
    """A GPU of one pipeline stage: the terms live for the whole step and the phases."""

    params: StageParams
    static: tuple[Term, ...]
    phases: tuple[Phase, ...] = ()
    stored: StoredActivations | None = None  # the schedule's in-flight activations

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
class PipelineSchedule:
    """The layout's pipeline schedule (`megatron_rl.memory_plan.schedule`): ``PP`` stages of
    ``V`` chunks, ``M`` micro-batches per update on a data-parallel rank (None: not known) in
    groups of ``N``; per rank megatron's warm-up forwards and the most (chunk, micro-batch) pairs
    in flight; the bubble, ``(PP - 1) / (V M)`` of the ideal time (``(PP - 1) / M`` with plain
    1F1B) and ``(PP - 1) / (V M + PP - 1)`` of the step (None without ``M``; 0 without a
    pipeline), and plain 1F1B's for comparison."""

    pipeline_parallel: int
    virtual_pipeline: int
    micro_batches: int | None
    group_size: int | None
    warmup: tuple[int, ...]
    in_flight: tuple[int, ...]
    bubble: float | None
    bubble_share: float | None
    bubble_1f1b: float | None

    @property
    def schedule(self) -> str:
        return "interleaved 1F1B" if self.virtual_pipeline > 1 else "1F1B"


def pipeline_schedule(
    layout: Layout, options: PlanOptions, stages: tuple[StagePlan, ...]
) -> PipelineSchedule:
    """The `PipelineSchedule` of ``layout`` at ``options.micro_batches``, with each stage's
    warm-up and pairs in flight from its `StoredActivations`."""
    pp, v, m = layout.parallel.pipeline_parallel, layout.virtual_pipeline, options.micro_batches
    if pp == 1:
        bubble = share = plain = 0.0
    elif m is None:
        bubble = share = plain = None
    else:
        bubble, share = bubble_fraction(pp, v, m), bubble_share(pp, v, m)
        plain = bubble_fraction(pp, 1, m)
    return PipelineSchedule(
        pipeline_parallel=pp,
        virtual_pipeline=v,
        micro_batches=m,
        group_size=interleaved_group_size(m, pp) if v > 1 and m is not None else None,
        warmup=tuple(stage.stored.warmup for stage in stages if stage.stored),
        in_flight=tuple(stage.stored.in_flight for stage in stages if stage.stored),
        bubble=bubble,
        bubble_share=share,
        bubble_1f1b=plain,
    )


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
    def pipeline(self) -> PipelineSchedule:
        """The layout's pipeline schedule: its warm-up, in-flight micro-batches and bubble."""
        return pipeline_schedule(self.layout, self.options, self.stages)

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
                "virtual_pipeline": self.layout.virtual_pipeline,
                "chunk_layers": [
                    [list(chunk) for chunk in rank]
                    for rank in self.layout.chunk_layers(self.shape.num_layers)
                ],
            },
            "pipeline": dataclasses.asdict(self.pipeline),
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
                    "warmup_micro_batches": stage.stored.warmup,
                    "in_flight": stage.stored.in_flight,
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
    if layout.virtual_pipeline > 1:
        if options.micro_batches is not None:
            interleaved_group_size(options.micro_batches, layout.parallel.pipeline_parallel)
        if options.lora().enabled:
            raise ValueError(
                "LoRA with a virtual pipeline: the trainer refuses it (plain pipeline stages)"
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
        stored = stored_activations(shape, layout, options, params)
        phases = stage_phases(shape, layout, options, params, buffers, elements, stored)
        stages.append(StagePlan(params, tuple(static), tuple(phases), stored))
    return MemoryPlan(shape, layout, options, tuple(stages), float(gpu_gib))
