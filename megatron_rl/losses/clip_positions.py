"""Where in a response the clip acts: clipped-token counts and fractions per relative-position bin.

EPIC (Li et al. 2026, arXiv 2610.29999, Sec. 4.3, Figure 3, App. 10.4) compares trust regions by
how evenly their clipping spreads over a response: the clip fraction in each relative-position
bin and the position-wise coefficient of variation (CV) of those fractions (late-stage EPIC
0.054, CTPO 0.085, RIPO 0.126; the Raw-prob ablation clips almost only in the first bin). The
paper states neither the bin count nor the CV's exact form; we use ``num_bins = 10`` (the
position buckets of the authors' public verl fork) and the population CV below.

Definitions, for a sequence with ``n`` masked-in tokens, its ``t``-th one (1-based):

* relative position ``(t - 1) / n`` in ``[0, 1)``, bin ``k = floor((t - 1) K / n)`` (integer
  arithmetic, so bin edges are exact), ``K = num_bins``. The authors' code bins ``t / n`` into
  right-closed intervals instead (bin ``ceil(t K / n) - 1``): the same bins whenever ``K``
  divides ``n``, otherwise a token whose span ``[(t - 1) / n, t / n]`` crosses an edge joins the
  later bin there;
* per bin: ``tokens_k`` masked tokens and ``clipped_k`` of them clipped, over the whole batch
  (token-weighted, so longer responses count more, as in every token-level clip fraction);
* ``frac_k = clipped_k / tokens_k`` for the bins holding tokens;
* ``CV = std_k(frac_k) / mean_k(frac_k)`` over the bins holding tokens, population std
  (divide by the number of such bins); ``0`` when ``mean_k(frac_k) = 0`` (nothing clipped: the
  profile is flat) or no bin holds a token.

The counts are additive, so counts summed (or averaged with equal weights) over micro-batches and
data-parallel ranks give the profile of the whole step: `clip_profile_from_counts` recomputes
the fractions and the CV from them. Averaging per-micro-batch CVs would not.
"""

from __future__ import annotations

import math
import re

import torch

DEFAULT_NUM_BINS = 10
_TOKENS, _CLIPPED, _FRAC, _CV = (
    "clip_pos_tokens_",
    "clip_pos_clipped_",
    "clip_frac_pos_",
    "clip_position_cv",
)


def relative_position_bins(mask_BT: torch.Tensor, num_bins: int = DEFAULT_NUM_BINS) -> torch.Tensor:
    """``[B, T]`` int64 bin ``floor((t - 1) K / n)`` of every masked-in token, ``-1`` elsewhere."""
    _check_num_bins(num_bins)
    mask = mask_BT.to(torch.int64)
    t_BT = torch.cumsum(mask, dim=-1)  # 1-based index among the masked-in tokens
    n_B1 = mask.sum(dim=-1, keepdim=True).clamp(min=1)
    bins_BT = torch.div((t_BT - 1).clamp(min=0) * num_bins, n_B1, rounding_mode="floor")
    return torch.where(mask_BT, bins_BT, torch.full_like(bins_BT, -1))


def check_clipped_map(clipped_BT: object, mask_BT: torch.Tensor, owner: str) -> None:
    """``ValueError`` unless ``clipped_BT`` is a bool tensor shaped like ``mask_BT``."""
    if not isinstance(clipped_BT, torch.Tensor):
        raise ValueError(
            f"{owner}: clipped_BT must be a bool torch.Tensor, got {type(clipped_BT).__name__}"
        )
    if clipped_BT.dtype != torch.bool or tuple(clipped_BT.shape) != tuple(mask_BT.shape):
        raise ValueError(
            f"{owner}: clipped_BT must be bool with the padded loss mask's shape "
            f"{tuple(mask_BT.shape)}, got {clipped_BT.dtype} of shape {tuple(clipped_BT.shape)}"
        )


