"""The rollout phase's configuration: prompts per rollout, sampling, grouping, asynchrony."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.flags import bad_value, check_choice, check_positive_ints, option
from megatron_rl.train.advantages import ADVANTAGE_ESTIMATORS


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """Sampling and grouping of the rollout phase; one-step-off-policy rollouts."""

    rollout_batch_size: int = option(16, help="prompts per rollout")
    n_samples_per_prompt: int = option(8, help="samples per prompt (the group size)")
    max_response_length: int = option(4, help="longest response in tokens")
    temperature: float = option(1.0, help="sampling temperature (> 0)")
    top_p: float = option(1.0, help="nucleus sampling: keep tokens up to this mass (0, 1]")
    top_k: int = option(-1, help="keep the k most likely tokens (-1: no limit)")
    advantage_estimator: str = option(
        "grpo", choices=ADVANTAGE_ESTIMATORS, help="advantages from the group's rewards"
    )
    filter_zero_variance_groups: bool = option(
        False, help="mask groups whose rewards are all equal out of the loss"
    )
    dynamic_sampling: bool = option(
        False,
        help="drop groups whose rewards are all equal and refill the batch with further prompts "
        "until it holds --rollout-batch-size groups with signal (DAPO's dynamic sampling; see "
        "megatron_rl/train/dynamic_sampling.py)",
    )
    over_sampling_ratio: float = option(
        0.0,
        help="with --dynamic-sampling: draw ceil((1 + ratio) x --rollout-batch-size) prompts in "
        "the first round (EPIC's protocol: 0.1)",
    )
    dynamic_sampling_max_rounds: int = option(
        3,
        help="with --dynamic-sampling: extra rounds of prompts at most; then the batch is "
        "completed with dropped groups masked out of the loss (metric "
        "dynamic_sampling/short_groups)",
    )
    drop_overlong_groups: bool = option(
        False,
        help="with --dynamic-sampling: also drop a group with a response cut at "
        "--max-response-length",
    )
    async_rollout: bool = option(
        False,
        help="one-step-off-policy: generate rollout k+1 in the background while step k trains "
        "(samples are 1 weight version behind; see megatron_rl/train/async_rollout.py)",
    )
    max_staleness: int = option(
        1,
        help="with --async-rollout: a batch more than this many weight versions behind the "
        "trainer is dropped and generated again (>= 1; default 1)",
    )

    def __post_init__(self) -> None:
        check_positive_ints(self, "rollout_batch_size", "n_samples_per_prompt")
        check_positive_ints(self, "max_response_length")
        check_choice(self, "advantage_estimator", ADVANTAGE_ESTIMATORS)
        if self.n_samples_per_prompt < 2:  # every estimator compares a prompt's samples
            raise bad_value(
                self,
                "n_samples_per_prompt",
                f"--advantage-estimator {self.advantage_estimator} measures each sample against "
                "the other samples of its prompt, so a group of 1 has advantage 0 and nothing is "
                "learned; pass --n-samples-per-prompt 2 or more (8 is usual)",
            )
        if not (math.isfinite(self.temperature) and self.temperature > 0):
            raise bad_value(
                self,
                "temperature",
                "must be > 0 (at 0 every sample of a prompt is the same, every group has zero "
                "variance and nothing is learned)",
            )
        if not 0 < self.top_p <= 1:
            raise bad_value(self, "top_p", "must be in (0, 1] (1 keeps every token)")
        if self.top_k == 0 or self.top_k < -1:
            raise bad_value(self, "top_k", "must be -1 (no limit) or >= 1")
        if not (isinstance(self.max_staleness, int) and self.max_staleness >= 1):
            raise bad_value(
                self,
                "max_staleness",
                "must be an integer >= 1 (weight versions a batch may lag behind the trainer; "
                "with --async-rollout one batch is in flight, so its samples are 1 version "
                "behind)",
            )
        if not (math.isfinite(self.over_sampling_ratio) and self.over_sampling_ratio >= 0):
            raise bad_value(self, "over_sampling_ratio", "must be a finite number >= 0 (0.1: 10%)")
        if not (
            isinstance(self.dynamic_sampling_max_rounds, int)
            and self.dynamic_sampling_max_rounds >= 0
        ):
            raise bad_value(self, "dynamic_sampling_max_rounds", "must be an integer >= 0")
        refill = {
            "over_sampling_ratio": self.over_sampling_ratio != 0.0,
            "drop_overlong_groups": self.drop_overlong_groups,
        }
        for name, given in refill.items():
            if given and not self.dynamic_sampling:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} drops or over-draws groups for --dynamic-sampling; add "
                    f"--dynamic-sampling or drop {flag} ({type(self).__name__}.{name})"
                )
        if self.max_staleness != 1 and not self.async_rollout:
            raise ValueError(
                f"--max-staleness {self.max_staleness} without --async-rollout: synchronous "
                "rollouts are never stale; add --async-rollout or drop --max-staleness"
            )

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt
