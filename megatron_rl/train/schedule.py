"""How many steps, and how each rollout is cut into optimizer steps and micro-batches.

Staleness is explicit: one rollout holds ``rollout_batch_size * n_samples_per_prompt`` samples
and is consumed by ``N = samples / global_batch_size`` sequential optimizer steps (the
VESPO/EPIC papers' N = 8 is 8 updates per rollout).
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.flags import bad_value, check_positive_ints, option


@dataclass(frozen=True, kw_only=True, slots=True)
class ScheduleConfig:
    """Steps, batches and micro-batches (Megatron names)."""

    train_iters: int = option(80, help="RL steps, one rollout each")
    micro_batch_size: int = option(32, help="rows per micro-batch")
    global_batch_size: int = option(64, help="samples per optimizer step, over all DP ranks")
    # token balancing (see megatron_rl/train/balance.py)
    max_tokens_per_gpu: int | None = option(
        None,
        help="micro-batches by token budget: rows sorted by length are grouped so that rows x "
        "longest row (padded) stays within this (a longer sample goes alone); replaces "
        "--micro-batch-size; 0 or unset: --micro-batch-size rows (padding, no THD packing)",
    )
    balance_data: bool = option(
        False,
        help="re-split every mini-batch's samples over the data-parallel ranks by token count "
        "(Karmarkar-Karp, equal sample counts); the optimizer step sees the same samples",
    )
    max_bad_steps: int = option(3, help="consecutive non-finite updates before the run stops")
    # a run that cannot learn (see megatron_rl/train/learning_guard.py)
    max_no_signal_steps: int = option(
        5,
        help="consecutive steps without a learning signal before the run saves and stops with "
        "exit status 1: every group zero-variance (counted until the run's first step with a "
        "signal; the steps must span >= 64 prompts), or more than "
        "--max-reward-failure-fraction of the samples failing their reward; 0: never stop",
    )
    max_reward_failure_fraction: float = option(
        0.5,
        help="share of a step's samples whose reward may fail (raise, NaN, inf, not a number) "
        "before the step counts towards --max-no-signal-steps; failed samples leave the loss; "
        "1: never",
    )

    def __post_init__(self) -> None:
        check_positive_ints(
            self, "train_iters", "micro_batch_size", "global_batch_size", "max_bad_steps"
        )
        steps = self.max_no_signal_steps
        if isinstance(steps, bool) or not (isinstance(steps, int) and steps >= 0):
            raise bad_value(
                self, "max_no_signal_steps", "must be an integer >= 0 (0: never stop on it)"
            )
        if not 0.0 <= self.max_reward_failure_fraction <= 1.0:  # NaN fails too
            raise bad_value(
                self,
                "max_reward_failure_fraction",
                "must be in [0, 1] (0: any failed sample counts; 1: never stop on it)",
            )
        budget = self.max_tokens_per_gpu
        if budget is not None and (isinstance(budget, bool) or not isinstance(budget, int)):
            budget = -1
        if budget is not None and budget < 0:
            raise bad_value(
                self,
                "max_tokens_per_gpu",
                "must be an integer >= 1 (padded tokens per micro-batch), or 0 to keep "
                "--micro-batch-size rows",
            )
        if not self.token_budget and self.global_batch_size % self.micro_batch_size:
            raise ValueError(
                f"--global-batch-size {self.global_batch_size} is not a multiple of "
                f"--micro-batch-size {self.micro_batch_size}"
            )

    @property
    def token_budget(self) -> int | None:
        """Padded tokens per micro-batch (--max-tokens-per-gpu); None: fixed-row micro-batches."""
        return self.max_tokens_per_gpu or None
