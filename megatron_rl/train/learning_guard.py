"""Stop a run that cannot learn, saying why: no learning signal, or a reward that keeps failing.

Two conditions, each counted over consecutive steps from the step's metrics *after* they are
averaged over all ranks (`megatron_rl.collectives.mean_over_ranks`), so every rank reaches the
same decision without another collective:

* **no signal**: ``rollout/learning_signal_frac == 0``: no sample in the loss has a non-zero
  advantage, because in every group all scored samples got the same reward (a ``--temperature``
  so low that a prompt's samples are identical, a reward that gives every response the same
  score, prompts no sample answers). Counted only until the run's first step with a signal (the
  state is checkpointed): a policy that has solved its prompts also gets equal rewards, and it
  is not broken. The streak must also span at least ``MIN_NO_SIGNAL_PROMPTS`` prompts (groups),
  so that a toy run of a few prompts per step is not stopped by chance (a policy that answers
  1% of samples right leaves 64 groups of 8 all without a signal with probability 0.6%).
* **reward failures**: ``reward/failed_frac > max_failure_fraction``: the reward function raised,
  or returned NaN, inf or no number, on too many samples. Below the fraction the failed samples
  only leave the loss (`megatron_rl.train.rollouts.phase`).

After ``max_steps`` such steps in a row (no signal: and ``MIN_NO_SIGNAL_PROMPTS`` prompts) the
guard is `exhausted`: the run saves and stops with `TrainingStopped` (``python -m
megatron_rl.train`` exits with status 1) and `stop_message` says why and what to change.
``max_steps == 0`` turns both checks off. A step that is not counted resets its condition's
count.
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

logger = logging.getLogger(__name__)

SIGNAL_METRIC = "rollout/learning_signal_frac"
MIN_NO_SIGNAL_PROMPTS = 64
"""Prompts (groups) over all ranks that a no-signal streak must span to stop the run."""
FAILURE_METRIC = "reward/failed_frac"


class LearningGuard:
    """Consecutive-step counts of the two conditions (``no_signal``, ``reward_failing``)."""

    @classmethod
    def from_config(cls, config) -> LearningGuard:
        """The guard of a `TrainConfig` (``--max-no-signal-steps``,
        ``--max-reward-failure-fraction``)."""
        return cls(
            config.schedule.max_no_signal_steps,
            config.schedule.max_reward_failure_fraction,
            prompts_per_step=config.rollout.rollout_batch_size,
            reward=config.task.reward,
            temperature=config.rollout.temperature,
            dense_signal=config.teacher.enabled and config.teacher.kl_coef > 0,
        )

    def __init__(
        self,
        max_steps: int,
        max_failure_fraction: float,
        *,
        prompts_per_step: int,
        reward: str,
        temperature: float,
        dense_signal: bool = False,
    ) -> None:
        """``prompts_per_step``: groups per step over all ranks (``--rollout-batch-size``);
        ``reward``, ``temperature``: the flags' values, for the stop message; ``dense_signal``:
        every trained token has a learning signal besides the reward's (a distillation teacher,
        `megatron_rl.train.teacher`), so equal rewards never stop the run."""
        if max_steps < 0:
            raise ValueError(f"max_steps={max_steps}: must be >= 0 (0: never stop)")
        if not 0.0 <= max_failure_fraction <= 1.0:
            raise ValueError(f"max_failure_fraction={max_failure_fraction}: must be in [0, 1]")
        self.max_steps = max_steps
        self.max_failure_fraction = max_failure_fraction
        self.prompts_per_step = prompts_per_step
        # the no-signal steps in a row that stop the run: max_steps, or more to span the minimum
        self.no_signal_limit = max(max_steps, -(-MIN_NO_SIGNAL_PROMPTS // prompts_per_step))
        self.reward = reward
        self.temperature = temperature
        self.signal_seen = dense_signal  # a step with a learning signal happened (checkpointed)
        self.no_signal = 0  # steps in a row without signal (checkpointed)
        self.reward_failing = 0  # steps in a row over the failure fraction (checkpointed)
        self.first_error: str | None = None  # set by the trainer when the reward stops the run
        self._last: dict[str, float] = {}

    @property
    def reward_exhausted(self) -> bool:
        return 0 < self.max_steps <= self.reward_failing

    @property
    def exhausted(self) -> bool:
        """Whether the run must stop (the same on every rank: see the module docstring)."""
        no_signal = self.max_steps > 0 and self.no_signal >= self.no_signal_limit
        return self.reward_exhausted or no_signal

    def record(self, metrics: Mapping[str, float], step: int) -> None:
        """Count step ``step``'s outcome from its metrics averaged over ranks; warn when counted.

        A metric that is missing counts as healthy (no signal check without
        ``rollout/learning_signal_frac``, no failure check without ``reward/failed_frac``).
        """
        if self.max_steps == 0:
            return
        self._last = {k: float(metrics[k]) for k in ("reward/mean", FAILURE_METRIC) if k in metrics}
        failed = float(metrics.get(FAILURE_METRIC, 0.0))
        self.reward_failing = self.reward_failing + 1 if failed > self.max_failure_fraction else 0
        if self.reward_failing:
            logger.warning(
                "step %d: the reward failed on %.0f%% of the samples (%d step(s) in a row over "
                "--max-reward-failure-fraction %g; the run stops at %d)",
                step,
                100 * failed,
                self.reward_failing,
                self.max_failure_fraction,
                self.max_steps,
            )
        signal = float(metrics.get(SIGNAL_METRIC, 1.0))
        if signal > 0:
            self.signal_seen, self.no_signal = True, 0
        elif not self.signal_seen:
            self.no_signal += 1
            logger.warning(
                "step %d: no learning signal: every group's rewards are equal, every advantage "
                "is 0 (%d step(s) in a row; the run stops at %d)",
                step,
                self.no_signal,
                self.no_signal_limit,
            )

    def stop_message(self, step: int) -> str:
        """Why the run stopped at ``step`` and what to change."""
        if self.reward_exhausted:
            failed = self._last.get(FAILURE_METRIC, 1.0)
            return (
                f"the reward --reward {self.reward} failed on {failed:.0%} of the samples for "
                f"{self.reward_failing} steps in a row (more than --max-reward-failure-fraction "
                f"{self.max_failure_fraction:g}); stopped at step {step}. First error: "
                f"{self.first_error or 'see the warnings above'}. Fix the reward function (call "
                "it on a few responses and answers), or check that --prompt-data's answers are "
                "what it expects (--answer-key)"
            )
        mean = self._last.get("reward/mean", 0.0)
        return (
            f"no learning signal for {self.no_signal} steps in a row "
            f"({self.no_signal * self.prompts_per_step} prompts): in every group all samples "
            f"got the same reward (reward/mean {mean:g}), so every advantage is 0 and nothing is "
            f"learned; stopped at step {step}. Likely causes: --temperature {self.temperature:g} "
            "too low (a prompt's samples are identical), a reward that scores every response "
            f"alike (check --reward {self.reward} on a few responses), or prompts no sample "
            "answers (reward/mean 0: an easier dataset or a stronger --model). Raise "
            "--max-no-signal-steps, or pass 0 to go on regardless"
        )

    def state_dict(self) -> dict:
        """What a checkpoint keeps: whether a signal was seen and both streaks, so a run
        killed mid-streak and resumed stops where the uninterrupted run would."""
        return {
            "signal_seen": self.signal_seen,
            "no_signal": self.no_signal,
            "reward_failing": self.reward_failing,
        }

    def load_state_dict(self, state: dict) -> None:
        self.signal_seen = bool(state["signal_seen"])
        self.no_signal = int(state.get("no_signal", 0))  # a checkpoint from before: no streak
        self.reward_failing = int(state.get("reward_failing", 0))
