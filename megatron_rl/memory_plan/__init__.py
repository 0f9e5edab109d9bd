"""Per-GPU memory of a Qwen3-MoE training layout on megatron-core, with a fits / no-fit verdict.

Exact (counted from the architecture and megatron-core's parameter layout):

* parameters, split into *dense* (attention, norms, router, shared experts, embedding on the first
  pipeline stage, output layer + final norm on the last; tensor-parallel where megatron splits
  them) and *expert* (routed experts: ``E / EP`` local experts, each split by ETP), in the param
  dtype. Counts per stage come from `stage_params`;
* gradient buffers: megatron DDP with ``grad_reduce_in_fp32=True`` keeps one fp32 ``main_grad``
  per local parameter (not sharded, also with the distributed optimizer), in a dense buffer and,
  when EP > 1, an expert buffer. With the distributed optimizer megatron pads each parameter's
  start to 64 elements and each bucket's end to ``lcm(group, 128)``, and moves the parameters
  into a padded buffer of the same layout: `megatron_buffer` replays that layout (megatron-core
  0.16, ``overlap_grad_reduce=False``: one bucket per buffer);
* optimizer state: Adam ``m`` and ``v`` in fp32, plus an fp32 master copy when params are bf16.
  With the distributed optimizer each bucket is cut into equal shards over its group, the
  data-parallel x context-parallel group for the dense buffer and the expert-data-parallel group
  ``world / (ETP * EP * PP)`` for the expert one (megatron puts expert params in the dense buffer
  when EP == 1, so then they shard like dense ones); a rank keeps state for the parameter
  elements inside its shard, and the plan reports the fullest rank. With optimizer CPU offload
  (megatron's ``HybridDeviceOptimizer``, ``optimizer_offload_fraction`` f) the first f of the
  rank's shard elements keep their master copy, m and v in host memory (plus a pinned fp32
  gradient copy there); the rest stay on the GPU. megatron moves whole shard tensors, so the split
  is exact up to one tensor;
* routing-replay state (`megatron_rl.routing.memory`): R2 recordings live on the GPU, R3 routes
  travel with the samples on the host; plus the int64 targets of the live micro-batch;
* reference model (KL): its parameters, in the policy's param dtype, when kept on the GPU.

Estimated (see `layer_activation_bytes`, `attention_bytes`): activations, the micro-batch logits,
the fp32 log-prob / entropy tile, the optimizer step's temporaries, and a fixed reserve for the CUDA
context, NCCL buffers and allocator fragmentation.

The peak is taken on a timeline: the terms above that live for the whole step (parameters, buffers,
optimizer state, routing state, reference, reserve, the local spec's attention-scores buffer) plus
the largest of the *phases* (`stage_phases`): the last layer's attention in the forward, the
log-probs (logits and their gradient, last stage), a recomputed layer's backward, the last layer's
attention in the backward, the old-logprob pass, and the optimizer step (the trainer's gradient
check, Adam). What a phase frees before another starts (logits before the layers' backward,
activations before the step) is not counted in the other.

This package reads a HF config's attributes only; it imports neither megatron-core nor
transformers (`load_model_config` imports transformers to build a config by name).

Modules: `shape` (the model), `layout` (parallel sizes), `options` (training choices), `terms`
(`Term`, `Phase`), `params` (weights and grad buffers, exact), `static` (the terms live for the
whole step), `activations` (per-layer, attention core, stored activations: estimates), `phases`
(the step's phases), `schedule` (the pipeline schedule: megatron's warm-up, the (chunk,
micro-batch) pairs in flight under 1F1B or interleaved 1F1B, the bubble), `plan` (`plan_memory`,
the peak and the verdict, `PipelineSchedule`), `colocate`
(`plan_colocated`: SGLang servers on the trainer's GPUs, the KV budget, mem-fraction-static).
The pipeline layer split is `megatron_rl.model.stages.megatron_stage_layers`, and with a virtual
pipeline (``Layout.virtual_pipeline``, megatron's interleaved schedule) each rank's chunks are
`megatron_rl.model.stages.virtual_chunk_layers`.
"""

from __future__ import annotations

from megatron_rl.memory_plan.activations import (
    ATTENTION_PART,
    LOCAL_ATTENTION_EXCESS_BYTES,
    AttentionBytes,
    StoredActivations,
    attention_bytes,
    layer_activation_bytes,
    logits_bytes,
    stored_activations,
)
from megatron_rl.memory_plan.colocate import (
    ColocatedPlan,
    ServerOptions,
    kv_bytes_per_token,
    plan_colocated,
)
from megatron_rl.memory_plan.layout import (
    Layout,
)
from megatron_rl.memory_plan.options import (
    DTYPE_BYTES,
    RECOMPUTE,
    REFERENCE,
    REPLAY,
    SPECS,
    SYNC_SENDERS,
    PlanOptions,
)
from megatron_rl.memory_plan.params import (
    GradBuffer,
    ParamTensor,
    StageParams,
    grad_buffers,
    megatron_buffer,
    stage_params,
    stage_tensors,
)
from megatron_rl.memory_plan.phases import (
    PHASE_ADAM,
    PHASE_BACKWARD,
    PHASE_END,
    PHASE_FORWARD,
    PHASE_GRAD_CHECK,
    PHASE_LOGPROBS,
    PHASE_OLD_LOGPROBS,
    PHASE_RECOMPUTED,
    stage_phases,
)
from megatron_rl.memory_plan.plan import (
    MemoryPlan,
    PipelineSchedule,
    StagePlan,
    plan_memory,
)
from megatron_rl.memory_plan.schedule import (
    RankSchedule,
    bubble_fraction,
    bubble_share,
    rank_schedule,
    warmup_micro_batches,
)
from megatron_rl.memory_plan.shape import (
    ModelShape,
    load_model_config,
)
from megatron_rl.memory_plan.static import (
    optimizer_state_bytes,
)
from megatron_rl.memory_plan.terms import (
    GIB,
    Phase,
    Term,
)

__all__ = [
    "ATTENTION_PART",
    "DTYPE_BYTES",
    "GIB",
    "LOCAL_ATTENTION_EXCESS_BYTES",
    "PHASE_ADAM",
    "PHASE_BACKWARD",
    "PHASE_END",
    "PHASE_FORWARD",
    "PHASE_GRAD_CHECK",
    "PHASE_LOGPROBS",
    "PHASE_OLD_LOGPROBS",
    "PHASE_RECOMPUTED",
    "RECOMPUTE",
    "REFERENCE",
    "REPLAY",
    "SPECS",
    "SYNC_SENDERS",
    "AttentionBytes",
    "ColocatedPlan",
    "GradBuffer",
    "Layout",
    "MemoryPlan",
    "ModelShape",
    "ParamTensor",
    "Phase",
    "PipelineSchedule",
    "PlanOptions",
    "RankSchedule",
    "ServerOptions",
    "StageParams",
    "StagePlan",
    "StoredActivations",
    "Term",
    "attention_bytes",
    "bubble_fraction",
    "bubble_share",
    "grad_buffers",
    "kv_bytes_per_token",
    "layer_activation_bytes",
    "load_model_config",
    "logits_bytes",
    "megatron_buffer",
    "optimizer_state_bytes",
    "plan_colocated",
    "plan_memory",
    "rank_schedule",
    "stage_params",
    "stage_phases",
    "stage_tensors",
    "stored_activations",
    "warmup_micro_batches",
]
