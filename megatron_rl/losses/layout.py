"""Input validation and the padded <-> packed layouts of per-token loss inputs.

Two layouts reach the losses:

* padded: ``[B, T]`` tensors, one row per sequence, ``loss_mask`` marks the response tokens;
* packed (Megatron sequence packing, THD): ``[N]`` tensors holding the sequences back to back,
  with ``cu_seqlens`` ``[S + 1]`` (int, ``cu_seqlens[0] == 0``, non-decreasing,
  ``cu_seqlens[-1] == N``) giving the sequence boundaries.

Every loss is computed on the padded layout; packed inputs are scattered into a zero-padded
``[S, max_len]`` view (differentiable, so gradients flow back to the packed tensors) and the
per-token loss is gathered back. Padded and packed inputs holding the same sequences therefore run
the same arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch


@dataclass(frozen=True, slots=True)
class PackedLayout:
    """Where each packed token sits in the padded ``[S, max_len]`` view."""

    cu_seqlens: torch.Tensor  # [S + 1] int64
    row_N: torch.Tensor  # [N] sequence index of each packed token
    col_N: torch.Tensor  # [N] position of each packed token inside its sequence
    num_seqs: int
    max_len: int

    @classmethod
    def from_cu_seqlens(cls, cu_seqlens: torch.Tensor, num_tokens: int) -> PackedLayout:
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(
                "cu_seqlens must be a 1-D tensor [num_seqs + 1], got shape "
                f"{tuple(cu_seqlens.shape)}"
            )
        if cu_seqlens.is_floating_point() or cu_seqlens.is_complex():
            raise ValueError(f"cu_seqlens must be an integer tensor, got {cu_seqlens.dtype}")
        cu = cu_seqlens.to(torch.int64)
        lengths_S = cu[1:] - cu[:-1]
        if int(cu[0]) != 0 or bool((lengths_S < 0).any()) or int(cu[-1]) != num_tokens:
            raise ValueError(
                "cu_seqlens must start at 0, be non-decreasing and end at the number of packed "
                f"tokens ({num_tokens}); got {cu.tolist()[:8]}{'...' if cu.numel() > 8 else ''}"
            )
        num_seqs = lengths_S.numel()
        row_N = torch.repeat_interleave(torch.arange(num_seqs, device=cu.device), lengths_S)
        col_N = torch.arange(num_tokens, device=cu.device) - cu[:-1][row_N]
        max_len = int(lengths_S.max()) if num_seqs else 0
        return cls(cu, row_N, col_N, num_seqs, max_len)

    def to_padded(self, values_N: torch.Tensor) -> torch.Tensor:
        """Scatter ``[N]`` packed values into a zero-padded ``[S, max_len]`` tensor."""
        out_BT = values_N.new_zeros(self.num_seqs, self.max_len)
        return out_BT.index_put((self.row_N, self.col_N), values_N)

    def to_packed(self, values_BT: torch.Tensor) -> torch.Tensor:
        """Gather ``[S, max_len]`` values back to the ``[N]`` packed order."""
        return values_BT[self.row_N, self.col_N]


def _check_shape(name: str, tensor: torch.Tensor, expected: tuple[int, ...], hint: str) -> None:
    if not isinstance(tensor, torch.Tensor):
        raise ValueError(f"{name} must be a torch.Tensor, got {type(tensor).__name__}")
    if tuple(tensor.shape) != expected:
        raise ValueError(f"{name} has shape {tuple(tensor.shape)}, expected {expected} ({hint})")


def _check_finite_inside(name: str, tensor: torch.Tensor, mask: torch.Tensor) -> None:
    bad = ~torch.isfinite(tensor) & mask
    if bool(bad.any()):
        first = [int(i) for i in bad.nonzero()[0]]
        raise ValueError(
            f"{name} has {int(bad.sum())} non-finite value(s) inside loss_mask (first at index "
            f"{first}); fix the producer of {name} or exclude those positions from loss_mask"
        )


@dataclass(frozen=True, slots=True)
class PaddedInputs:
    """Validated inputs in the padded layout; positions outside the mask hold zeros."""

    logprobs_BT: torch.Tensor  # float32 or float64, differentiable
    old_logprobs_BT: torch.Tensor  # detached
    advantages_BT: torch.Tensor  # detached, broadcast to tokens
    mask_BT: torch.Tensor  # bool
    per_sequence_advantages: bool  # True when advantages were given as one value per sequence

    def sequence_advantages_B(self) -> torch.Tensor:
        """``[B]`` advantage at each sequence's first masked-in token (0 for empty rows)."""
        if self.mask_BT.shape[-1] == 0:  # zero-length rows: no token, no advantage
            return self.advantages_BT.new_zeros(self.mask_BT.shape[:-1])
        first_T = self.mask_BT.to(torch.uint8).argmax(dim=-1, keepdim=True)
        return self.advantages_BT.gather(1, first_T).squeeze(1)


