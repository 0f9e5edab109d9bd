"""The phases of one training step (ESTIMATE): the last layer's attention, the end of the forward
or the log-probs, a recomputed layer, the old-logprob pass and the optimizer step, each with
what lives then besides the static terms."""

from __future__ import annotations

import dataclasses

from megatron_rl.memory_plan.activations import (
    LOCAL_ATTENTION_EXCESS_BYTES,
    StoredActivations,
    attention_bytes,
    matrix_text,
    stored_activations,
    token_counts,
)
from megatron_rl.memory_plan.layout import Layout
from megatron_rl.memory_plan.options import PlanOptions
from megatron_rl.memory_plan.params import GradBuffer, StageParams
from megatron_rl.memory_plan.shape import ModelShape
from megatron_rl.memory_plan.terms import Phase, Term

PHASE_FORWARD = "forward: last layer's attention"
PHASE_END = "end of forward"
PHASE_LOGPROBS = "log-probs backward: logits, their gradient, a tile"
PHASE_RECOMPUTED = "backward: a recomputed layer"
PHASE_BACKWARD = "backward: last layer's attention"
PHASE_OLD_LOGPROBS = "old-logprob pass: logits, entropy tiles"
PHASE_GRAD_CHECK = "optimizer step: gradient check"
PHASE_ADAM = "optimizer step: Adam"


def _nonzero(*terms: Term) -> tuple[Term, ...]:
    return tuple(term for term in terms if term.nbytes or term.name == "activations")


def _attention_phases(
    shape: ModelShape, layout: Layout, options: PlanOptions, stored: StoredActivations
) -> list[Phase]:
    """The last layer's attention core, forward and backward (`attention_bytes`): the stored
    activations, the core's transient bytes and, in a training pass with the local spec, the
    measured excess (a full-recompute forward runs without grad: no excess there)."""
    att = attention_bytes(shape, layout, options)
    dims = matrix_text(shape, layout, options)
    a = options.param_bytes
    activations = Term("activations", stored.attention, False, note=stored.note)
    held = _held_logits(stored.attention_logits)
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
        Phase(PHASE_FORWARD, _nonzero(activations, held, forward, *(() if no_grad else (excess,)))),
        Phase(PHASE_BACKWARD, _nonzero(activations, held, backward, excess)),
    ]


def _held_logits(nbytes: int) -> Term:
    """The logits that the last chunk's other in-flight micro-batches keep for their log-probs
    backward (interleaved schedule, last rank; `stored_activations`)."""
    return Term(
        "logits of in-flight micro-batches",
        nbytes,
        False,
        note="the last chunk's micro-batches waiting for their backward (interleaved)",
    )


def _logits_phases(
    shape: ModelShape, layout: Layout, options: PlanOptions, stored: StoredActivations, last: bool
) -> list[Phase]:
    """End of the forward (a stage before the last), or on the last stage the log-probs
    backward (`megatron_rl.train.logprobs`: the logits ``[s, V / TP]``, their gradient in the
    activation dtype and one fp32 ``[chunk, V / TP]`` tile, on top of every stored activation;
    the logits die before the layers' backward) and the old-logprob pass (no grad: the logits
    and the entropy's two fp32 tiles); with full recompute also a recomputed layer's backward.
    With interleaving the last rank's other in-flight micro-batches of its last chunk keep their
    logits meanwhile (`StoredActivations`' ``*_logits``)."""
    activations = Term("activations", stored.end, False, note=stored.note)
    phases = []
    if stored.recomputed:
        recomputed = dataclasses.replace(activations, nbytes=stored.recomputed)
        held = _held_logits(stored.recomputed_logits)
        phases.append(Phase(PHASE_RECOMPUTED, _nonzero(recomputed, held)))
    if not last:
        return [Phase(PHASE_END, _nonzero(activations, _held_logits(stored.end_logits))), *phases]
    s, _ = token_counts(layout, options.micro_batch_tokens)
    vocab = shape.vocab_size // layout.parallel.tensor_parallel
    chunk = min(options.logprob_chunk_tokens, s)
    a = options.param_bytes
    logits = Term("logits", s * vocab * a, False, note=f"[{s:,} x {vocab:,}] x {a} B")
    tile = f"[{chunk:,} x {vocab:,}] fp32"
    gradient = dataclasses.replace(logits, name="logits gradient")
    logprob = Term("log-prob tile", 4 * chunk * vocab, False, note=tile)
    entropy = Term("entropy tiles", 8 * chunk * vocab, False, note=f"2 x {tile}")
    activations = dataclasses.replace(activations, nbytes=stored.logprobs)
    held = _held_logits(stored.logprobs_logits)
    return [
        Phase(PHASE_LOGPROBS, _nonzero(activations, held, logits, gradient, logprob)),
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
    stored: StoredActivations | None = None,
) -> list[Phase]:
    """ESTIMATE: the phases of one training step on a GPU of ``params.stage``, each with what
    lives then besides the static terms: `_attention_phases`, `_logits_phases`, `_step_phases`.
    ``optimizer_elements``: the parameter elements whose Adam state is on this GPU; ``stored``:
    its `stored_activations` (computed here when None)."""
    stored = stored or stored_activations(shape, layout, options, params)
    last = params.stage == layout.parallel.pipeline_parallel - 1
    forward, backward = _attention_phases(shape, layout, options, stored)
    return [
        forward,
        *_logits_phases(shape, layout, options, stored, last),
        backward,
        *_step_phases(options, buffers, optimizer_elements),
    ]
