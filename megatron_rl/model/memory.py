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

This module reads a HF config's attributes only; it imports neither megatron-core nor
transformers (`load_model_config` imports transformers to build a config by name).
"""

from __future__ import annotations

import bisect
import dataclasses
import math
import os
from typing import Any

from megatron_rl.backend.grad_check import GRAD_CHECK_CHUNK_ELEMENTS
from megatron_rl.moe_layers import moe_layer_pattern
from megatron_rl.parallel import ParallelConfig
from megatron_rl.routing.codec import CODECS, RoutingCodec
from megatron_rl.routing.memory import local_counts

GIB = 1024**3
DTYPE_BYTES = {"bfloat16": 2, "float32": 4}
RECOMPUTE = ("full", "none")
REFERENCE = ("off", "gpu", "cpu")
REPLAY = ("off", "r2", "r3")
SPECS = ("te", "local")  # megatron layer spec: Transformer Engine (fused attention) or local

# The local spec's unfused attention on an H200 (tools/gpu_smoke.py, Qwen3-30B-A3B-shaped 2-layer
# slice, bf16, one sequence of 8,192 tokens) keeps about one fp32 [heads, s, s] tensor more at its
# training peak than the tensors `attention_bytes` reads from megatron's and torch's code (which a
# CPU run of the same code confirms, and which match the H200's no-grad pass to 1%): 4 bytes per
# attention-matrix element, counted once per micro-batch at the attention phases of a training
# pass. Measured, not derived (see `attention_bytes`).
LOCAL_ATTENTION_EXCESS_BYTES = 4


def load_model_config(model: str | os.PathLike, **overrides: Any):
    """A HF ``Qwen3MoeConfig``: a preset name or a checkpoint folder, with config attributes
    ``overrides`` (e.g. ``num_hidden_layers=2``: the GPU smoke's slice)."""
    from megatron_rl.model.presets import PRESET_NAMES, load_hf_config, preset_config

    name = os.fspath(model)
    if name in PRESET_NAMES:
        return preset_config(name, **overrides)
    if not os.path.exists(name):
        known = ", ".join(PRESET_NAMES)
        raise ValueError(f"model {name!r} is neither a preset ({known}) nor a path")
    config = load_hf_config(name)
    for key, value in overrides.items():
        setattr(config, key, value)
    return config


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


# ---------------------------------------------------------------------------- architecture
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class ModelShape:
    """What the memory plan needs of a HF Qwen3-MoE config."""

    vocab_size: int
    hidden_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    intermediate_size: int  # dense-layer FFN (mlp_only_layers)
    moe_intermediate_size: int
    num_experts: int
    topk: int
    shared_expert_size: int = 0  # 0: no shared expert
    attention_bias: bool = False
    tied_embeddings: bool = False
    moe_pattern: tuple[int, ...] = ()

    @classmethod
    def from_hf(cls, config) -> ModelShape:
        head_dim = getattr(config, "head_dim", None) or (
            config.hidden_size // config.num_attention_heads
        )
        return cls(
            vocab_size=int(config.vocab_size),
            hidden_size=int(config.hidden_size),
            num_layers=int(config.num_hidden_layers),
            num_heads=int(config.num_attention_heads),
            num_kv_heads=int(config.num_key_value_heads),
            head_dim=int(head_dim),
            intermediate_size=int(config.intermediate_size),
            moe_intermediate_size=int(config.moe_intermediate_size),
            num_experts=int(getattr(config, "num_experts", 0) or 0),
            topk=int(config.num_experts_per_tok),
            shared_expert_size=int(getattr(config, "shared_expert_intermediate_size", 0) or 0),
            attention_bias=bool(getattr(config, "attention_bias", False)),
            tied_embeddings=bool(getattr(config, "tie_word_embeddings", False)),
            moe_pattern=tuple(moe_layer_pattern(config)),
        )

    @property
    def num_moe_layers(self) -> int:
        return sum(self.moe_pattern)

    # unsplit parameter counts of the pieces of one layer
    @property
    def qkv_width(self) -> int:
        return (self.num_heads + 2 * self.num_kv_heads) * self.head_dim

    def attention_params(self) -> int:
        """linear_qkv (+ bias) and linear_proj."""
        h = self.hidden_size
        bias = self.qkv_width if self.attention_bias else 0
        return self.qkv_width * h + bias + self.num_heads * self.head_dim * h

    def norm_params(self) -> int:
        """input and pre-MLP RMSNorm (hidden) + q/k RMSNorm (head_dim)."""
        return 2 * self.hidden_size + 2 * self.head_dim

    def expert_params(self) -> int:
        """One routed expert: SwiGLU fc1 (gate + up) and fc2."""
        return 3 * self.moe_intermediate_size * self.hidden_size

    def shared_expert_params(self) -> int:
        """Shared expert fc1 + fc2 and its sigmoid gate ``[1, hidden]``; 0 when absent."""
        if not self.shared_expert_size:
            return 0
        return 3 * self.shared_expert_size * self.hidden_size + self.hidden_size

    def dense_mlp_params(self) -> int:
        return 3 * self.intermediate_size * self.hidden_size

    def total_params(self, *, active: bool = False) -> int:
        """Parameters of the whole model (tied embeddings once); ``active``: top-k experts only."""
        h, n = self.hidden_size, 0
        for sparse in self.moe_pattern:
            n += self.attention_params() + self.norm_params()
            if sparse:
                experts = self.topk if active else self.num_experts
                n += self.num_experts * h + experts * self.expert_params()
                n += self.shared_expert_params()
            else:
                n += self.dense_mlp_params()
        embeddings = 1 if self.tied_embeddings else 2
        return n + embeddings * self.vocab_size * h + h


# ---------------------------------------------------------------------------- layout
def megatron_stage_layers(
    num_layers: int, pipeline_parallel: int, first: int | None = None, last: int | None = None
) -> tuple[int, ...]:
    """Layers per pipeline stage as megatron-core splits them from
    ``decoder_first_pipeline_num_layers`` / ``decoder_last_pipeline_num_layers`` (``first`` /
    ``last``; None: that stage is like the others): the stages in between share the remaining
    layers evenly. ValueError where megatron would refuse the split."""
    pp = pipeline_parallel
    if pp < 1:
        raise ValueError(f"pipeline parallel size {pp}: must be >= 1")
    if pp == 1:
        if first is not None or last is not None:
            raise ValueError("first / last stage layers need pipeline parallel size > 1")
        return (num_layers,)
    for name, value in (("first", first), ("last", last)):
        if value is not None and value < 1:
            raise ValueError(f"{name} stage layers={value}: must be >= 1")
    rest = num_layers - (first or 0) - (last or 0)
    middle = pp - (first is not None) - (last is not None)
    if middle == 0:
        if rest:
            raise ValueError(
                f"first {first} + last {last} layers != num_hidden_layers={num_layers} at "
                f"pipeline parallel size {pp}"
            )
        return (first, last)
    if rest < middle or rest % middle:
        raise ValueError(
            f"the {rest} layers left after the first/last stages do not split evenly over the "
            f"{middle} other pipeline stages (num_hidden_layers={num_layers}, first={first}, "
            f"last={last})"
        )
    each = rest // middle
    return (first or each, *(each,) * (pp - 2), last or each)


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


@dataclasses.dataclass(frozen=True, slots=True)
class ParamTensor:
    """One parameter tensor on a GPU, as megatron-core creates it (local spec names)."""

    name: str
    numel: int
    expert: bool = False  # a routed expert's weight (megatron: ``allreduce=False`` when EP > 1)
    shared_embedding: bool = False  # tied word embedding split over pipeline stages


@dataclasses.dataclass(frozen=True, slots=True)
class StageParams:
    """Parameter counts on one GPU of pipeline stage ``stage``."""

    stage: int
    layers: int
    moe_layers: int
    dense: int  # attention, norms, router, shared experts, embedding / output layer
    expert: int  # routed experts

    @property
    def total(self) -> int:
        return self.dense + self.expert


def stage_tensors(shape: ModelShape, layout: Layout, stage: int) -> list[ParamTensor]:
    """This GPU's parameter tensors of ``stage`` in megatron-core's ``named_parameters`` order
    (local spec; the TE spec holds the same tensors, with the norms fused into the linears)."""
    p = layout.parallel
    tp, ep, etp, pp = (
        p.tensor_parallel,
        p.expert_parallel,
        p.expert_tensor_parallel,
        p.pipeline_parallel,
    )
    per_stage = layout.stage_layers(shape.num_layers)
    first = sum(per_stage[:stage])
    h, d = shape.hidden_size, shape.head_dim
    tied_split = shape.tied_embeddings and pp > 1
    out: list[ParamTensor] = []
    if stage == 0:
        out.append(
            ParamTensor(
                "embedding.word_embeddings.weight", shape.vocab_size * h // tp, False, tied_split
            )
        )
    for offset, sparse in enumerate(shape.moe_pattern[first : first + per_stage[stage]]):
        prefix = f"decoder.layers.{offset}."
        # norms are replicated; linear_qkv is column-parallel, linear_proj row-parallel
        out += [
            ParamTensor(prefix + "input_layernorm.weight", h),
            ParamTensor(
                prefix + "self_attention.linear_proj.weight", shape.num_heads * d * h // tp
            ),
            ParamTensor(prefix + "self_attention.linear_qkv.weight", shape.qkv_width * h // tp),
        ]
        if shape.attention_bias:
            out.append(
                ParamTensor(prefix + "self_attention.linear_qkv.bias", shape.qkv_width // tp)
            )
        out += [
            ParamTensor(prefix + "self_attention.q_layernorm.weight", d),
            ParamTensor(prefix + "self_attention.k_layernorm.weight", d),
            ParamTensor(prefix + "pre_mlp_layernorm.weight", h),
        ]
        if sparse:
            f = shape.moe_intermediate_size // etp
            out.append(ParamTensor(prefix + "mlp.router.weight", shape.num_experts * h))
            for e in range(shape.num_experts // ep):
                expert = f"{prefix}mlp.experts.local_experts.{e}."
                out += [
                    ParamTensor(expert + "linear_fc1.weight", 2 * f * h, True),
                    ParamTensor(expert + "linear_fc2.weight", h * f, True),
                ]
            if shape.shared_expert_size:  # gate replicated, fc1 / fc2 tensor-parallel
                fs = shape.shared_expert_size // tp
                out += [
                    ParamTensor(prefix + "mlp.shared_experts.gate_weight", h),
                    ParamTensor(prefix + "mlp.shared_experts.linear_fc1.weight", 2 * fs * h),
                    ParamTensor(prefix + "mlp.shared_experts.linear_fc2.weight", h * fs),
                ]
        else:
            ffn = shape.intermediate_size // tp
            out += [
                ParamTensor(prefix + "mlp.linear_fc1.weight", 2 * ffn * h),
                ParamTensor(prefix + "mlp.linear_fc2.weight", h * ffn),
            ]
    if stage == pp - 1:
        out.append(ParamTensor("decoder.final_layernorm.weight", h))
        if not (shape.tied_embeddings and pp == 1):  # tied: the last stage holds a copy
            out.append(
                ParamTensor("output_layer.weight", shape.vocab_size * h // tp, False, tied_split)
            )
    return out


def stage_params(shape: ModelShape, layout: Layout, stage: int) -> StageParams:
    """Exact local parameter counts of a GPU of ``stage`` (megatron-core GPTModel layout)."""
    tensors = stage_tensors(shape, layout, stage)
    first = sum(layout.stage_layers(shape.num_layers)[:stage])
    layers = layout.stage_layers(shape.num_layers)[stage]
    return StageParams(
        stage,
        layers,
        sum(shape.moe_pattern[first : first + layers]),
        sum(t.numel for t in tensors if not t.expert),
        sum(t.numel for t in tensors if t.expert),
    )


@dataclasses.dataclass(frozen=True, slots=True)
class GradBuffer:
    """One megatron-core ``_ParamAndGradBuffer``: where each parameter sits, and the padding."""

    expert: bool  # DDP's ``expert_parallel_buffers`` (sharded over expert data parallel)
    group_size: int  # the data-parallel group its buckets are reduced / sharded over
    numel: int  # with padding
    param_numel: int  # parameter elements (numel - param_numel is padding)
    param_ranges: tuple[tuple[int, int], ...]  # ascending
    param_is_expert: tuple[bool, ...]  # per range
    buckets: tuple[tuple[int, int], ...]

    def shard_numel(self, rank: int) -> tuple[int, int]:
        """(dense, expert) parameter elements in ``rank``'s distributed-optimizer shard: each
        bucket is cut into ``group_size`` equal ranges, and a rank keeps optimizer state for the
        parts of parameters inside its range (padding gets none)."""
        counts = [0, 0]
        for start, end in self.buckets:
            size = (end - start) // self.group_size
            lo, hi = start + rank * size, start + (rank + 1) * size
            i = max(bisect.bisect_right(self.param_ranges, (lo, math.inf)) - 1, 0)
            while i < len(self.param_ranges) and self.param_ranges[i][0] < hi:
                first, last = self.param_ranges[i]
                counts[self.param_is_expert[i]] += max(0, min(hi, last) - max(lo, first))
                i += 1
        return counts[0], counts[1]

    def fullest_shard(self) -> tuple[int, int]:
        """`shard_numel` of the rank with the most parameter elements."""
        return max((self.shard_numel(r) for r in range(self.group_size)), key=sum)


def megatron_buffer(
    tensors: list[ParamTensor], group_size: int, distributed: bool, expert: bool
) -> GradBuffer:
    """megatron-core 0.16 ``_ParamAndGradBuffer`` layout with ``overlap_grad_reduce=False`` (one
    bucket, plus its own for a pipeline-split tied embedding): parameters in reverse order; with
    the distributed optimizer each start is padded to 64 elements and each bucket end to
    ``lcm(group, 128)``."""
    divisor = math.lcm(group_size, 128)
    buckets: list[tuple[int, int]] = []
    ranges: list[tuple[int, int]] = []
    kinds: list[bool] = []
    state = {"bucket_start": 0, "count": 0}

    def close(param_end: int) -> int:
        end = _ceil_div(param_end, divisor) * divisor if distributed else param_end
        buckets.append((state["bucket_start"], end))
        state["bucket_start"], state["count"] = end, 0
        return end

    start = end = bucket_end = 0
    for tensor in reversed(tensors):
        own_bucket = tensor.shared_embedding and distributed
        if distributed:
            start = _ceil_div(start, 64) * 64
        if own_bucket and state["count"]:
            start = close(start)
        end = start + tensor.numel
        ranges.append((start, end))
        kinds.append(tensor.expert)
        state["count"] += 1
        if own_bucket:
            start = bucket_end = close(end)
        else:
            start = end
    if state["count"]:
        bucket_end = close(end)
    return GradBuffer(
        expert,
        group_size,
        bucket_end,
        sum(t.numel for t in tensors),
        tuple(ranges),
        tuple(kinds),
        tuple(buckets),
    )


def grad_buffers(
    shape: ModelShape, layout: Layout, stage: int, *, distributed_optimizer: bool
) -> list[GradBuffer]:
    """megatron DDP's buffers on a GPU of ``stage``: the dense one (over data x context
    parallel) and, when EP > 1, the expert one (over expert data parallel)."""
    p = layout.parallel
    tensors = stage_tensors(shape, layout, stage)
    dense_group = layout.data_parallel * p.context_parallel
    if p.expert_parallel == 1:  # experts then have allreduce=True: the dense buffer holds them
        return [megatron_buffer(tensors, dense_group, distributed_optimizer, False)]
    buffers = [
        megatron_buffer(
            [t for t in tensors if not t.expert], dense_group, distributed_optimizer, False
        )
    ]
    experts = [t for t in tensors if t.expert]
    if experts:
        buffers.append(
            megatron_buffer(experts, layout.expert_data_parallel, distributed_optimizer, True)
        )
    return buffers


# ---------------------------------------------------------------------------- options
@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class PlanOptions:
    """Training choices that decide memory besides the layout."""

    params_dtype: str = "bfloat16"
    distributed_optimizer: bool = True
    recompute: str = "full"  # "full" (uniform, 1 layer per checkpoint) or "none"
    micro_batch_tokens: int = 4096  # b * s of one micro-batch on one data-parallel rank
    logprob_chunk_tokens: int = 4096
    routing_replay: str = "off"  # off | r2 (recorded by the trainer) | r3 (by the engine)
    routing_codec: str = "auto"
    routing_tokens: int | None = None  # tokens of routing state held per rank, or:
    routing_responses: int | None = None  # responses per RL step (whole batch) ...
    routing_response_tokens: int | None = None  # ... of this many tokens each
    reference: str = "off"  # KL reference model: off | gpu | cpu (offloaded)
    moe_imbalance: float = 1.0  # expert tokens on the fullest GPU / the balanced share
    reserve_gib: float = 4.0  # CUDA context, NCCL buffers, allocator fragmentation
    # megatron's --optimizer-cpu-offload: this share of each rank's optimizer shard lives (and is
    # updated) in host memory; 0: no offload (needs the distributed optimizer when > 0)
    optimizer_offload_fraction: float = 0.0
    # "te": Transformer Engine's fused attention (no [s, s] tensors) and its FusedAdam; "local":
    # megatron's unfused DotProductAttention and torch's AdamW (no TE installed), as the GPU smoke
    spec: str = "te"
    micro_batch_sequences: int = 1  # sequences packed in a micro-batch (attention is per sequence)
    # elements of a grad buffer the trainer's finiteness check (`backend.grad_check.all_finite`)
    # looks at per call; None: a whole buffer at once (the trainer before it chunked)
    grad_check_chunk_elements: int | None = GRAD_CHECK_CHUNK_ELEMENTS

    def __post_init__(self) -> None:
        choices = {
            "params_dtype": tuple(DTYPE_BYTES),
            "recompute": RECOMPUTE,
            "routing_replay": REPLAY,
            "routing_codec": CODECS,
            "reference": REFERENCE,
            "spec": SPECS,
        }
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                raise ValueError(f"{name}={getattr(self, name)!r}: choose one of {allowed}")
        for name in ("micro_batch_tokens", "logprob_chunk_tokens", "micro_batch_sequences"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name}={value!r}: must be an integer >= 1")
        chunk = self.grad_check_chunk_elements
        if chunk is not None and not (isinstance(chunk, int) and chunk >= 1):
            raise ValueError(
                f"grad_check_chunk_elements={chunk!r}: must be None or an integer >= 1"
            )
        if self.micro_batch_tokens % self.micro_batch_sequences:
            raise ValueError(
                f"micro_batch_tokens={self.micro_batch_tokens} is not a multiple of "
                f"micro_batch_sequences={self.micro_batch_sequences}"
            )
        if self.moe_imbalance < 1.0 or self.reserve_gib < 0:
            raise ValueError("moe_imbalance must be >= 1 and reserve_gib >= 0")
        if not 0.0 <= self.optimizer_offload_fraction <= 1.0:
            raise ValueError(
                f"optimizer_offload_fraction={self.optimizer_offload_fraction}: must be in [0, 1]"
            )
        if self.optimizer_offload_fraction and not self.distributed_optimizer:
            raise ValueError(
                "optimizer_offload_fraction > 0 needs distributed_optimizer (megatron offloads "
                "through its distributed, precision-aware optimizer)"
            )
        if self.routing_replay != "off":
            by_batch = (self.routing_responses, self.routing_response_tokens)
            if (self.routing_tokens is None) == (None in by_batch):
                raise ValueError(
                    "routing replay needs either routing_tokens (per rank) or both "
                    "routing_responses and routing_response_tokens (whole batch)"
                )

    @property
    def param_bytes(self) -> int:
        return DTYPE_BYTES[self.params_dtype]


# ---------------------------------------------------------------------------- terms
@dataclasses.dataclass(frozen=True, slots=True)
class Term:
    name: str
    nbytes: int
    exact: bool
    on_gpu: bool = True
    note: str = ""

    @property
    def gib(self) -> float:
        return self.nbytes / GIB


def optimizer_state_bytes(buffers: list[GradBuffer], options: PlanOptions) -> tuple[int, int]:
    """(dense, expert) bytes of Adam state (+ fp32 master params when bf16) on the fullest GPU.

    Per parameter element: ``m`` and ``v`` in fp32 (8 bytes), plus a 4-byte fp32 master copy when
    params are bf16 (fp32 params are updated in place). Without the distributed optimizer every
    local parameter has state; with it, only this rank's shard of each buffer (`GradBuffer`).
    """
    per_param = 8 + (4 if options.param_bytes < 4 else 0)
    dense = expert = 0
    for buffer in buffers:
        d, e = buffer.fullest_shard() if options.distributed_optimizer else _unsharded(buffer)
        dense, expert = dense + d, expert + e
    return per_param * dense, per_param * expert


def _unsharded(buffer: GradBuffer) -> tuple[int, int]:
    counts = [0, 0]
    for (first, last), is_expert in zip(buffer.param_ranges, buffer.param_is_expert, strict=True):
        counts[is_expert] += last - first
    return counts[0], counts[1]


def _token_counts(layout: Layout, micro_batch_tokens: int) -> tuple[int, int]:
    """(s, t): this GPU's tokens of the micro-batch in tensor-parallel regions (split by CP only)
    and in sequence-parallel regions (norms, residual stream, router: split by TP too with SP)."""
    p = layout.parallel
    s = _ceil_div(micro_batch_tokens, p.context_parallel)
    t = _ceil_div(s, p.tensor_parallel) if p.sequence_parallel else s
    return s, t


def layer_activation_bytes(
    shape: ModelShape, layout: Layout, options: PlanOptions, *, moe: bool
) -> dict[str, int]:
    """ESTIMATE: bytes one decoder layer keeps for backward for one micro-batch (no recompute).

    ``a`` = activation bytes (the param dtype), ``s`` = tokens per GPU in tensor-parallel regions
    (micro-batch tokens / CP), ``t`` = tokens in sequence-parallel regions (``s / TP`` with SP),
    ``q = heads * head_dim / TP``, ``kv = kv_heads * head_dim / TP``. No dropout, balanced routing
    (times ``moe_imbalance``). Terms:

    * norms: input and output of both RMSNorms, ``4 t h a`` (SP: the sharded input is kept);
    * attention, the parts linear in ``s``: QKV output ``s (q + 2 kv) a``, q/k-norm outputs
      ``s (q + kv) a``, the attention output ``s q a``, and what the attention kernel keeps of its
      inputs: TE's fused kernel the rotated q, k and v ``s (q + 2 kv) a`` and fp32 log-sum-exp
      ``4 s heads / TP``; the local spec's ``baddbmm`` / ``bmm`` the rotated q and the k and v that
      ``repeat_interleave`` expanded to every query head, ``3 s q a``;
    * attention probabilities (local spec only): `attention_bytes`'s ``saved``, the ``[s, s]``
      tensors per head;
    * MoE: fp32 router input, logits and probabilities ``4 t (h + 2 E)``; per routed
      (token, expert) pair, of which a GPU holds ``t * topk * ETP`` on average, the permuted
      input ``h``, fc1 output ``2 f / ETP``, SwiGLU output ``f / ETP`` and fc2 output ``h``, times
      ``a``; a shared expert ``3 s f_shared a / TP``;
    * dense MLP layer: fc1 output and SwiGLU output ``3 s I a / TP``.

    Left out: the transient buffers of a single op (all-to-all send/receive, GEMM workspaces) and
    the gradients being computed, which the reserve absorbs.
    """
    p = layout.parallel
    tp, etp = p.tensor_parallel, p.expert_tensor_parallel
    a = options.param_bytes
    s, t = _token_counts(layout, options.micro_batch_tokens)
    h = shape.hidden_size
    q = shape.num_heads * shape.head_dim // tp
    kv = shape.num_kv_heads * shape.head_dim // tp
    if options.spec == "te":
        kernel_inputs = s * (q + 2 * kv) * a + 4 * s * (shape.num_heads // tp)
    else:
        kernel_inputs = 3 * s * q * a
    terms = {
        "norms": 4 * t * h * a,
        "attention": s * (q + 2 * kv) * a + s * (q + kv) * a + kernel_inputs + s * q * a,
    }
    if options.spec == "local":
        terms["attention probabilities"] = attention_bytes(shape, layout, options).saved
    if moe:
        pairs = math.ceil(t * shape.topk * etp * options.moe_imbalance)
        f = shape.moe_intermediate_size // etp
        terms["router"] = 4 * t * (h + 2 * shape.num_experts)
        terms["experts"] = pairs * (2 * h + 3 * f) * a
        if shape.shared_expert_size:
            terms["shared_expert"] = 3 * s * shape.shared_expert_size * a // tp
    else:
        terms["mlp"] = 3 * s * shape.intermediate_size * a // tp
    return terms


# the parts of a layer still stored when the backward reaches its attention core
ATTENTION_PART = ("norms", "attention", "attention probabilities")


@dataclasses.dataclass(frozen=True, slots=True)
class AttentionBytes:
    """The attention core of one micro-batch on one GPU beyond its inputs and output: bytes each
    layer keeps for backward (``saved``), kept once per process (``persistent``), live on top of
    ``saved`` at one layer's forward / backward peak (``forward`` / ``backward``), and the
    measured surplus of a training pass (``excess``). See `attention_bytes`."""

    saved: int = 0
    persistent: int = 0
    forward: int = 0
    backward: int = 0
    excess: int = 0
    elements: int = 0  # A = b n s^2: elements of one [b n, s, s] tensor (0: fused attention)


def attention_bytes(shape: ModelShape, layout: Layout, options: PlanOptions) -> AttentionBytes:
    """ESTIMATE from megatron-core 0.16.1's code: one micro-batch's attention core on one GPU.

    ``n = heads / TP`` heads on this GPU, ``b`` = ``micro_batch_sequences`` sequences of
    ``s = micro_batch_tokens / b`` tokens (the local spec has no context parallelism; with SP the
    attention sees every token), ``A = b n s^2`` elements of one ``[b n, s, s]`` tensor, ``a`` the
    activation (param) bytes and ``c = a`` for bf16 / fp16 (``c = 0`` for fp32, which needs no
    fp32 copy).

    Local spec (``DotProductAttention``, ``FusedScaleMaskSoftmax`` on its torch path:
    masked_softmax_fusion off, attention_softmax_in_fp32 on; dropout 0 returns its input):

    * persistent: ``baddbmm`` (beta 0) reads megatron's global memory buffer ``[b n, s, s]`` in
      the activation dtype, allocated at the largest ``s`` and kept: ``a A``;
    * a layer's forward: scores ``[b n, s, s]`` (``a``) out of ``baddbmm``; their fp32 copy
      (``.float()``, 4 B when ``c``) masked in place by a fresh ``[s, s]`` bool causal mask (kept
      for backward by ``masked_fill_``); the softmax ``P`` in fp32 (kept by softmax's backward);
      its cast ``P_a`` (``c``, kept by the ``bmm`` with v). Saved per layer:
      ``(4 + c) A + s^2``. At the cast all four ``[b n, s, s]`` tensors are live:
      ``forward = (a + 4 [c > 0]) A`` on top of the saved (scores and copy die when the layer's
      attention returns);
    * a layer's backward at the softmax: ``bmm``'s backward has freed ``P_a``; live are ``P``, its
      gradient and the gradient of the fp32 copy, three fp32 ``[b n, s, s]``: ``12 A``, i.e.
      ``backward = (8 - c) A`` on top of the saved;
    * excess: `LOCAL_ATTENTION_EXCESS_BYTES` ``A`` (measured on an H200, not read from the code),
      counted at the attention phases of a training pass.

    bf16, per head and sequence: 6 B s^2 kept per layer, 2 B s^2 persistent, 12 B s^2 at either
    peak of the last layer. TE spec (fused / flash attention): no ``[s, s]`` tensor; its fp32
    softmax statistics (``4 s heads / TP``) are in `layer_activation_bytes`, and its backward
    allocates dq, dk and dv, ``s (q + 2 kv) a`` (the kernel's workspace left out).
    """
    p = layout.parallel
    a = options.param_bytes
    if options.spec == "te":
        s, _ = _token_counts(layout, options.micro_batch_tokens)
        q = shape.num_heads * shape.head_dim // p.tensor_parallel
        kv = shape.num_kv_heads * shape.head_dim // p.tensor_parallel
        return AttentionBytes(backward=s * (q + 2 * kv) * a)
    b = options.micro_batch_sequences
    s = options.micro_batch_tokens // b
    elements = b * (shape.num_heads // p.tensor_parallel) * s * s
    c = a if a < 4 else 0
    return AttentionBytes(
        saved=(4 + c) * elements + s * s,
        persistent=a * elements,
        forward=(a + (4 if c else 0)) * elements,
        backward=(8 - c) * elements,
        excess=LOCAL_ATTENTION_EXCESS_BYTES * elements,
        elements=elements,
    )


@dataclasses.dataclass(frozen=True, slots=True)
class Phase:
    """A moment of the training step and the estimated bytes live then besides the static terms."""

    name: str
    terms: tuple[Term, ...]

    @property
    def nbytes(self) -> int:
        return sum(term.nbytes for term in self.terms if term.on_gpu)


PHASE_FORWARD = "forward: last layer's attention"
PHASE_END = "end of forward"
PHASE_LOGPROBS = "log-probs backward: logits, their gradient, a tile"
PHASE_RECOMPUTED = "backward: a recomputed layer"
PHASE_BACKWARD = "backward: last layer's attention"
PHASE_OLD_LOGPROBS = "old-logprob pass: logits, entropy tiles"
PHASE_GRAD_CHECK = "optimizer step: gradient check"
PHASE_ADAM = "optimizer step: Adam"


@dataclasses.dataclass(frozen=True, slots=True)
class StoredActivations:
    """Stored activations of the micro-batches in flight on a GPU (see `stored_activations`)."""

    end: int  # at the end of the newest micro-batch's forward
    attention: int  # when the newest micro-batch is in its last layer's attention core
    recomputed: int  # full recompute: ``end`` + the whole activations of one recomputed layer
    note: str


def stored_activations(
    shape: ModelShape, layout: Layout, options: PlanOptions, params: StageParams
) -> StoredActivations:
    """ESTIMATE: the stored activations on a GPU of ``params.stage``, with ``PP - stage``
    micro-batches in flight (1F1B).

    No recompute: per micro-batch, every layer's `layer_activation_bytes` and, on the last stage,
    the final norm's ``2 t h a``; in its last layer's attention core (forward, or backward once
    the layer's MLP part is freed) the newest micro-batch holds the layers before it and the last
    layer's `ATTENTION_PART`. Full recompute (one layer per checkpoint): per micro-batch each
    layer's input ``t h a`` (+ the final norm); the layer being recomputed adds its
    `ATTENTION_PART` (in its attention core) or all of its activations (its MLP backward).
    """
    s, t = _token_counts(layout, options.micro_batch_tokens)
    h, a = shape.hidden_size, options.param_bytes
    final_norm = 2 * t * h * a if params.stage == layout.parallel.pipeline_parallel - 1 else 0
    first = sum(layout.stage_layers(shape.num_layers)[: params.stage])
    pattern = shape.moe_pattern[first : first + params.layers]
    layers = [layer_activation_bytes(shape, layout, options, moe=bool(sp)) for sp in pattern]
    whole = [sum(layer.values()) for layer in layers]
    part = [sum(v for k, v in layer.items() if k in ATTENTION_PART) for layer in layers]
    in_flight = layout.parallel.pipeline_parallel - params.stage
    tokens = f"s={s:,} t={t:,} tokens" + (
        "; with [s, s] probabilities" if options.spec == "local" else ""
    )
    if options.recompute == "full":
        kept = in_flight * params.layers * t * h * a + final_norm
        note = f"{in_flight} x {params.layers} layer inputs (t h a); {tokens}"
        return StoredActivations(kept, kept + max(part), kept + max(whole), note)
    one = sum(whole) + final_norm
    at_attention = in_flight * one - final_norm - whole[-1] + part[-1]
    note = f"{in_flight} x {params.layers} layers, no recompute; {tokens}"
    return StoredActivations(in_flight * one, at_attention, 0, note)


def _nonzero(*terms: Term) -> tuple[Term, ...]:
    return tuple(term for term in terms if term.nbytes or term.name == "activations")


def _attention_phases(
    shape: ModelShape, layout: Layout, options: PlanOptions, stored: StoredActivations
) -> list[Phase]:
    """The last layer's attention core, forward and backward (`attention_bytes`): the stored
    activations, the core's transient bytes and, in a training pass with the local spec, the
    measured excess (a full-recompute forward runs without grad: no excess there)."""
    att = attention_bytes(shape, layout, options)
    dims = _matrix_text(shape, layout, options)
    a = options.param_bytes
    activations = Term("activations", stored.attention, False, note=stored.note)
    excess = Term(
        "attention: measured excess",
        att.excess,
        False,
        note=f"{LOCAL_ATTENTION_EXCESS_BYTES} B x [{dims}], seen on an H200, not in the code",
    )
    if options.spec == "local":
        forward_note = f"scores ({a} B) + their fp32 copy x [{dims}]"
        backward_note = f"P, dP, dscores fp32 x [{dims}] less the saved P"
    else:
        forward_note, backward_note = "", "dq, dk, dv"
    forward = Term("attention: forward", att.forward, False, note=forward_note)
    backward = Term("attention: backward", att.backward, False, note=backward_note)
    no_grad = options.recompute == "full"
    return [
        Phase(PHASE_FORWARD, _nonzero(activations, forward, *(() if no_grad else (excess,)))),
        Phase(PHASE_BACKWARD, _nonzero(activations, backward, excess)),
    ]


def _logits_phases(
    shape: ModelShape, layout: Layout, options: PlanOptions, stored: StoredActivations, last: bool
) -> list[Phase]:
    """End of the forward (a stage before the last), or on the last stage the log-probs
    backward (`megatron_rl.train.logprobs`: the logits ``[s, V / TP]``, their gradient in the
    activation dtype and one fp32 ``[chunk, V / TP]`` tile, on top of every stored activation;
    the logits die before the layers' backward) and the old-logprob pass (no grad: the logits
    and the entropy's two fp32 tiles); with full recompute also a recomputed layer's backward."""
    activations = Term("activations", stored.end, False, note=stored.note)
    phases = []
    if stored.recomputed:
        phases.append(
            Phase(PHASE_RECOMPUTED, (dataclasses.replace(activations, nbytes=stored.recomputed),))
        )
    if not last:
        return [Phase(PHASE_END, (activations,)), *phases]
    s, _ = _token_counts(layout, options.micro_batch_tokens)
    vocab = shape.vocab_size // layout.parallel.tensor_parallel
    chunk = min(options.logprob_chunk_tokens, s)
    a = options.param_bytes
    logits = Term("logits", s * vocab * a, False, note=f"[{s:,} x {vocab:,}] x {a} B")
    tile = f"[{chunk:,} x {vocab:,}] fp32"
    gradient = dataclasses.replace(logits, name="logits gradient")
    logprob = Term("log-prob tile", 4 * chunk * vocab, False, note=tile)
    entropy = Term("entropy tiles", 8 * chunk * vocab, False, note=f"2 x {tile}")
    return [
        Phase(PHASE_LOGPROBS, (activations, logits, gradient, logprob)),
        Phase(PHASE_OLD_LOGPROBS, (logits, entropy)),
        *phases,
    ]


def _step_phases(options: PlanOptions, buffers: list[GradBuffer], elements: int) -> list[Phase]:
    """The optimizer step: the trainer's finiteness check (`PolicyOptimizer._grads_finite`:
    ``torch.isfinite(grad_data).all()`` per grad buffer, i.e. ``(x == x) * (x.abs() != inf)``,
    an fp32 copy and three bool tensors live at once: ``7 B`` per element of the largest buffer,
    or of ``grad_check_chunk_elements``); then, with the local spec (torch's AdamW, foreach),
    Adam's ``sqrt(v)`` temporary, ``4 B`` per optimizer element on the GPU (TE's FusedAdam makes
    none). The activations are freed by then."""
    checked = max(buffer.numel for buffer in buffers)
    if options.grad_check_chunk_elements is not None:
        checked = min(checked, options.grad_check_chunk_elements)
    note = f"isfinite of {checked:,} fp32 grad-buffer elements: |x| fp32 + 3 bool"
    phases = [Phase(PHASE_GRAD_CHECK, (Term("gradient check", 7 * checked, True, note=note),))]
    if options.spec == "local":
        note = f"torch AdamW (foreach): fp32 sqrt(v) of {elements:,} elements"
        phases.append(Phase(PHASE_ADAM, (Term("Adam temporaries", 4 * elements, True, note=note),)))
    return phases


def stage_phases(
    shape: ModelShape,
    layout: Layout,
    options: PlanOptions,
    params: StageParams,
    buffers: list[GradBuffer],
    optimizer_elements: int,
) -> list[Phase]:
    """ESTIMATE: the phases of one training step on a GPU of ``params.stage``, each with what
    lives then besides the static terms: `_attention_phases`, `_logits_phases`, `_step_phases`.
    ``optimizer_elements``: the parameter elements whose Adam state is on this GPU."""
    stored = stored_activations(shape, layout, options, params)
    last = params.stage == layout.parallel.pipeline_parallel - 1
    forward, backward = _attention_phases(shape, layout, options, stored)
    return [
        forward,
        *_logits_phases(shape, layout, options, stored, last),
        backward,
        *_step_phases(options, buffers, optimizer_elements),
    ]


def _matrix_text(shape: ModelShape, layout: Layout, options: PlanOptions) -> str:
    """``b n, s, s`` of one micro-batch's attention matrices on a GPU, as text."""
    b = options.micro_batch_sequences
    s = options.micro_batch_tokens // b
    n = shape.num_heads // layout.parallel.tensor_parallel
    return f"{b * n}, {s:,}, {s:,}"


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


def _static_terms(
    shape: ModelShape,
    layout: Layout,
    options: PlanOptions,
    params: StageParams,
    buffers: list[GradBuffer],
) -> tuple[list[Term], int]:
    """The terms live for the whole step, and the optimizer elements kept on the GPU."""
    p = layout.parallel
    a = options.param_bytes
    dtype = options.params_dtype
    padding = sum(buffer.numel - buffer.param_numel for buffer in buffers)
    terms = [
        Term("parameters: dense", params.dense * a, True, note=f"{params.dense:,} x {dtype}"),
        Term("parameters: experts", params.expert * a, True, note=f"{params.expert:,} x {dtype}"),
    ]
    if options.distributed_optimizer:  # DDP then moves the params into padded param buffers
        terms.append(
            Term(
                "parameter buffer padding",
                padding * a,
                True,
                note=f"{padding:,} elements: starts to 64, bucket ends to lcm(group, 128)",
            )
        )
    terms.append(
        Term(
            "gradient buffers",
            sum(buffer.numel for buffer in buffers) * 4,
            True,
            note=f"fp32 main_grad of every local param ({params.total + padding:,} with padding)"
            if padding
            else "fp32 main_grad of every local param",
        )
    )
    dense_opt, expert_opt = optimizer_state_bytes(buffers, options)
    what = "Adam m, v" + (" + master" if a < 4 else "") + " in fp32"
    if options.distributed_optimizer:
        dense_group = layout.data_parallel * p.context_parallel
        expert_group = dense_group if p.expert_parallel == 1 else layout.expert_data_parallel
        dense_note = f"{what}, sharded over DP x CP = {dense_group}"
        expert_note = f"{what}, sharded over {'DP x CP' if p.expert_parallel == 1 else 'EDP'} = "
        expert_note += str(expert_group)
    else:
        dense_note = expert_note = f"{what}, not sharded"
    offload = options.optimizer_offload_fraction
    if offload:  # the first `offload` of the shard's elements: their state lives on the host
        per_param = 8 + (4 if a < 4 else 0)
        host_elements = round((dense_opt + expert_opt) // per_param * offload)
        kept = 1.0 - offload
        dense_opt, expert_opt = round(dense_opt * kept), round(expert_opt * kept)
        dense_note += f"; {kept:.0%} of it on the GPU"
        expert_note += f"; {kept:.0%} of it on the GPU"
    exact = not 0.0 < offload < 1.0  # a partial split moves whole tensors: exact up to one
    terms += [
        Term("optimizer: dense", dense_opt, exact, note=dense_note),
        Term("optimizer: experts", expert_opt, exact, note=expert_note),
    ]
    if offload:
        # host, per element: fp32 master (or the fp32 param's copy), m, v and a pinned fp32 grad
        terms.append(
            Term(
                "optimizer: offloaded to host",
                16 * host_elements,
                exact,
                on_gpu=False,
                note=f"{host_elements:,} shard elements x 16 B (fp32 master, m, v, grad copy)",
            )
        )

    attention = attention_bytes(shape, layout, options)
    if attention.persistent:
        terms.append(
            Term(
                "attention scores buffer",
                attention.persistent,
                False,
                note=f"megatron's global memory buffer [{_matrix_text(shape, layout, options)}], "
                f"{dtype}: baddbmm's input, kept",
            )
        )
    _, t = _token_counts(layout, options.micro_batch_tokens)
    if options.routing_replay != "off":
        codec = RoutingCodec(shape.num_experts, shape.topk, options.routing_codec)
        if options.routing_tokens is not None:
            tokens = options.routing_tokens
        else:
            tokens, _ = local_counts(
                p,
                layout.data_parallel,
                options.routing_responses,
                options.routing_response_tokens,
                shape.num_moe_layers,
            )
        on_gpu = options.routing_replay == "r2"
        where = "GPU (R2 recordings)" if on_gpu else "host (R3 routes travel with the samples)"
        terms += [
            Term(
                "routing state",
                codec.nbytes(tokens, params.moe_layers),
                True,
                on_gpu=on_gpu,
                note=f"{tokens:,} tokens x {params.moe_layers} MoE layers, {codec.codec}; {where}",
            ),
            Term(
                "routing targets",
                t * params.moe_layers * shape.topk * 8,
                True,
                note="int64 [t, topk] per MoE layer of the live micro-batch",
            ),
        ]
    if options.reference != "off":
        on_gpu = options.reference == "gpu"
        terms.append(
            Term(
                "reference model",
                params.total * a,
                True,
                on_gpu=on_gpu,
                note=f"parameters, {dtype}" + ("" if on_gpu else "; offloaded to host"),
            )
        )
    terms.append(
        Term(
            "reserve",
            int(options.reserve_gib * GIB),
            False,
            note="CUDA context, NCCL buffers, allocator fragmentation (assumed)",
        )
    )
    per_param = 8 + (4 if a < 4 else 0)
    return terms, (dense_opt + expert_opt) // per_param


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
        params = stage_params(shape, layout, stage)
        buffers = grad_buffers(
            shape, layout, stage, distributed_optimizer=options.distributed_optimizer
        )
        static, elements = _static_terms(shape, layout, options, params, buffers)
        phases = stage_phases(shape, layout, options, params, buffers, elements)
        stages.append(StagePlan(params, tuple(static), tuple(phases)))
    return MemoryPlan(shape, layout, options, tuple(stages), float(gpu_gib))
