"""The rollout phase's configuration: prompts per rollout, sampling, grouping, asynchrony."""

from __future__ import annotations

import math
from dataclasses import dataclass

from megatron_rl.flags import bad_value, check_choice, check_positive_ints, option
from megatron_rl.train.advantages import ADVANTAGE_ESTIMATORS
from megatron_rl.train.rollout_function import DEFAULT_ROLLOUT_FUNCTION
from megatron_rl.train.rollouts.schedule import SCHEDULES, RolloutSchedule


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutConfig:
    """Sampling and grouping of the rollout phase; one-step-off-policy rollouts."""

    rollout_function: str = option(
        DEFAULT_ROLLOUT_FUNCTION,
        help="module:function that generates a batch's samples from its prompts and an engine "
        "handle (multi-turn, tools, ...; contract in megatron_rl/train/rollout_function.py); "
        "default: the built-in single-turn rollout, or the built-in --task's own (calculator's "
        "multi-turn tool rollout); not with partial or carry-over schedules",
    )
    rollout_batch_size: int = option(16, help="prompts per rollout")
    n_samples_per_prompt: int = option(8, help="samples per prompt (the group size)")
    max_response_length: int = option(4, help="longest response in tokens")
    temperature: float = option(1.0, help="sampling temperature (> 0)")
    top_p: float = option(1.0, help="nucleus sampling: keep tokens up to this mass (0, 1]")
    top_k: int = option(-1, help="keep the k most likely tokens (-1: no limit)")
    logprobs_on_sampling_support: bool = option(
        False,
        help="the engine records each token's top-k/top-p sampling support and reports its "
        "log-prob renormalised on it; the trainer's policy and old log-probs are renormalised on "
        "the same support (DeepSeek-V3.2's keep-sampling-mask; SGLang's return_sampling_mask). "
        "Needs a finite --top-k, which bounds the stored support",
    )
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
        "megatron_rl/train/rollouts/dynamic_sampling.py)",
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
    rollout_schedule: str | None = option(
        None,
        choices=SCHEDULES,
        help="when a step's batch is generated: sync (at the step), async (ahead, while the "
        "trainer trains), partial (async, requests in flight at a sync pause and go on), "
        "carry-over (--carry-over-groups M unfinished groups go on at the next rollout), or "
        "async/partial+carry-over (default: what the alias flags below say, else sync; see "
        "megatron_rl/train/rollouts/schedule.py)",
    )
    async_rollout: bool = option(
        False,
        help="alias of --rollout-schedule async; one-step-off-policy: generate rollout k+1 in "
        "the background while step k trains (samples are 1 weight version behind; see "
        "megatron_rl/train/rollouts/async_rollout.py)",
    )
    max_staleness: int = option(
        1,
        help="with --async-rollout: K, the rollouts generated ahead of the trainer (samples are "
        "at most K weight versions behind; a batch further behind is generated again; default 1)",
    )
    partial_rollout: bool = option(
        False,
        help="with --async-rollout, alias of --rollout-schedule partial: samples may span weight "
        "updates: requests in flight at a weight sync are paused, not aborted, and finish under "
        "the new weights, each token "
        "recording its version (with SGLang this needs an engine pause mode, --sglang-pause-mode "
        "retract or in_place); requires --behavior-logprobs rollout or a --rollout-correction "
        "(the engine's per-token log-probs are the behaviour policy)",
    )
    carry_over_groups: int = option(
        0,
        help="M > 0: over-long generation does not stall a step: M more groups than "
        "--rollout-batch-size stay in flight, generated in rounds of "
        "--carry-over-round-tokens; a step trains on the first finished groups and carries "
        "the others, unfinished samples going on at the next rollout (Kimi k1.5's partial "
        "rollouts; see megatron_rl/train/rollouts/carry_over.py); requires --behavior-logprobs "
        "rollout or a --rollout-correction",
    )
    carry_over_round_tokens: int = option(
        0,
        help="with --carry-over-groups: new tokens per sample and round (0: a quarter of "
        "--max-response-length, at least 1)",
    )
    mask_stale_tokens: bool = option(
        False,
        help="with --async-rollout: tokens generated by weights more than --max-staleness "
        "versions behind the trainer are masked out of the loss (per token: slime's "
        "--mask-offpolicy-in-partial-rollout; see megatron_rl/train/token_versions.py)",
    )

    save_rollouts: str | None = option(
        None,
        help="write each step's batch (samples, rewards, log-probs, routes, rollout metrics) "
        "to DIR/step_<n>/rank_<dp rank>.pt (see megatron_rl/train/rollouts/dump.py)",
    )
    load_rollouts: str | None = option(
        None,
        help="train from the batches a --save-rollouts run wrote to DIR instead of generating "
        "(no prompts drawn; the training replays the writing run's bit for bit)",
    )
    rollout_only: bool = option(
        False,
        help="generate and score each step's batch (and write it with --save-rollouts) without "
        "training or weight syncs: metrics of the rollouts only",
    )

    def __post_init__(self) -> None:
        self._resolve_schedule()
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
        if self.logprobs_on_sampling_support and self.top_k == -1:
            raise bad_value(
                self,
                "top_k",
                "--logprobs-on-sampling-support stores each token's support: set a finite "
                "--top-k (e.g. 512), which bounds it (SGLang rejects the request otherwise)",
            )
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
        if self.dynamic_sampling and self.max_staleness > 1:
            raise ValueError(
                f"--dynamic-sampling with --max-staleness {self.max_staleness}: the refill rounds "
                "draw prompts after the batches drawn ahead, which a checkpoint would draw again; "
                "use --max-staleness 1 with --dynamic-sampling"
            )
        if not (isinstance(self.carry_over_groups, int) and self.carry_over_groups >= 0):
            raise bad_value(self, "carry_over_groups", "must be an integer >= 0 (0: off)")
        if not (
            isinstance(self.carry_over_round_tokens, int) and self.carry_over_round_tokens >= 0
        ):
            raise bad_value(
                self,
                "carry_over_round_tokens",
                "must be an integer >= 0 (0: a quarter of --max-response-length)",
            )
        if self.carry_over_round_tokens and not self.carry_over_groups:
            raise ValueError(
                "--carry-over-round-tokens needs --carry-over-groups M > 0 (the groups kept in "
                "flight); add it or drop --carry-over-round-tokens"
            )
        if self.carry_over_groups and self.dynamic_sampling:
            raise ValueError(
                "--carry-over-groups with --dynamic-sampling: both decide which drawn groups a "
                "step trains on; use one of them"
            )
        needs_async = {
            "partial_rollout": "a sample spans weight updates only when generation overlaps "
            "training",
            "mask_stale_tokens": "synchronous rollouts are never stale (but carried groups "
            "are: --carry-over-groups allows it)",
        }
        for name, why in needs_async.items():
            stale_anyway = name == "mask_stale_tokens" and self.carry_over_groups > 0
            if getattr(self, name) and not self.async_rollout and not stale_anyway:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"{flag} needs --async-rollout ({why}); add --async-rollout or drop {flag} "
                    f"({type(self).__name__}.{name})"
                )
        if self.max_staleness != 1 and not (self.async_rollout or self.carry_over_groups):
            raise ValueError(
                f"--max-staleness {self.max_staleness} without --async-rollout: synchronous "
                "rollouts are never stale; add --async-rollout or drop --max-staleness"
            )
        self._check_rollout_dumps()
        self._check_rollout_function()

    def _check_rollout_function(self) -> None:
        """A custom ``--rollout-function`` resolves (imported now: a typo fails at parse time)
        and runs whole batches: not with a schedule that pauses or carries samples mid-way."""
        if self.rollout_function == DEFAULT_ROLLOUT_FUNCTION:
            return
        from megatron_rl.train.rollout_function import resolve_rollout_function

        resolve_rollout_function(self.rollout_function)
        check_custom_schedule(self.rollout_function, self.schedule)

    def _resolve_schedule(self) -> None:
        """``--rollout-schedule`` given: the alias flags must agree with it and take its values,
        and the field goes back to None, so both spellings build equal configs and every later
        check reads one truth (`schedule`); not given: the aliases decide."""
        if self.rollout_schedule is None:
            return
        check_choice(self, "rollout_schedule", SCHEDULES)
        chosen = RolloutSchedule.parse(self.rollout_schedule)
        aliases = {"async_rollout": chosen.overlap, "partial_rollout": chosen.partial}
        for name, value in aliases.items():
            if getattr(self, name) and not value:
                flag = "--" + name.replace("_", "-")
                raise ValueError(
                    f"--rollout-schedule {self.rollout_schedule} with {flag}: the alias asks "
                    f"for another schedule; drop {flag} ({type(self).__name__}.{name})"
                )
            object.__setattr__(self, name, value)
        if chosen.carry_over and not self.carry_over_groups:
            raise ValueError(
                f"--rollout-schedule {self.rollout_schedule} needs --carry-over-groups M > 0 "
                "(the groups kept in flight beyond --rollout-batch-size); add it"
            )
        if self.carry_over_groups and not chosen.carry_over:
            raise ValueError(
                f"--carry-over-groups {self.carry_over_groups} with --rollout-schedule "
                f"{self.rollout_schedule}: carried groups need a carry-over schedule; use "
                f"--rollout-schedule {RolloutSchedule(chosen.overlap, chosen.partial, True).name}"
            )
        object.__setattr__(self, "rollout_schedule", None)

    @property
    def schedule(self) -> RolloutSchedule:
        """The resolved ``--rollout-schedule`` (held by its alias fields)."""
        return RolloutSchedule(
            overlap=self.async_rollout,
            partial=self.partial_rollout,
            carry_over=self.carry_over_groups > 0,
        )

    def _check_rollout_dumps(self) -> None:
        """--save-rollouts / --load-rollouts / --rollout-only against the schedule flags."""
        if self.load_rollouts is not None:
            if self.save_rollouts is not None:
                raise ValueError(
                    "--load-rollouts with --save-rollouts: a replay writes no new dump; drop "
                    "--save-rollouts (the dump in --load-rollouts is the record)"
                )
            if self.rollout_only:
                raise ValueError(
                    "--rollout-only with --load-rollouts: a replay generates nothing and "
                    "--rollout-only trains nothing; drop one of them"
                )
            drawing = {
                "async_rollout": self.async_rollout,
                "dynamic_sampling": self.dynamic_sampling,
                "carry_over_groups": self.carry_over_groups > 0,
            }
            for name, given in drawing.items():
                if given:
                    flag = "--" + name.replace("_", "-")
                    raise ValueError(
                        f"--load-rollouts with {flag}: a replay trains each stored batch as "
                        f"its step's, with no generation to schedule; drop {flag} "
                        f"({type(self).__name__}.{name})"
                    )
        if self.rollout_only and self.async_rollout:
            raise ValueError(
                "--rollout-only with --async-rollout: without training there is nothing to "
                "overlap generation with; drop --async-rollout"
            )

    @property
    def round_tokens(self) -> int:
        """``--carry-over-round-tokens``, its default resolved."""
        return self.carry_over_round_tokens or max(1, self.max_response_length // 4)

    @property
    def samples_per_rollout(self) -> int:
        return self.rollout_batch_size * self.n_samples_per_prompt


def check_custom_schedule(name: str, schedule: RolloutSchedule) -> None:
    """ValueError when rollout function ``name`` (not the built-in single-turn one) meets a
    schedule that continues samples across rollouts or weight syncs: its turns would need
    pausing and resuming mid-sample, which the contract does not cover."""
    if schedule.partial or schedule.carry_over:
        raise ValueError(
            f"--rollout-function {name} with --rollout-schedule {schedule.name}: a custom "
            "rollout function runs whole batches (its turns are not paused at a weight sync nor "
            "carried to the next rollout); use --rollout-schedule sync or async"
        )
