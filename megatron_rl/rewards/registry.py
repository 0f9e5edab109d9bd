"""Reward functions by name: an explicit allowlist plus ``module:function`` for user code."""

from __future__ import annotations

import importlib
import inspect
from collections.abc import Callable

from megatron_rl.rewards.addition_trace_reward import score_addition_trace
from megatron_rl.rewards.batch import RewardFn
from megatron_rl.rewards.builtin_reward import score_builtin_response
from megatron_rl.rewards.math_reward import math_reward

_REWARDS: dict[str, Callable[[str, str], float]] = {
    "math": math_reward,
    "builtin": score_builtin_response,
    "addition-trace": score_addition_trace,
}


def available_rewards() -> tuple[str, ...]:
    """The built-in reward names, sorted."""
    return tuple(sorted(_REWARDS))


def get_reward_fn(name: str) -> RewardFn:
    """The reward function ``name``: a built-in name or ``"package.module:function"``.

    A ``module:function`` is imported with ``importlib`` (the module must be on ``sys.path``) and
    must be a callable taking ``(response: str, answer: str)`` and returning a float; one that
    cannot be called with two arguments is refused here, before training starts.
    """
    if name in _REWARDS:
        return _REWARDS[name]
    if ":" not in name:
        raise ValueError(
            f"unknown reward {name!r}; available: {', '.join(available_rewards())}, or "
            "'package.module:function' for a function (response: str, answer: str) -> float"
        )
    module_name, _, attr = name.partition(":")
    if not module_name or not attr:
        raise ValueError(f"reward {name!r}: write a user function as 'package.module:function'")
    try:
        module = importlib.import_module(module_name)
    except ImportError as err:
        raise ValueError(
            f"reward {name!r}: cannot import module {module_name!r} ({err}); make sure it is on "
            "sys.path (installed, or its folder in PYTHONPATH)"
        ) from err
    fn = module
    for part in attr.split("."):
        fn = getattr(fn, part, None)
        if fn is None:
            raise ValueError(f"reward {name!r}: module {module_name!r} has no attribute {attr!r}")
    if not callable(fn):
        raise ValueError(f"reward {name!r}: {attr!r} is a {type(fn).__name__}, not a function")
    try:
        signature = inspect.signature(fn)
    except (TypeError, ValueError):  # some C functions have no signature: accept them
        return fn
    try:
        signature.bind("response", "answer")
    except TypeError as err:
        raise ValueError(
            f"reward {name!r}: {attr}{signature} cannot be called as {attr}(response, answer) "
            f"({err}); give it exactly two positional parameters"
        ) from err
    return fn
