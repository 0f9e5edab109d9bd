"""Activation estimates: the tokens a GPU holds, what one decoder layer keeps for backward, the
attention core (fused, or the local spec's ``[s, s]`` matrices), and the stored activations of
the micro-batches in flight."""

from __future__ import annotations

import dataclasses
import math

from megatron_rl.memory_plan.layout import Layout, ceil_div
from megatron_rl.memory_plan.options import PlanOptions
from megatron_rl.memory_plan.params import StageParams
from megatron_rl.memory_plan.schedule import rank_schedule
from megatron_rl.memory_plan.shape import ModelShape

# The local spec's unfused attention on an H200 (tools/gpu_smoke.py, Qwen3-30B-A3B-shaped 2-layer
# slice, bf16, one sequence of 8,192 tokens) keeps about one fp32 [heads, s, s] tensor more at its
# training peak than the tensors `attention_bytes` reads from megatron's and torch's code (which a
# CPU run of the same code confirms, and which match the H200's no-grad pass to 1%): 4 bytes per
# attention-matrix element, counted once per micro-batch at the attention phases of a training
# pass. Measured, not derived (see `attention_bytes`).
LOCAL_ATTENTION_EXCESS_BYTES = 4


def token_counts(layout: Layout, micro_batch_tokens: int) -> tuple[int, int]:
    """(s, t): this GPU's tokens of the micro-batch in tensor-parallel regions (split by CP only)
    and in sequence-parallel regions (norms, residual stream, router: split by TP too with SP)."""
    p = layout.parallel
    s = ceil_div(micro_batch_tokens, p.context_parallel)
    t = ceil_div(s, p.tensor_parallel) if p.sequence_parallel else s
    return s, t


