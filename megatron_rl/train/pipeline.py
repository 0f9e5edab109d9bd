"""The trainer's passes over micro-batches, on one pipeline stage or through megatron's schedule.

A pass runs ``micro_batches`` through the model, forward only (the old-logprob pass) or forward
and backward (an update). ``on_logits(i, logits)`` runs where the logits are, the last pipeline
stage, and returns micro-batch ``i``'s loss (``None``: no backward for it, forward-only passes
return ``None`` always). Routing replay is told about each micro-batch's forward through
`ReplayPasses`. The forward-only passes (old-logprob, KL reference) reach it through
`megatron_rl.train.merged_pass.forward_only_pass`, which first merges micro-batches into fewer
forwards and splits the outputs back.

* One stage (PP = 1): a plain loop, forward then backward per micro-batch, the gradient
  reduction deferred to the last micro-batch (``model.no_sync``).
* Pipeline parallel (PP > 1): megatron-core's own schedule (``get_forward_backward_func``: 1F1B,
  or its interleaved 1F1B when each rank holds several model chunks), activations of varying
  ``[s, b, h]`` shapes between stages (``variable_seq_lengths``; micro-batches are padded to their
  own longest row, and token-budget micro-batches have varying row counts). Megatron divides a
  loss returned by the loss function by the number of micro-batches; the trainer's losses are
  already normalised by the global token/sequence counts of the optimizer step, so `pipeline_pass`
  multiplies that back. A micro-batch whose loss is ``None`` (non-finite log-probs: the step is
  skipped anyway) gets a zero loss (`skipped_loss`) so that every stage still runs its backward
  and no stage waits forever; the one-stage loop does the same, so that every data-parallel rank
  launches the same overlapped gradient reductions.
"""

from __future__ import annotations

import contextlib
from collections.abc import Callable, Hashable, Sequence

import torch
from megatron.core import parallel_state
from megatron.core.pipeline_parallel import get_forward_backward_func

from megatron_rl.backend import cuda_available
from megatron_rl.model.chunks import as_chunks
from megatron_rl.model.router_padding import padding_mask_BS
from megatron_rl.model.stages import interleaved_group_size
from megatron_rl.routing.passes import ReplayPasses
from megatron_rl.train.batch import MicroBatch
from megatron_rl.train.logprobs import forward_logits

OnLogits = Callable[[int, torch.Tensor], "torch.Tensor | None"]


def micro_batch_logits(model, mb: MicroBatch) -> torch.Tensor:
    """`forward_logits` of ``mb`` with its padding mask (positions past each row's length), so
    that the MoE routers' statistics leave the padded tokens out whatever the layout pads."""
    tokens_BS = mb.tokens_BS
    mask_BS = padding_mask_BS(model, mb.lengths, tokens_BS.shape[1], tokens_BS.device)
    return forward_logits(model, tokens_BS, mask_BS)


def single_stage_pass(
    model,
    micro_batches: Sequence[MicroBatch],
    keys: Sequence[Hashable],
    replay: ReplayPasses,
    on_logits: OnLogits,
    *,
    phase: str,
) -> None:
    """PP = 1: forward (and backward of the returned loss) per micro-batch, in order."""
    last = len(micro_batches) - 1
    for i, (mb, key) in enumerate(zip(micro_batches, keys, strict=True)):
        if phase == "behaviour":
            with replay.behaviour(key, mb.routed()):
                on_logits(i, micro_batch_logits(model, mb))
            continue
        # gradients are reduced once, after the last micro-batch (overlapped with its backward
        # under --overlap-grad-reduce)
        no_sync = model.no_sync() if i < last else contextlib.nullcontext()
        with no_sync, replay.update(key, mb.routed()):
            logits = micro_batch_logits(model, mb)
            loss = on_logits(i, logits)
            # a skipped micro-batch still runs a (zero) backward: under --overlap-grad-reduce the
            # last one's backward launches the gradient reduce-scatters that every data-parallel
            # rank must enter, whichever rank's micro-batch was bad
            (skipped_loss(logits) if loss is None else loss).backward()


