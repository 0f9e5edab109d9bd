"""Turning a per-token loss into a scalar: the aggregation modes.

The per-token surrogate and its aggregation are independent choices (as in OpenRLHF/TRL/verl).
For a per-token loss ``l_it``, mask ``m_it``, ``n_i = sum_t m_it`` tokens in sequence ``i``:

==========================  =================================================================
``token-mean``              ``sum_it m_it l_it / N_tok``         (DAPO)
``seq-mean-token-mean``     ``sum_i (sum_t m_it l_it / n_i) / N_seq``   (GRPO, GSPO)
``seq-mean-token-sum``      ``sum_i sum_t m_it l_it / N_seq``    (REINFORCE on log pi(y))
``seq-mean-token-sum-norm`` ``sum_i sum_t m_it l_it / (N_seq * L)``  (Dr.GRPO, constant L)
==========================  =================================================================

``N_tok`` and ``N_seq`` default to this batch's token count and the number of sequences with at
least one masked-in token. Pass the *global* counts (over every micro-batch and data-parallel
rank of the optimizer step) as ``global_num_tokens`` / ``global_num_seqs``: each shard then
returns ``local sum / global count``, and **summing** the shards' losses (and gradients, e.g.
with an all-reduce SUM) reproduces the full-batch loss and gradient exactly. ``L`` is
``max_response_length`` (Dr.GRPO's constant generation budget); it defaults to the padded width
``T`` but should be fixed for a run so that micro-batches of different widths agree.
(verl's ``seq-mean-token-sum-norm`` divides by ``L`` only; ours also averages over sequences,
as in the Dr.GRPO objective; the two differ by a constant factor.)
"""

from __future__ import annotations

import torch

AGGREGATION_MODES = (
    "token-mean",
    "seq-mean-token-mean",
    "seq-mean-token-sum",
    "seq-mean-token-sum-norm",
)


def check_agg_mode(mode: str) -> None:
    if mode not in AGGREGATION_MODES:
        raise ValueError(f"loss_agg_mode={mode!r} is unknown; choose one of {AGGREGATION_MODES}")


def _denominator(local: torch.Tensor, global_value: float | int | None, what: str, field: str):
    if global_value is not None:
        if not global_value > 0:
            raise ValueError(f"{field} must be > 0, got {global_value}")
        return global_value
    if int(local) == 0:
        raise ValueError(
            f"loss_mask selects no {what}, so the mean is undefined; pass {field} (the count over "
            "the whole optimizer batch) when a micro-batch may hold no response token"
        )
    return local


def aggregate_padded(
    loss_BT: torch.Tensor,
    mask_BT: torch.Tensor,
    mode: str,
    *,
    global_num_tokens: float | int | None = None,
    global_num_seqs: float | int | None = None,
    max_response_length: int | None = None,
) -> torch.Tensor:
    """Aggregate a masked ``[B, T]`` per-token loss to a scalar (see the module docstring)."""
    check_agg_mode(mode)
    zero = loss_BT.new_zeros(())
    masked_BT = torch.where(mask_BT, loss_BT, zero)
    if mode == "token-mean":
        denom = _denominator(mask_BT.sum(), global_num_tokens, "token", "global_num_tokens")
        return masked_BT.sum() / denom
    num_tokens_B = mask_BT.sum(dim=-1)
    num_seqs = _denominator(
        (num_tokens_B > 0).sum(), global_num_seqs, "sequence", "global_num_seqs"
    )
    seq_sum_B = masked_BT.sum(dim=-1)
    if mode == "seq-mean-token-mean":
        return (seq_sum_B / num_tokens_B.clamp(min=1)).sum() / num_seqs
    if mode == "seq-mean-token-sum":
        return seq_sum_B.sum() / num_seqs
    length = loss_BT.shape[-1] if max_response_length is None else max_response_length
    if not length > 0:
        raise ValueError(f"max_response_length must be > 0, got {max_response_length}")
    return seq_sum_B.sum() / (num_seqs * length)
