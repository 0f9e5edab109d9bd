"""Weights and gradients, exact: a GPU's parameter tensors of a pipeline stage as megatron-core
creates them, and megatron DDP's grad (and padded param) buffers over them."""

from __future__ import annotations

import bisect
import dataclasses
import math

from megatron_rl.memory_plan.layout import Layout, ceil_div
from megatron_rl.memory_plan.shape import ModelShape


@dataclasses.dataclass(frozen=True, slots=True)
class ParamTensor:
    """One parameter tensor on a GPU, as megatron-core creates it (local spec names)."""

    name: str
    numel: int
    expert: bool = False  # a routed expert's weight (megatron: ``allreduce=False`` when EP > 1)
    shared_embedding: bool = False  # tied word embedding split over pipeline stages
    frozen: bool = False  # a LoRA run's base: no gradient buffer, no optimizer state


@dataclasses.dataclass(frozen=True, slots=True)
class StageParams:
    """Parameter counts on one GPU of pipeline stage ``stage``."""

    stage: int
    layers: int
    moe_layers: int
    dense: int  # attention, norms, router, shared experts, embedding / output layer
    expert: int  # routed experts
    adapters: int = 0  # LoRA's A and B (the dense and expert counts are then the frozen base)

    @property
    def total(self) -> int:
        return self.dense + self.expert + self.adapters


def stage_tensors(
    shape: ModelShape, layout: Layout, stage: int, *, spec: str = "te", lora=None
) -> list[ParamTensor]:
    """This GPU's parameter tensors of ``stage`` in megatron-core's ``named_parameters`` order
    (local spec names; the TE spec holds the same tensors, with the norms fused into the
    linears). ``spec`` matters for multi-latent attention only: TE's spec replicates the q / kv
    down projections over TP (``TELinear``, duplicated), the local spec splits them
    (``ColumnParallelLinear``). ``lora`` (a `LoRAConfig` with a rank): the tensors frozen and
    the adapters after them (`megatron_rl.memory_plan.lora`). With a virtual pipeline the
    rank's chunks follow each other (``chunks.{c}.``, `megatron_rl.model.chunks.ModelChunks`,
    one DDP over all of them): the embedding in chunk 0 of the first rank, the final norm and the
    output layer in the last chunk of the last."""
    if lora is not None and lora.enabled:
        from megatron_rl.memory_plan.lora import with_adapters

        return with_adapters(stage_tensors(shape, layout, stage, spec=spec), shape, layout, lora)
    p = layout.parallel
    tp, ep, etp, pp = (
        p.tensor_parallel,
        p.expert_parallel,
        p.expert_tensor_parallel,
        p.pipeline_parallel,
    )
    chunks = layout.chunk_layers(shape.num_layers)[stage]
    h = shape.hidden_size
    tied_split = shape.tied_embeddings and pp > 1
    out: list[ParamTensor] = []
    if stage == 0:
        out.append(
            ParamTensor(
                "embedding.word_embeddings.weight", shape.vocab_size * h // tp, False, tied_split
            )
        )
    layers = [
        (f"chunks.{c}." if len(chunks) > 1 else "", offset, shape.moe_pattern[first + offset])
        for c, (first, count) in enumerate(chunks)
        for offset in range(count)
    ]
    for chunk, offset, sparse in layers:
        prefix = f"{chunk}decoder.layers.{offset}."
        out.append(ParamTensor(prefix + "input_layernorm.weight", h))
        if shape.mla:
            out += _mla_tensors(shape, prefix + "self_attention.", tp, spec)
        else:
            out += _gqa_tensors(shape, prefix + "self_attention.", tp)
        out.append(ParamTensor(prefix + "pre_mlp_layernorm.weight", h))
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
                if shape.shared_expert_gate:
                    out.append(ParamTensor(prefix + "mlp.shared_experts.gate_weight", h))
                out += [
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


def _gqa_tensors(shape: ModelShape, prefix: str, tp: int) -> list[ParamTensor]:
    """Grouped-query attention: linear_proj (row-parallel), linear_qkv (column-parallel, + bias),
    the per-head q / k RMSNorms (replicated)."""
    h, d = shape.hidden_size, shape.head_dim
    out = [
        ParamTensor(prefix + "linear_proj.weight", shape.out_width * h // tp),
        ParamTensor(prefix + "linear_qkv.weight", shape.qkv_width * h // tp),
    ]
    if shape.attention_bias:
        out.append(ParamTensor(prefix + "linear_qkv.bias", shape.qkv_width // tp))
    if shape.qk_norm:
        out += [
            ParamTensor(prefix + "q_layernorm.weight", d),
            ParamTensor(prefix + "k_layernorm.weight", d),
        ]
    return out


def _mla_tensors(shape: ModelShape, prefix: str, tp: int, spec: str) -> list[ParamTensor]:
    """Multi-latent attention (`ModelShape.mla_tensors`): linear_proj, q down / up, kv down / up,
    then the q and kv latent RMSNorms (replicated). The down projections are split over TP on
    the local spec only."""
    out = []
    for name, (numel, by_heads) in shape.mla_tensors().items():
        split = tp if by_heads or spec == "local" else 1
        out.append(ParamTensor(f"{prefix}{name}.weight", numel // split))
    if shape.q_lora_rank:
        out.append(ParamTensor(prefix + "q_layernorm.weight", shape.q_lora_rank))
    out.append(ParamTensor(prefix + "kv_layernorm.weight", shape.kv_lora_rank))
    return out


def stage_params(
    shape: ModelShape, layout: Layout, stage: int, *, spec: str = "te", lora=None
) -> StageParams:
    """Exact local parameter counts of a GPU of ``stage`` (megatron-core GPTModel layout)."""
    tensors = stage_tensors(shape, layout, stage, spec=spec, lora=lora)
    base = [t for t in tensors if ".lora_" not in t.name]
    layers = layout.rank_layers(shape.num_layers, stage)
    return StageParams(
        stage,
        len(layers),
        sum(shape.moe_pattern[layer] for layer in layers),
        sum(t.numel for t in base if not t.expert),
        sum(t.numel for t in base if t.expert),
        sum(t.numel for t in tensors if ".lora_" in t.name),
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
        end = ceil_div(param_end, divisor) * divisor if distributed else param_end
        buckets.append((state["bucket_start"], end))
        state["bucket_start"], state["count"] = end, 0
        return end

    start = end = bucket_end = 0
    for tensor in reversed(tensors):
        own_bucket = tensor.shared_embedding and distributed
        if distributed:
            start = ceil_div(start, 64) * 64
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
    shape: ModelShape,
    layout: Layout,
    stage: int,
    *,
    distributed_optimizer: bool,
    spec: str = "te",
    lora=None,
) -> list[GradBuffer]:
    """megatron DDP's buffers on a GPU of ``stage``: the dense one (over data x context
    parallel) and, when EP > 1, the expert one (over expert data parallel); over the trained
    tensors only (LoRA: the adapters)."""
    p = layout.parallel
    tensors = [t for t in stage_tensors(shape, layout, stage, spec=spec, lora=lora) if not t.frozen]
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