def prepare_inputs(
    logprobs: torch.Tensor,
    old_logprobs: torch.Tensor,
    advantages: torch.Tensor,
    loss_mask: torch.Tensor,
    cu_seqlens: torch.Tensor | None,
    check_finite: bool,
) -> tuple[PaddedInputs, PackedLayout | None]:
    """Validate the loss inputs and bring them to the padded layout.

    Values outside ``loss_mask`` are replaced by zeros with ``torch.where`` before any arithmetic,
    so NaN/inf there can reach neither the loss nor the gradient.
    """
    if not isinstance(logprobs, torch.Tensor) or not logprobs.is_floating_point():
        raise ValueError("logprobs must be a floating-point torch.Tensor")
    if logprobs.dtype == torch.float16:
        raise ValueError(
            "logprobs is float16: importance ratios up to e^20 overflow float16 (max 65504) in "
            "the per-token loss and its gradient; pass float32 (logprobs.float()) or bfloat16"
        )
    packed = cu_seqlens is not None
    if packed and logprobs.dim() != 1:
        raise ValueError(
            "with cu_seqlens, logprobs must be packed 1-D [total_tokens], got shape "
            f"{tuple(logprobs.shape)}"
        )
    if not packed and logprobs.dim() != 2:
        raise ValueError(
            "logprobs must be [B, T] (or 1-D [total_tokens] together with cu_seqlens), got "
            f"shape {tuple(logprobs.shape)}"
        )
    shape = tuple(logprobs.shape)
    _check_shape("old_logprobs", old_logprobs, shape, "same shape as logprobs")
    _check_shape("loss_mask", loss_mask, shape, "same shape as logprobs")
    if loss_mask.dtype != torch.bool:
        if not bool(((loss_mask == 0) | (loss_mask == 1)).all()):
            raise ValueError("loss_mask must be bool or hold only 0 and 1")
        loss_mask = loss_mask != 0

    layout = PackedLayout.from_cu_seqlens(cu_seqlens, shape[0]) if packed else None
    num_seqs = layout.num_seqs if packed else shape[0]
    if not isinstance(advantages, torch.Tensor):
        raise ValueError(f"advantages must be a torch.Tensor, got {type(advantages).__name__}")
    if tuple(advantages.shape) == shape:
        per_sequence = False  # also the reading when packed N equals S: one value per token
    elif advantages.dim() == 1 and advantages.shape[0] == num_seqs:
        per_sequence = True
    else:
        expected = f"[{num_seqs}] (one per sequence) or {list(shape)} (one per token)"
        raise ValueError(f"advantages has shape {tuple(advantages.shape)}, expected {expected}")

    if packed:
        logprobs = layout.to_padded(logprobs)
        old_logprobs = layout.to_padded(old_logprobs)
        loss_mask = layout.to_padded(loss_mask)
        if not per_sequence:
            advantages = layout.to_padded(advantages)
    advantages = advantages.detach()
    if check_finite:
        _check_finite_inside("logprobs", logprobs.detach(), loss_mask)
        _check_finite_inside("old_logprobs", old_logprobs, loss_mask)
        _check_finite_inside(
            "advantages", advantages, loss_mask.any(dim=-1) if per_sequence else loss_mask
        )
    if per_sequence:
        advantages = advantages[:, None].expand(loss_mask.shape)

    dtype = torch.float64 if logprobs.dtype == torch.float64 else torch.float32
    zero = logprobs.new_zeros((), dtype=dtype)
    lp = torch.where(loss_mask, logprobs.to(dtype), zero)
    olp = torch.where(loss_mask, old_logprobs.detach().to(dtype), zero)
    adv = torch.where(loss_mask, advantages.to(dtype), zero)
    return PaddedInputs(lp, olp, adv, loss_mask, per_sequence), layout
