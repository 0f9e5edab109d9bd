"""Score a batch of responses with one reward function, failing single samples, never the run."""

from __future__ import annotations

import logging
import math
import numbers
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import numpy as np

logger = logging.getLogger(__name__)

RewardFn = Callable[[str, str], float]
"""``reward_fn(response, answer) -> float``: decoded response text and reference answer."""


@dataclass(frozen=True, slots=True)
class RewardBatch:
    """Per-sample rewards of a batch of ``B`` responses.

    Attributes:
        rewards: ``B`` floats; 0.0 where the sample failed.
        failed: ``B`` bools; True where the function raised, returned something that is not a
            real number, or returned NaN/inf.
        errors: ``B`` messages (None where the sample did not fail) naming the sample index and
            the problem.
    """

    rewards: list[float]
    failed: list[bool]
    errors: list[str | None]

    @property
    def num_failed(self) -> int:
        return sum(self.failed)


def compute_rewards(
    reward_fn: RewardFn, responses: Sequence[str], answers: Sequence[str]
) -> RewardBatch:
    """``reward_fn(responses[i], answers[i])`` for every ``i``, each sample isolated.

    A return value counts when it is a real number (``int``, ``float``, ``bool`` and NumPy
    scalars included; ``True``/``False`` give 1.0/0.0, since verifiers often return bools) and
    finite. Anything else (an exception, ``None``, a string, a tensor, NaN, inf) fails that sample
    with reward 0.0; one warning per batch reports how many failed and the first error.
    ``KeyboardInterrupt`` and ``SystemExit`` still propagate.
    """
    if len(responses) != len(answers):
        raise ValueError(
            f"{len(responses)} responses but {len(answers)} answers: pass one answer per "
            "response (repeat a prompt's answer for each of its samples)"
        )
    rewards: list[float] = []
    failed: list[bool] = []
    errors: list[str | None] = []
    name = getattr(reward_fn, "__qualname__", repr(reward_fn))
    for index, (response, answer) in enumerate(zip(responses, answers, strict=True)):
        reward, error = _score_one(reward_fn, response, answer)
        if error is not None:
            error = f"sample {index}: reward function {name} {error}"
        rewards.append(reward)
        failed.append(error is not None)
        errors.append(error)
    num_failed = sum(failed)
    if num_failed:
        first = next(e for e in errors if e is not None)
        logger.warning(
            "reward: %d of %d samples failed (reward 0.0); first: %s",
            num_failed,
            len(failed),
            first,
        )
    return RewardBatch(rewards, failed, errors)


def _score_one(reward_fn: RewardFn, response: str, answer: str) -> tuple[float, str | None]:
    try:
        value = reward_fn(response, answer)
    except Exception as err:
        return 0.0, f"raised {type(err).__name__}: {err}"
    if not isinstance(value, (numbers.Real, np.bool_)):
        return 0.0, f"returned {type(value).__name__} {value!r:.80}, not a number"
    reward = float(value)
    if not math.isfinite(reward):
        return 0.0, f"returned the non-finite value {reward}"
    return reward, None
