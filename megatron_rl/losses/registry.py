"""The policy-loss registry: an explicit allowlist of named losses and their hyperparameters.

A loss is a pure function ``fn(inputs: PaddedInputs, config) -> LossTerms`` plus a frozen config
dataclass whose fields are the loss's hyperparameters (validated in ``__post_init__``) and a
default aggregation mode. Register your own with::

    @register_policy_loss("my_loss", config=MyConfig, default_agg_mode="token-mean")
    def my_loss(inputs, config):
        ...
        return LossTerms(per_token_loss_BT, {"clip_frac": ...})
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import torch

from megatron_rl.losses.aggregation import check_agg_mode
from megatron_rl.losses.layout import PaddedInputs


@dataclass(slots=True)
class LossTerms:
    """What a loss function returns: ``[B, T]`` per-token loss and its own (unprefixed) metrics.

    ``clipped_BT``: a clipping loss's bool ``[B, T]`` map of the tokens whose gradient its clip
    removed (either side); `compute_policy_loss` turns it into the position-wise clipping metrics.
    None for a loss that does not clip.
    """

    per_token_loss_BT: torch.Tensor
    metrics: dict[str, torch.Tensor] = field(default_factory=dict)
    clipped_BT: torch.Tensor | None = None


LossFn = Callable[[PaddedInputs, Any], LossTerms]


@dataclass(frozen=True, slots=True)
class LossSpec:
    name: str
    fn: LossFn
    config_cls: type
    default_agg_mode: str
    sequence_advantages: bool  # the loss needs one advantage per sequence

    def make_config(self, hyperparameters: dict[str, Any]) -> Any:
        """Build the validated config; unknown names are a ``ValueError`` listing the known."""
        known = [f.name for f in dataclasses.fields(self.config_cls)]
        unknown = sorted(set(hyperparameters) - set(known))
        if unknown:
            raise ValueError(
                f"loss {self.name!r} has no hyperparameter(s) {unknown}; its hyperparameters are "
                f"{known or 'none'}"
            )
        return self.config_cls(**hyperparameters)


_REGISTRY: dict[str, LossSpec] = {}


def register_policy_loss(
    name: str,
    *,
    config: type,
    default_agg_mode: str,
    sequence_advantages: bool = False,
) -> Callable[[LossFn], LossFn]:
    """Decorator adding ``fn`` to the registry under ``name`` (a duplicate name is an error)."""
    if not dataclasses.is_dataclass(config):
        raise ValueError(f"config for loss {name!r} must be a dataclass, got {config!r}")
    check_agg_mode(default_agg_mode)

    def decorator(fn: LossFn) -> LossFn:
        if name in _REGISTRY:
            raise ValueError(f"a policy loss named {name!r} is already registered")
        _REGISTRY[name] = LossSpec(name, fn, config, default_agg_mode, sequence_advantages)
        return fn

    return decorator


def available_losses() -> tuple[str, ...]:
    """Names of every registered policy loss, sorted."""
    return tuple(sorted(_REGISTRY))


def get_loss_spec(name: str) -> LossSpec:
    try:
        return _REGISTRY[name]
    except KeyError:
        raise ValueError(
            f"unknown policy loss {name!r}; available losses: {', '.join(available_losses())}"
        ) from None
