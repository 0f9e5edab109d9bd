"""The terms live for the whole step on a GPU: parameters, their buffers' padding, gradient
buffers, optimizer state (sharded, optionally offloaded to the host), the local spec's attention
scores buffer, routing-replay state, the reference model, the weight sync's staging buffers and
the reserve."""

from __future__ import annotations

from megatron_rl.memory_plan.activations import attention_bytes, matrix_text, token_counts
from megatron_rl.memory_plan.layout import Layout
from megatron_rl.memory_plan.options import PlanOptions
from megatron_rl.memory_plan.params import GradBuffer, StageParams
from megatron_rl.memory_plan.shape import ModelShape
from megatron_rl.memory_plan.terms import GIB, Term
from megatron_rl.routing.codec import RoutingCodec
from megatron_rl.routing.memory import local_counts


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


def sync_staging_bytes(options: PlanOptions, stage: int) -> int:
    """Bytes of the weight sync's staging buffers on the fullest GPU of pipeline ``stage``:
    ``buffers x bucket`` where a rank of that stage sends (every stage's first rank, every rank
    with CUDA IPC, or only stage 0 when rank 0 sends the whole model), else 0."""
    sends = options.sync_senders != "first-stage" or stage == 0
    return options.sync_staging_buffers * options.sync_bucket_bytes if sends else 0


def static_terms(
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
    trained = sum(buffer.param_numel for buffer in buffers)
    what_trains = "LoRA adapter" if params.adapters else "local param"
    terms = [
        Term("parameters: dense", params.dense * a, True, note=f"{params.dense:,} x {dtype}"),
        Term("parameters: experts", params.expert * a, True, note=f"{params.expert:,} x {dtype}"),
    ]
    if params.adapters:  # LoRA: the base above is frozen (no grads, no optimizer state)
        terms.append(
            Term(
                "parameters: LoRA adapters",
                params.adapters * a,
                True,
                note=f"{params.adapters:,} x {dtype} (rank {options.lora_rank}, "
                f"{options.lora_targets}); the base above frozen",
            )
        )
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
            note=f"fp32 main_grad of every {what_trains} ({trained + padding:,} with padding)"
            if padding
            else f"fp32 main_grad of every {what_trains}",
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
                note=f"megatron's global memory buffer [{matrix_text(shape, layout, options)}], "
                f"{dtype}: baddbmm's input, kept",
            )
        )
    _, t = token_counts(layout, options.micro_batch_tokens)
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
                (params.dense + params.expert) * a,
                True,
                on_gpu=on_gpu,
                note=f"parameters, {dtype}" + ("" if on_gpu else "; offloaded to host"),
            )
        )
    staging = sync_staging_bytes(options, params.stage)
    if staging:
        terms.append(
            Term(
                "weight-sync staging",
                staging,
                True,
                note=f"{options.sync_staging_buffers} x {options.sync_bucket_bytes / GIB:g} GiB "
                f"buckets kept between syncs ({options.sync_senders} senders)",
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
