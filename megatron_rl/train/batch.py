"""Rollout samples -> padded megatron micro-batches with per-token training fields.

A training sample is prompt + response. The model reads ``tokens[:-1]`` of each row and predicts
``tokens[1:]``; the log-prob of response token ``j`` (absolute position ``P + j``) comes from the
logits at position ``P + j - 1``. Everything per token below is aligned to *predicted* positions
``[s - 1]`` of the ``[b, s]`` token rows, with ``loss_mask`` true on response tokens only.

A sample generated across weight updates (``--partial-rollout``) carries per-segment versions
(``weight_versions``); ``token_versions_BT`` holds each response token's version at its predicted
position (`megatron_rl.train.token_versions`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rl.routing import RoutingBlob
from megatron_rl.routing.passes import RoutedMicroBatch
from megatron_rl.train.token_versions import NO_VERSION, response_token_versions


@dataclass(slots=True)
class TrainSample:
    """One sample as the trainer keeps it on its data-parallel rank."""

    prompt_ids: torch.Tensor  # int64 [P]
    response_ids: torch.Tensor  # int64 [R]
    rollout_logprobs: torch.Tensor  # float32 [R]
    advantage: float
    reward: float
    in_loss: bool  # False for zero-variance groups when they are filtered
    routes: RoutingBlob | None = None  # R3: [P + R - 1, L, K]
    weight_version: int | None = None  # the engine's weight version that generated it (oldest)
    truncated: bool = False  # the response was cut at the length limit
    # per segment of response tokens [start, end): (version, start, end); empty when one version
    # (``weight_version``) generated every token (see megatron_rl/train/token_versions.py)
    weight_versions: tuple[tuple[int, int, int], ...] = ()
    prompt_index: int = -1  # its prompt's dataset index (-1: not recorded)
    # bool [R]: the response tokens in the loss (None: all); False on tokens the policy did not
    # sample, e.g. a tool's answer in a multi-turn rollout (megatron_rl/train/rollout_function.py)
    response_mask: torch.Tensor | None = None
    # int32 [R, K]: each response token's sampling support, -1 padded (`RolloutSample.support_RK`;
    # None: sampled from the full vocabulary); a row of -1 only for tokens outside the loss
    support_RK: torch.Tensor | None = None
    # float32 [R]: the --loss-teacher's log-prob of each response token (None: no teacher)
    teacher_logprobs: torch.Tensor | None = None
    # --teacher-topk K: (float32 [R, K] log-probs, int32 [R, K] ids) of the teacher's K most
    # likely tokens at each response token's position (ids -1 padded); None otherwise
    teacher_topk: tuple[torch.Tensor, torch.Tensor] | None = None

    @property
    def length(self) -> int:
        return self.prompt_ids.numel() + self.response_ids.numel()


@dataclass(slots=True)
class MicroBatch:
    """Padded tensors of one micro-batch (``b`` rows, ``s`` tokens)."""

    tokens_BS: torch.Tensor  # int64 [b, s]
    loss_mask_BT: torch.Tensor  # bool [b, s - 1]: predicted position is a response token
    rollout_logprobs_BT: torch.Tensor  # float32 [b, s - 1] on response positions, else 0
    # int64 [b, s - 1]: the weight version that generated the predicted response token (-1 where
    # unknown: a sample without weight_version), -1 outside response positions
    token_versions_BT: torch.Tensor
    advantages_B: torch.Tensor  # float32 [b]
    lengths: list[int]  # tokens of each row (prompt + response)
    samples: list[TrainSample]
    # int64 [b, s - 1, K]: the sampling support of each predicted response token, -1 elsewhere
    # (`megatron_rl.train.support_logprobs`); None when the samples carry none
    support_BTK: torch.Tensor | None = None
    # float32 [b, s - 1]: the teacher's log-prob of each predicted response token, 0 elsewhere
    # (`megatron_rl.train.teacher`); None without --loss-teacher
    teacher_logprobs_BT: torch.Tensor | None = None
    # --teacher-topk: int64 ids [b, s - 1, K] (-1 elsewhere) and float32 log-probs [b, s - 1, K]
    # (0 elsewhere) of the teacher's top K at each predicted response token
    # (`megatron_rl.train.distillation_kl`); None otherwise
    teacher_topk_ids_BTK: torch.Tensor | None = None
    teacher_topk_logprobs_BTK: torch.Tensor | None = None

    def to(self, device: torch.device | str) -> MicroBatch:
        """This micro-batch with every tensor on ``device`` (the model's); samples stay put."""
        fields = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            fields[f.name] = value.to(device) if torch.is_tensor(value) else value
        return MicroBatch(**fields)

    def routed(self) -> RoutedMicroBatch:
        """What routing replay needs: row lengths, width and the engine's routes per row."""
        return RoutedMicroBatch(
            self.lengths, self.tokens_BS.shape[1], [s.routes for s in self.samples]
        )

    @property
    def num_tokens(self) -> int:
        return int(self.loss_mask_BT.sum())

    @property
    def num_seqs(self) -> int:
        return int(self.loss_mask_BT.any(dim=-1).sum())


def make_micro_batch(
    samples: Sequence[TrainSample], pad_id: int, multiple_of: int = 1
) -> MicroBatch:
    """Pad ``samples`` to one ``[b, s]`` micro-batch, ``s`` a multiple of ``multiple_of``.

    ``multiple_of`` is the tensor-parallel size under sequence parallelism (megatron scatters the
    sequence axis in equal chunks).
    """
    if not samples:
        raise ValueError("a micro-batch needs at least one sample")
    if multiple_of < 1:
        raise ValueError(f"multiple_of={multiple_of}: must be >= 1 (the tensor-parallel size)")
    for i, sample in enumerate(samples):
        if sample.prompt_ids.numel() == 0:
            raise ValueError(
                f"sample {i} has an empty prompt: its first response token has no "
                "position to be predicted from; every prompt needs >= 1 token"
            )
        if sample.rollout_logprobs.shape != sample.response_ids.shape:
            raise ValueError(
                f"sample {i}: rollout_logprobs {tuple(sample.rollout_logprobs.shape)} must have "
                f"one log-prob per response token {tuple(sample.response_ids.shape)}"
            )
    lengths = [s.length for s in samples]
    seq = max(lengths)
    seq += (-seq) % multiple_of
    batch = len(samples)
    tokens = torch.full((batch, seq), pad_id, dtype=torch.int64)
    mask = torch.zeros(batch, seq - 1, dtype=torch.bool)
    rollout = torch.zeros(batch, seq - 1, dtype=torch.float32)
    versions_BT = torch.full((batch, seq - 1), NO_VERSION, dtype=torch.int64)
    # every row's prompt + response at [i, 0 : P + R), its response fields at the predicted
    # positions [i, P - 1 : P + R - 1): one scatter per field over the concatenated samples
    prompts = torch.tensor([s.prompt_ids.numel() for s in samples])
    responses = torch.tensor([s.response_ids.numel() for s in samples])
    rows, cols = _ragged_positions(prompts + responses, torch.zeros_like(prompts))
    tokens[rows, cols] = torch.cat([t for s in samples for t in (s.prompt_ids, s.response_ids)])
    rows, cols = _ragged_positions(responses, prompts - 1)
    rollout[rows, cols] = torch.cat([s.rollout_logprobs for s in samples]).to(torch.float32)
    versions_BT[rows, cols] = response_token_versions(samples)
    if all(s.in_loss and s.response_mask is None for s in samples):
        mask[rows, cols] = True
    else:
        mask[rows, cols] = torch.cat([trained_tokens(s) for s in samples])
    advantages = torch.tensor([s.advantage for s in samples], dtype=torch.float32)
    support = None
    if any(s.support_RK is not None for s in samples):
        support = _support_BTK(samples, rows, cols, seq)
    teacher = None
    if any(s.teacher_logprobs is not None for s in samples):
        missing = [i for i, s in enumerate(samples) if s.teacher_logprobs is None]
        if missing:
            raise ValueError(f"samples {missing[:8]} have no teacher log-probs while others do")
        teacher = torch.zeros(batch, seq - 1, dtype=torch.float32)
        teacher[rows, cols] = torch.cat([s.teacher_logprobs for s in samples]).float()
    top_ids = top_logprobs = None
    if any(s.teacher_topk is not None for s in samples):
        missing = [i for i, s in enumerate(samples) if s.teacher_topk is None]
        if missing:
            raise ValueError(f"samples {missing[:8]} have no teacher top-K while others do")
        width = samples[0].teacher_topk[1].shape[1]
        top_ids = torch.full((batch, seq - 1, width), -1, dtype=torch.int64)
        top_ids[rows, cols] = torch.cat([s.teacher_topk[1] for s in samples]).to(torch.int64)
        top_logprobs = torch.zeros(batch, seq - 1, width, dtype=torch.float32)
        top_logprobs[rows, cols] = torch.cat([s.teacher_topk[0] for s in samples]).float()
    return MicroBatch(
        tokens_BS=tokens,
        loss_mask_BT=mask,
        rollout_logprobs_BT=rollout,
        token_versions_BT=versions_BT,
        advantages_B=advantages,
        lengths=lengths,
        samples=list(samples),
        support_BTK=support,
        teacher_logprobs_BT=teacher,
        teacher_topk_ids_BTK=top_ids,
        teacher_topk_logprobs_BTK=top_logprobs,
    )


def _support_BTK(samples, rows, cols, seq: int) -> torch.Tensor:
    """int64 ``[b, s - 1, K]``: every sample's ``support_RK`` at its predicted response positions
    (``rows``, ``cols``), -1 elsewhere; ``K`` the widest support."""
    if any(s.support_RK is None for s in samples):
        raise ValueError(_mixed_supports(samples))
    for i, s in enumerate(samples):
        if s.support_RK.dim() != 2 or s.support_RK.shape[0] != s.response_ids.numel():
            raise ValueError(
                f"sample {i}: support_RK {tuple(s.support_RK.shape)} must be [R, K] with one "
                f"row per response token (R = {s.response_ids.numel()})"
            )
    width = max(s.support_RK.shape[1] for s in samples)
    out = torch.full((len(samples), seq - 1, width), -1, dtype=torch.int64)
    pad = torch.nn.functional.pad
    out[rows, cols] = torch.cat(
        [pad(s.support_RK, (0, width - s.support_RK.shape[1]), value=-1) for s in samples]
    ).to(torch.int64)
    return out


def _mixed_supports(samples) -> str:
    without = [i for i, s in enumerate(samples) if s.support_RK is None]
    return (
        f"samples {without[:8]} have no sampling support (support_RK) while others do: with "
        "--logprobs-on-sampling-support every sample must carry the support its tokens were "
        "drawn from (a rollout function returns the engine's RolloutSample.support_RK)"
    )


def _ragged_positions(counts: torch.Tensor, offsets: torch.Tensor):
    """(row, column) int64 ``[sum counts]`` of ``counts[i]`` consecutive columns of row ``i``
    from ``offsets[i]``: the scatter targets of rows concatenated end to end."""
    rows = torch.repeat_interleave(torch.arange(counts.numel()), counts)
    starts = torch.cumsum(counts, 0) - counts
    cols = torch.arange(rows.numel()) - torch.repeat_interleave(starts - offsets, counts)
    return rows, cols


def trained_tokens(sample: TrainSample) -> torch.Tensor:
    """bool ``[R]``: the response tokens of ``sample`` in the loss."""
    if not sample.in_loss:
        return torch.zeros(sample.response_ids.numel(), dtype=torch.bool)
    if sample.response_mask is None:
        return torch.ones(sample.response_ids.numel(), dtype=torch.bool)
    return sample.response_mask.to(torch.bool)


def merge_micro_batches(parts: Sequence[MicroBatch], pad_id: int = 0) -> MicroBatch:
    """``parts`` stacked row-wise into one ``[sum b, max s]`` micro-batch, rows in part order.

    Each part is padded on the right to the widest part's ``s``: tokens with ``pad_id``, the
    per-token fields with their padding values (loss mask False, log-probs 0, versions
    ``NO_VERSION``). Part ``p``'s rows are ``[r_p, r_p + b_p)`` with ``r_p = sum_{q < p} b_q``
    and its tensors are the merged ones' ``[r_p : r_p + b_p, : s_p]`` (``: s_p - 1`` per token).
    Widths stay multiples of whatever every part's width is a multiple of.
    """
    if not parts:
        raise ValueError("merge_micro_batches needs at least one micro-batch")
    width = max(mb.tokens_BS.shape[1] for mb in parts)

    def cat(field: str, value, columns: int) -> torch.Tensor:
        tensors = [getattr(mb, field) for mb in parts]
        pad = torch.nn.functional.pad
        return torch.cat([pad(t, (0, columns - t.shape[1]), value=value) for t in tensors])

    supports = [mb.support_BTK for mb in parts]
    support = None
    if any(t is not None for t in supports):
        if any(t is None for t in supports):
            raise ValueError("merge_micro_batches: some parts carry sampling supports, some not")
        depth = max(t.shape[2] for t in supports)
        support = torch.cat(
            [
                torch.nn.functional.pad(
                    t, (0, depth - t.shape[2], 0, width - 1 - t.shape[1]), value=-1
                )
                for t in supports
            ]
        )
    for field in ("teacher_logprobs_BT", "teacher_topk_ids_BTK"):
        present = [getattr(mb, field) is not None for mb in parts]
        if any(present) and not all(present):
            raise ValueError(f"merge_micro_batches: some parts carry {field}, some not")
    has_teacher, has_topk = parts[0].teacher_logprobs_BT is not None, present[0]

    def cat_rows(field: str, value) -> torch.Tensor:  # [b, s - 1, K] parts padded to width - 1
        pad = torch.nn.functional.pad
        tensors = [getattr(mb, field) for mb in parts]
        return torch.cat([pad(t, (0, 0, 0, width - 1 - t.shape[1]), value=value) for t in tensors])

    return MicroBatch(
        tokens_BS=cat("tokens_BS", pad_id, width),
        loss_mask_BT=cat("loss_mask_BT", False, width - 1),
        rollout_logprobs_BT=cat("rollout_logprobs_BT", 0.0, width - 1),
        token_versions_BT=cat("token_versions_BT", NO_VERSION, width - 1),
        advantages_B=torch.cat([mb.advantages_B for mb in parts]),
        lengths=[n for mb in parts for n in mb.lengths],
        samples=[s for mb in parts for s in mb.samples],
        support_BTK=support,
        teacher_logprobs_BT=cat("teacher_logprobs_BT", 0.0, width - 1) if has_teacher else None,
        teacher_topk_ids_BTK=cat_rows("teacher_topk_ids_BTK", -1) if has_topk else None,
        teacher_topk_logprobs_BTK=cat_rows("teacher_topk_logprobs_BTK", 0.0) if has_topk else None,
    )


def split(items: Sequence, size: int) -> list[list]:
    """Consecutive chunks of ``size`` (the last one may be shorter)."""
    if size < 1:
        raise ValueError(f"size={size}: chunks need at least one item")
    return [list(items[i : i + size]) for i in range(0, len(items), size)]