def layer_activation_bytes(
    shape: ModelShape, layout: Layout, options: PlanOptions, *, moe: bool
) -> dict[str, int]:
    """ESTIMATE: bytes one decoder layer keeps for backward for one micro-batch (no recompute).

    ``a`` = activation bytes (the param dtype), ``s`` = tokens per GPU in tensor-parallel regions
    (micro-batch tokens / CP), ``t`` = tokens in sequence-parallel regions (``s / TP`` with SP).
    No dropout, balanced routing (times ``moe_imbalance``). Terms:

    * norms: input and output of both RMSNorms, ``4 t h a`` (SP: the sharded input is kept);
    * attention, the parts linear in ``s`` (`attention_activation_bytes`; for Qwen3-MoE with
      ``q = heads * head_dim / TP``, ``kv = kv_heads * head_dim / TP``: ``s (q + 2 kv) a`` QKV
      output, ``s (q + kv) a`` q/k-norm outputs, ``s q a`` attention output, TE's kernel inputs
      ``s (q + 2 kv) a + 4 s heads / TP`` or the local spec's ``3 s q a``);
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
    s, t = token_counts(layout, options.micro_batch_tokens)
    h = shape.hidden_size
    terms = {
        "norms": 4 * t * h * a,
        "attention": attention_activation_bytes(shape, layout, options),
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


def attention_activation_bytes(shape: ModelShape, layout: Layout, options: PlanOptions) -> int:
    """ESTIMATE: the attention's activations linear in ``s`` that one layer keeps for backward.

    ``q``, ``k``, ``v`` = the query, key and value widths / TP (`ModelShape.q_width`, ...),
    ``o`` = the attention output width / TP, ``n = heads / TP``.

    * grouped-query attention: QKV output ``s (q + k + v) a``, q/k-norm outputs ``s (q + k) a``
      (with qk-norm);
    * multi-latent attention (DeepSeek-V3): the latents in sequence-parallel regions, q down
      output and its RMSNorm ``2 t q_lora a``, kv down output ``t (kv_lora + rope) a`` and its
      RMSNorm ``t kv_lora a``; the up projections' outputs ``s (q + n (nope + v_head)) a``;
    * what the kernel keeps of its inputs: TE's fused kernel the rotated q, k and v
      ``s (q + k + v) a`` and fp32 log-sum-exp ``4 s n``; the local spec's ``baddbmm`` / ``bmm``
      q and the k and v that ``repeat_interleave`` expanded to every query head,
      ``s (2 q + n v_head) a``;
    * the attention output ``s o a``.
    """
    tp = layout.parallel.tensor_parallel
    a = options.param_bytes
    s, t = token_counts(layout, options.micro_batch_tokens)
    n = shape.num_heads // tp
    q, k, v = shape.q_width // tp, shape.k_width // tp, shape.v_width // tp
    if shape.mla:
        nope = shape.head_dim - shape.qk_rope_head_dim
        latents = t * (2 * shape.q_lora_rank + 2 * shape.kv_lora_rank + shape.qk_rope_head_dim)
        projected = latents * a + s * (q + n * (nope + shape.v_head_dim)) * a
    else:
        projected = s * (q + k + v) * a + (s * (q + k) * a if shape.qk_norm else 0)
    if options.spec == "te":
        kernel_inputs = s * (q + k + v) * a + 4 * s * n
    else:
        kernel_inputs = s * (2 * q + n * (shape.out_width // shape.num_heads)) * a
    return projected + kernel_inputs + s * (shape.out_width // tp) * a


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
    allocates dq, dk and dv, ``s (q + k + v) a`` (the kernel's workspace left out).
    """
    p = layout.parallel
    a = options.param_bytes
    if options.spec == "te":
        s, _ = token_counts(layout, options.micro_batch_tokens)
        qkv = shape.q_width + shape.k_width + shape.v_width
        return AttentionBytes(backward=s * (qkv // p.tensor_parallel) * a)
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
class StoredActivations:
    """Stored activations of the micro-batches in flight on a GPU (see `stored_activations`):
    each phase's bytes at that phase's fullest step of the pipeline schedule, and the logits
    other in-flight micro-batches keep then (last pipeline rank with interleaving only)."""

    end: int  # at the end of the newest micro-batch's forward
    attention: int  # the newest (or the backward's) micro-batch in its last layer's attention
    recomputed: int  # full recompute: ``end`` + the whole activations of one recomputed layer
    note: str
    logprobs: int = 0  # last rank: when a micro-batch's log-probs backward starts
    # logits kept by the other in-flight micro-batches of the last chunk (last rank), per phase
    end_logits: int = 0
    attention_logits: int = 0
    recomputed_logits: int = 0
    logprobs_logits: int = 0
    in_flight: int = 1  # the most (chunk, micro-batch) pairs held at once
    warmup: int = 0  # megatron's num_warmup_microbatches of this rank


@dataclasses.dataclass(frozen=True, slots=True)
class _Chunk:
    """One model chunk's activations per in-flight micro-batch: ``stored`` while it waits for its
    backward; ``attention`` instead when it is the micro-batch in its last layer's attention core
    (forward or backward); ``recomputing`` instead while its backward recomputes a layer (full
    recompute); ``logits``: it keeps its logits (the last chunk of the last rank)."""

    layers: int
    stored: int
    attention: int
    recomputing: int
    logits: bool


def logits_bytes(shape: ModelShape, layout: Layout, options: PlanOptions) -> int:
    """One micro-batch's logits on a GPU of the last stage, ``[s, V / TP]`` in the param dtype
    (`megatron_rl.train.logprobs.token_logprobs` keeps them for its backward)."""
    s, _ = token_counts(layout, options.micro_batch_tokens)
    return s * (shape.vocab_size // layout.parallel.tensor_parallel) * options.param_bytes


def _chunks(shape: ModelShape, layout: Layout, options: PlanOptions, stage: int) -> list[_Chunk]:
    """The chunks of pipeline rank ``stage`` (one without a virtual pipeline)."""
    _, t = token_counts(layout, options.micro_batch_tokens)
    h, a = shape.hidden_size, options.param_bytes
    last_rank = stage == layout.parallel.pipeline_parallel - 1
    chunks = []
    spans = layout.chunk_layers(shape.num_layers)[stage]
    for c, (first, count) in enumerate(spans):
        pattern = shape.moe_pattern[first : first + count]
        layers = [layer_activation_bytes(shape, layout, options, moe=bool(sp)) for sp in pattern]
        whole = [sum(layer.values()) for layer in layers]
        part = [sum(v for k, v in layer.items() if k in ATTENTION_PART) for layer in layers]
        post = last_rank and c == len(spans) - 1
        final_norm = 2 * t * h * a if post else 0
        if options.recompute == "full":
            stored = count * t * h * a + final_norm
            chunk = _Chunk(count, stored, stored + max(part), stored + max(whole), post)
        else:
            stored = sum(whole) + final_norm
            attention = stored - final_norm - whole[-1] + part[-1]
            chunk = _Chunk(count, stored, attention, 0, post)
        chunks.append(chunk)
    return chunks


def stored_activations(
    shape: ModelShape, layout: Layout, options: PlanOptions, params: StageParams
) -> StoredActivations:
    """ESTIMATE: the stored activations on a GPU of pipeline rank ``params.stage``, over the
    steps of megatron's schedule (`megatron_rl.memory_plan.schedule.rank_schedule`).

    Per in-flight (chunk, micro-batch) pair, no recompute: every layer's
    `layer_activation_bytes` of the chunk and, on the last chunk of the last rank, the final
    norm's ``2 t h a``; in its last layer's attention core (forward, or backward once the layer's
    MLP part is freed) a micro-batch holds the layers before it and the last layer's
    `ATTENTION_PART`. Full recompute (one layer per checkpoint): per pair each layer's input
    ``t h a`` (+ the final norm); the layer being recomputed adds its `ATTENTION_PART` (in its
    attention core) or all of its activations (its MLP backward).

    How many pairs: megatron's ``get_pp_rank_microbatches`` runs ``W`` warm-up forwards, then
    forward ``W + k`` before backward ``k``, so at most ``min(W + 1, V M)`` are held:

    * plain 1F1B (``V = 1``): ``W = PP - r - 1``, i.e. ``PP - r`` micro-batches of the stage's
      ``L`` layers (``L (PP - r)`` layers' worth on rank ``r``);
    * interleaved (``V`` chunks of ``L / V`` layers, groups of ``N`` micro-batches):
      ``W = 2 (PP - r - 1) + (V - 1) N``, i.e. ``(2 (PP - r - 1) + (V - 1) N + 1) L / V``
      layers' worth: on rank 0 at ``N = PP`` that is ``((V + 1) PP - 1) L / V`` against 1F1B's
      ``PP L`` (PP 4, V 2: 5.5 L against 4 L), on the last rank ``((V - 1) N + 1) L / V``
      against ``L``.

    Which chunks the held pairs belong to follows the schedule's table, so each phase is taken
    at its fullest step. On the last rank the last chunk's in-flight micro-batches also keep
    their logits (the loss is computed in their forward, its backward comes later): at most one
    with 1F1B (the micro-batch in its log-probs backward, `megatron_rl.memory_plan.phases`), and
    the ``*_logits`` fields count the others' bytes."""
    s, t = token_counts(layout, options.micro_batch_tokens)
    chunks = _chunks(shape, layout, options, params.stage)
    v = layout.virtual_pipeline
    schedule = rank_schedule(
        layout.parallel.pipeline_parallel, params.stage, v, options.micro_batches
    )
    logit = logits_bytes(shape, layout, options)

    def held(step, instead=None, value=0):
        """(activations, logits of others) at ``step``, pair ``instead`` holding ``value``."""
        kept = sum(chunks[c].stored for _, c in step.held)
        holders = sum(chunks[c].logits for _, c in step.held)
        if instead is not None:
            kept += value - chunks[instead[1]].stored
            holders -= chunks[instead[1]].logits
        return kept, holders * logit

    def peak(states):
        return max(states, key=sum, default=(0, 0))

    steps = schedule.steps
    end = peak(held(step) for step in steps)
    attention = peak(
        held(step, pair, chunks[pair[1]].attention)
        for step in steps
        for pair in (step.newest, step.backward)
        if pair is not None
    )
    recomputed = (0, 0)
    if options.recompute == "full":
        recomputed = peak(
            held(step, step.backward, chunks[step.backward[1]].recomputing) for step in steps
        )
    logprobs = peak(
        held(step, step.backward, chunks[step.backward[1]].stored)
        for step in steps
        if chunks[step.backward[1]].logits
    )
    n = schedule.max_in_flight
    tokens = f"s={s:,} t={t:,} tokens" + (
        "; with [s, s] probabilities" if options.spec == "local" else ""
    )
    what = "layer inputs (t h a)" if options.recompute == "full" else "layers, no recompute"
    if v == 1:
        note = f"{n} x {params.layers} {what}; {tokens}"
    else:
        per_chunk = chunks[0].layers
        note = (
            f"interleaved VP{v}: up to {n} (chunk, micro-batch) x {per_chunk} {what} "
            f"({schedule.warmup} warm-up forwards, groups of {schedule.group}); {tokens}"
        )
    return StoredActivations(
        end=end[0],
        attention=attention[0],
        recomputed=recomputed[0],
        note=note,
        logprobs=logprobs[0],
        end_logits=end[1],
        attention_logits=attention[1],
        recomputed_logits=recomputed[1],
        logprobs_logits=logprobs[1],
        in_flight=n,
        warmup=schedule.warmup,
    )


def matrix_text(shape: ModelShape, layout: Layout, options: PlanOptions) -> str:
    """``b n, s, s`` of one micro-batch's attention matrices on a GPU, as text."""
    b = options.micro_batch_sequences
    s = options.micro_batch_tokens // b
    n = shape.num_heads // layout.parallel.tensor_parallel
    return f"{b * n}, {s:,}, {s:,}"