def clip_position_counts(
    clipped_BT: torch.Tensor, mask_BT: torch.Tensor, num_bins: int = DEFAULT_NUM_BINS
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(clipped_K, tokens_K)`` float64 counts per bin; only tokens inside ``mask_BT`` count."""
    bins_BT = relative_position_bins(mask_BT, num_bins)
    # positions outside the mask go to an extra bin K that is dropped (no boolean indexing, so
    # no host-device synchronisation)
    index_N = torch.where(mask_BT, bins_BT, num_bins).reshape(-1)
    counts = torch.zeros(2, num_bins + 1, dtype=torch.float64, device=mask_BT.device)
    counts[0].index_add_(0, index_N, torch.ones_like(index_N, dtype=torch.float64))
    counts[1].index_add_(0, index_N, (clipped_BT & mask_BT).reshape(-1).to(torch.float64))
    return counts[1, :num_bins], counts[0, :num_bins]


def position_profile(
    clipped_K: torch.Tensor, tokens_K: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """``(frac_K, cv)`` from per-bin counts: ``frac_k = clipped_k / tokens_k`` (0 for an empty
    bin) and the population CV of the fractions over the non-empty bins (0 when their mean is 0).
    """
    occupied = tokens_K > 0
    frac_K = torch.where(occupied, clipped_K / tokens_K.clamp(min=1e-300), 0.0)
    count = occupied.sum().clamp(min=1)
    mean = frac_K.sum() / count  # empty bins hold 0 and are not counted
    var = torch.where(occupied, (frac_K - mean) ** 2, 0.0).sum() / count
    cv = torch.where(mean > 0, var.sqrt() / mean.clamp(min=1e-300), 0.0)
    return frac_K, cv


def clip_position_metrics(
    clipped_BT: torch.Tensor, mask_BT: torch.Tensor, num_bins: int = DEFAULT_NUM_BINS
) -> dict[str, torch.Tensor]:
    """Unprefixed metrics ``clip_pos_tokens_{k}``, ``clip_pos_clipped_{k}`` (counts),
    ``clip_frac_pos_{k}`` and ``clip_position_cv``, all float64 scalars; ``k = 0..K-1``.

    ``clipped_BT`` (bool) and ``mask_BT`` (bool) are ``[B, T]``; clipped tokens outside the mask
    are ignored.
    """
    check_clipped_map(clipped_BT, mask_BT, "clip_position_metrics")
    clipped_K, tokens_K = clip_position_counts(clipped_BT, mask_BT, num_bins)
    frac_K, cv = position_profile(clipped_K, tokens_K)
    metrics: dict[str, torch.Tensor] = {}
    for k in range(num_bins):
        metrics[f"{_TOKENS}{k}"] = tokens_K[k]
        metrics[f"{_CLIPPED}{k}"] = clipped_K[k]
        metrics[f"{_FRAC}{k}"] = frac_K[k]
    metrics[_CV] = cv
    return metrics


def clip_profile_from_counts(
    metrics: dict[str, float], prefix: str = "policy/"
) -> dict[str, float]:
    """Fractions ``{prefix}clip_frac_pos_{k}`` and ``{prefix}clip_position_cv`` recomputed from
    the counts ``{prefix}clip_pos_tokens_{k}`` / ``{prefix}clip_pos_clipped_{k}`` in ``metrics``
    (e.g. averaged over micro-batches and ranks). ``{}`` when ``metrics`` holds no counts.
    """
    pattern = re.compile(re.escape(prefix + _TOKENS) + r"(\d+)$")
    bins = sorted(int(m.group(1)) for key in metrics if (m := pattern.match(key)))
    if not bins:
        return {}
    if bins != list(range(len(bins))):
        raise ValueError(
            f"{prefix}{_TOKENS}<k> keys must cover bins 0..K-1 without gaps, got bins {bins}"
        )
    tokens, clipped = [], []
    for k in bins:
        key = f"{prefix}{_CLIPPED}{k}"
        if key not in metrics:
            raise ValueError(f"metrics has {prefix}{_TOKENS}{k} but not {key}")
        tokens.append(float(metrics[f"{prefix}{_TOKENS}{k}"]))
        clipped.append(float(metrics[key]))
    if not all(math.isfinite(v) for v in tokens + clipped):
        raise ValueError(f"non-finite clip-position counts under prefix {prefix!r}")
    frac_K, cv = position_profile(
        torch.tensor(clipped, dtype=torch.float64), torch.tensor(tokens, dtype=torch.float64)
    )
    profile = {f"{prefix}{_FRAC}{k}": float(frac_K[k]) for k in bins}
    profile[f"{prefix}{_CV}"] = float(cv)
    return profile


def _check_num_bins(num_bins: int) -> None:
    if isinstance(num_bins, bool) or not isinstance(num_bins, int) or num_bins < 1:
        raise ValueError(f"num_bins must be an int >= 1, got {num_bins!r}")
