"""Where a step's rollout comes from: generated when the step asks, or ahead of it.

`Trainer.step` has one body (rollout, stop check, train, sync, metrics) and asks a source for
the rollout. `SyncRollouts` generates the batch when asked; `AsyncRollouts`
(`megatron_rl.train.rollouts.async_rollout`, ``--async-rollout``) hands over the batch it generated
while the previous step trained and starts the next one. The step calls, in this order:

    take(index, weight_version)    this step's batch (the stop check follows: on a stop the
                                   sampler goes back to ``batch.sampler_before``)
    start_next(index + 1)          unless the step is the run's last
    finish(train_interval)         before the weight sync: nothing may generate during it
    resume()                       after the weight sync
    step_metrics(metrics)          the source's own metrics, after the sync (a collective)

On every rank: the generator rank of each model-parallel group generates, the others receive its
result through ``share`` (`RolloutHooks`).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Protocol

from megatron_rl.data import PromptSampler
from megatron_rl.train.batch import TrainSample

Generated = tuple[list[TrainSample], dict[str, float]]  # (samples, rollout metrics)


@dataclass(frozen=True, kw_only=True, slots=True)
class RolloutHooks:
    """What a rollout source needs from the trainer."""

    sampler: PromptSampler  # the trainer's prompt sampler (its state is the checkpoint's)
    draw: Callable[[], list[int]]  # this rank's share of the next prompt batch (advances sampler)
    generate: Callable[[list[int], int], Generated] | None  # (prompts, rollout index); None:
    # not the generator rank (it gets the generator's result through ``share``)
    share: Callable[[object], object]  # the generator rank's object on every model-parallel rank


@dataclass(slots=True)
class RolloutBatch:
    """One step's rollout on this rank."""

    samples: list[TrainSample]
    metrics: dict[str, float]  # rollout metrics (the async source adds its staleness metrics)
    prompts: list[int]  # this rank's prompt indices
    sampler_before: dict  # the sampler state before ``prompts`` were drawn


class RolloutSource(Protocol):
    """A step's rollout schedule (see the module docstring for the order of the calls)."""

    def take(self, index: int, weight_version: int) -> RolloutBatch:
        """Rollout ``index`` (its sampling seed) for a trainer at ``weight_version``."""
        ...

    def start_next(self, index: int) -> None: ...

    def finish(self, train: tuple[float, float]) -> None:
        """Called before the weight sync; ``train``: this step's training (start, end)."""
        ...

    def resume(self) -> None:
        """Called after the weight sync."""
        ...

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The source's metrics of the step whose ``metrics`` (with ``time/*``) are given."""
        ...

    def trained_sampler_state(self) -> dict:
        """The sampler state after the last batch trained on (what a checkpoint records)."""
        ...

    def clear(self) -> None:
        """Drop any batch drawn ahead (a resume draws it again)."""
        ...

    def close(self) -> None:
        """Stop any background generation (the trainer closes)."""
        ...


class SyncRollouts:
    """Each step's batch generated when the step asks for it (the default schedule)."""

    def __init__(self, hooks: RolloutHooks) -> None:
        self.hooks = hooks

    def take(self, index: int, weight_version: int) -> RolloutBatch:
        hooks = self.hooks
        before = hooks.sampler.state_dict()
        prompts = hooks.draw()
        samples, metrics = hooks.share(
            hooks.generate(prompts, index) if hooks.generate is not None else None
        )
        return RolloutBatch(
            samples=samples, metrics=metrics, prompts=list(prompts), sampler_before=before
        )

    def start_next(self, index: int) -> None:
        """Nothing: the next batch is generated when its step asks."""

    def finish(self, train: tuple[float, float]) -> None:
        """Nothing runs beside the training."""

    def resume(self) -> None:
        """Nothing to resume."""

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return {}

    def trained_sampler_state(self) -> dict:
        return self.hooks.sampler.state_dict()

    def clear(self) -> None:
        """Nothing is drawn ahead."""

    def close(self) -> None:
        """Nothing runs in the background."""
