"""Small numeric helpers shared by the losses: exponentials that cannot overflow, masked
reductions, and per-token hyperparameters in the input's dtype.

``LOG_RATIO_CAP = 20`` bounds every importance ratio that a loss must exponentiate without a
clip of its own (the PPO branch for negative advantages, GSPO's sequence ratio, KL k3):
``capped_exp`` returns ``exp(min(x, 20))`` (at most 4.85e8) but keeps the gradient of ``exp`` at
the cap, i.e. above the cap the term acts as ``4.85e8 * grad(x)``. Inside the cap every formula
is exact; beyond it this is the one stated approximation, and it only touches ratios that no
finite float32 computation could represent anyway.
"""

from __future__ import annotations

import torch

LOG_RATIO_CAP = 20.0


def capped_exp(log_x: torch.Tensor, cap: float = LOG_RATIO_CAP) -> torch.Tensor:
    """``exp(min(log_x, cap))`` whose gradient w.r.t. ``log_x`` is the returned value everywhere."""
    log_x_detached = log_x.detach()
    return torch.exp(log_x_detached.clamp(max=cap) + (log_x - log_x_detached))


def masked_mean(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Mean of ``values`` where ``mask`` is true; 0 when the mask is empty (metrics only)."""
    zero = values.new_zeros(())
    total = torch.where(mask, values, zero).sum()
    return total / mask.sum().clamp(min=1)


def masked_extreme(values: torch.Tensor, mask: torch.Tensor, largest: bool) -> torch.Tensor:
    """Max (or min) of ``values`` where ``mask`` is true; 0 for an empty mask (metrics only)."""
    if values.numel() == 0:
        return values.new_zeros(())
    fill = values.new_tensor(float("-inf") if largest else float("inf"))
    filled = torch.where(mask, values, fill)
    extreme = filled.max() if largest else filled.min()
    return torch.where(mask.any(), extreme, values.new_zeros(()))


def where_scalars(
    cond: torch.Tensor, if_true: float, if_false: float, like: torch.Tensor
) -> torch.Tensor:
    """``if_true`` where ``cond`` else ``if_false``, in ``like``'s dtype and on its device.

    ``torch.where(cond, 1.05, 2.0)`` on Python floats makes a float32 tensor, so a float64 run
    would see ``1.05`` rounded to ``1.0499999523``; here each value is materialised directly in
    ``like.dtype`` (exact in float64, the usual rounding in float32).
    """
    return torch.where(cond, like.new_full((), if_true), like.new_full((), if_false))