def pipeline_pass(
    model,
    micro_batches: Sequence[MicroBatch],
    keys: Sequence[Hashable],
    replay: ReplayPasses,
    on_logits: OnLogits,
    *,
    phase: str,
) -> None:
    """PP > 1: the same pass through megatron's pipeline schedule (every stage calls it); its
    interleaved schedule when ``model`` holds several chunks (`interleaved_schedule_options`)."""
    count = len(micro_batches)
    forward_only = phase == "behaviour"
    last_stage = parallel_state.is_pipeline_last_stage()
    chunks = as_chunks(model)
    # the schedule runs DDP itself, or under interleaving the chunks inside the one DDP
    stage_models = chunks if len(chunks) > 1 else [model]
    chunk_of = {id(m): c for c, m in enumerate(stage_models)}
    config = chunks[0].config  # one TransformerConfig, shared by every chunk
    if not forward_only:  # megatron's schedule defers the gradient reduction to the last one
        config.no_sync_func = model.no_sync
    # gloo (CPU) has no batched p2p; NCCL takes the batched form
    config.batch_p2p_comm = cuda_available()
    if len(stage_models) > 1:
        interleaved_schedule_options(config, count)
    with replay.schedule(phase) as (before_forward, after_forward):

        def forward_step(data_iterator, stage_model):
            c = chunk_of[id(stage_model)]
            i = next(data_iterator)
            mb = micro_batches[i]
            before_forward(keys[i], mb.routed(), c)
            output = micro_batch_logits(stage_model, mb)
            after_forward(keys[i], mb.routed(), c)

            def loss_func(logits):
                computes = last_stage and c == len(stage_models) - 1
                loss = on_logits(i, logits) if computes else None
                if loss is None:  # forward only, or a skipped micro-batch: nothing to learn
                    loss = skipped_loss(logits)
                return loss * count, {}  # megatron divides by the number of micro-batches

            return output, loss_func

        # every chunk runs every micro-batch, in order (the interleaved schedule wants one
        # iterator per chunk)
        iterators = [iter(range(count)) for _ in stage_models]
        get_forward_backward_func()(
            forward_step_func=forward_step,
            data_iterator=iterators if len(stage_models) > 1 else iterators[0],
            model=stage_models,
            num_microbatches=count,
            seq_length=max(mb.tokens_BS.shape[1] for mb in micro_batches),
            micro_batch_size=max(mb.tokens_BS.shape[0] for mb in micro_batches),
            forward_only=forward_only,
        )


def interleaved_schedule_options(config, count: int) -> None:
    """Set megatron's interleaved-schedule options on ``config`` for a pass of ``count``
    micro-batches.

    * ``microbatch_group_size_per_vp_stage``: megatron runs micro-batches in groups of ``N``
      per chunk and refuses ``N`` outside ``[PP, M]`` and a last group of ``0 < M % N < PP``
      micro-batches. Megatron-LM's default ``N = PP`` then needs ``M % PP == 0``; here ``N`` is
      the smallest size megatron accepts for this ``M`` (``PP`` whenever ``M % PP == 0``), so
      any ``M >= PP`` runs. A larger ``N`` holds more micro-batches' activations in warm-up.
    * p2p: overlapped sends and receives, not batched (Megatron-LM's default for the
      interleaved schedule; gloo has no batched form anyway). The variable-shape exchange of
      the batched form was not run here: it needs NCCL.
    """
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    if count < pp:
        raise RuntimeError(
            f"the interleaved pipeline schedule needs at least PP={pp} micro-batches, got "
            f"{count}: lower --micro-batch-size or --max-tokens-per-gpu, or raise "
            "--global-batch-size"
        )
    config.microbatch_group_size_per_vp_stage = interleaved_group_size(count, pp)
    config.overlap_p2p_comm = True
    config.batch_p2p_comm = False


def min_micro_batches() -> int:
    """The fewest micro-batches a pass may have on this layout: PP under interleaving (its
    schedule refuses fewer), else 1."""
    pp = parallel_state.get_pipeline_model_parallel_world_size()
    interleaved = parallel_state.get_virtual_pipeline_model_parallel_world_size() is not None
    return pp if interleaved and pp > 1 else 1


def skipped_loss(logits: torch.Tensor) -> torch.Tensor:
    """A zero loss on ``logits``' graph (non-finite values zeroed first, so the backward it
    drives carries no NaN): a skipped micro-batch's backward still reaches every parameter's
    gradient hook, as its peers' backwards do."""
    return torch.nan_to_num(logits.float(), nan=0.0, posinf=0.0, neginf=0.0).sum() * 0.0


def run_pass(
    model,
    micro_batches: Sequence[MicroBatch],
    keys: Sequence[Hashable],
    replay: ReplayPasses,
    on_logits: OnLogits,
    *,
    phase: str,
) -> None:
    """`single_stage_pass` or `pipeline_pass`, by this job's pipeline-parallel size."""
    if phase not in ("behaviour", "update"):
        raise ValueError(f"phase={phase!r}: use 'behaviour' or 'update'")
    if not micro_batches:
        return
    pipelined = parallel_state.get_pipeline_model_parallel_world_size() > 1
    run = pipeline_pass if pipelined else single_stage_pass
    run(model, micro_batches, keys, replay, on_logits, phase=phase)
