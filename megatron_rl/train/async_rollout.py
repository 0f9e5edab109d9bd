"""One-step-off-policy rollouts (``--async-rollout``): generation overlaps training.

The schedule (slime's ``train_async.py``, verl's one-step-off-policy trainer): while step ``k``
trains on rollout ``k``, rollout ``k + 1`` is generated in the background with the weights of
version ``v`` (the engine's weights after step ``k - 1``'s sync). The background generation has
finished before step ``k``'s weight sync starts, and generation of ``k + 2`` starts (at step
``k + 1``) under version ``v + 1``: every batch is generated under one weight version, and every
`TrainSample` carries that version (``weight_version``). One batch is in flight, so the trained
samples are one version behind the trainer's weights (0 at the first step and after a resume,
where the batch is generated in the foreground).

Bounded staleness: a batch more than ``--max-staleness`` versions behind the trainer's current
weights (when it is about to be trained on) is dropped and generated again, for the same
prompts, with the current weights (metric ``async/dropped_batches``). With one batch in flight
and ``S >= 1`` this does not happen in a normal run; it guards against a batch that waited
while the weights moved more than once (an extra sync between steps, a resumed or replayed
schedule).

Partial rollouts (interrupting a running batch at a sync and finishing it under the new
weights, so that one sample spans several versions) are not done: the in-process engine holds
its lock for a whole ``generate`` call and has no pause-and-resume of a running batch, and a
sample generated under one version keeps its behaviour policy well defined for the losses.

Behaviour log-probs of stale samples: the policy that generated a sample is version ``v``; the
old-logprob pass recomputes log-probs with the trainer's current weights (``v + 1``).
``--behavior-logprobs rollout`` makes the loss's ratio ``pi_theta / mu_v`` with the engine's
log-probs, the behaviour policy of the VESPO/EPIC setting. With ``--behavior-logprobs trainer``
the ratio is taken against the current weights (1 at the first update), i.e. the decoupled
"proximal policy" form, which ignores the one-version gap unless ``--rollout-correction``
reweights by ``pi_current / mu_v`` (its weights use the engine's log-probs, so they cover the
staleness too). The trainer warns about ``trainer`` without a correction. (On the embedded
task, one version behind, both choices learned alike within seed-to-seed noise.)

Threads: the generation runs in a Python thread on each generator rank (torch releases the GIL
inside its ops); the engine's own lock serialises it with weight updates, and the trainer only
updates the weights after joining the thread. On CPU the trainer counts the generation thread as
one more local process when it chooses torch's thread count (`megatron_rl.threads`).

Checkpoints record the sampler position of the last batch trained on: a batch generated in the
background but not yet trained on is not saved, and is generated again (same prompts and seed,
the restored weights) after a resume, so no prompt is lost or duplicated.
"""

from __future__ import annotations

import contextlib
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl.train.rollout_source import RolloutBatch, RolloutHooks

logger = logging.getLogger(__name__)


class BackgroundGeneration:
    """Runs ``fn()`` in a daemon thread; ``join`` returns its result or raises its error."""

    def __init__(self, fn: Callable[[], object]) -> None:
        self.started = time.perf_counter()
        self.finished: float | None = None
        self._result: object = None
        self._error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, args=(fn,), daemon=True)
        self._thread.start()

    def _run(self, fn) -> None:
        try:
            self._result = fn()
        except BaseException as error:  # re-raised in the trainer's thread by join
            self._error = error
        finally:
            self.finished = time.perf_counter()

    def join(self) -> object:
        self._thread.join()
        if self._error is not None:
            raise self._error
        return self._result


@dataclass
class AsyncState:
    """The batch of the next step, drawn (and generated, or generating) ahead of it."""

    indices: list[int] | None = None  # prompts of the next rollout (this rank's share)
    sampler_before: dict | None = None  # sampler state before the next rollout was drawn
    generation: BackgroundGeneration | None = None
    result: object = None  # the joined (samples, metrics) of the next rollout

    @property
    def pending(self) -> bool:
        return self.indices is not None

    def clear(self) -> None:
        if self.generation is not None:
            with contextlib.suppress(Exception):  # a discarded batch's error does not matter
                self.generation.join()
        self.indices = self.sampler_before = self.generation = self.result = None


class AsyncRollouts:
    """`RolloutSource` of ``--async-rollout``: rollout ``k + 1`` generates while step ``k``
    trains (see the module docstring); the first step's batch, and the first after a resume,
    is generated in the foreground.

    Metrics: ``async/staleness_*`` and ``async/dropped_batches`` of the batch taken;
    ``time/generation`` (the generator's seconds generating within the step),
    ``async/overlap_fraction`` (the part of it that overlapped training) and ``time/engine_idle``
    (step time minus generation) as the generator rank saw them; ``time/trainer_idle`` (waiting
    for the rollout: the foreground fetch at the start, the join at the end).
    """

    def __init__(self, hooks: RolloutHooks, *, max_staleness: int) -> None:
        self.hooks = hooks
        self.max_staleness = max_staleness
        self.state = AsyncState()
        self._generated: list[tuple[float, float]] = []  # generation intervals within the step
        self._overlapped = 0.0  # seconds of background generation that overlapped training
        self._joining = 0.0  # seconds spent waiting for the background generation

    def take(self, index: int, weight_version: int) -> RolloutBatch:
        """The batch generated ahead (regenerated when more than ``max_staleness`` versions
        behind ``weight_version``), or generated now when none is pending."""
        hooks, state = self.hooks, self.state
        self._generated, self._overlapped, self._joining = [], 0.0, 0.0
        if not state.pending:  # the first step, or after a resume: generate in the foreground
            state.sampler_before = hooks.sampler.state_dict()
            state.indices = hooks.draw()
            if hooks.generate is not None:
                state.result = self._generate_now(state.indices, index)
        dropped = 0.0
        if hooks.generate is not None:
            samples, _ = state.result
            behind = weight_version - min(s.weight_version for s in samples)
            if behind > self.max_staleness:  # too old: the same prompts, current weights
                state.result = self._generate_now(state.indices, index)
                dropped = 1.0
                logger.warning(
                    "step %d: rollout %d versions behind (> --max-staleness %d): regenerated",
                    index,
                    behind,
                    self.max_staleness,
                )
        samples, metrics = hooks.share(state.result)
        batch = RolloutBatch(
            samples=samples,
            metrics=metrics,
            prompts=list(state.indices),
            sampler_before=state.sampler_before,
        )
        state.indices = state.sampler_before = state.result = None
        versions = [s.weight_version for s in samples]
        metrics.update(staleness_metrics(versions, weight_version, self.max_staleness))
        metrics["async/dropped_batches"] = dropped
        return batch

    def _generate_now(self, prompts: list[int], index: int):
        start = time.perf_counter()
        result = self.hooks.generate(prompts, index)
        self._generated.append((start, time.perf_counter()))
        return result

    def start_next(self, index: int) -> None:
        """Draw rollout ``index``'s prompts and generate them in the background."""
        hooks, state = self.hooks, self.state
        state.sampler_before = hooks.sampler.state_dict()
        state.indices = prompts = hooks.draw()
        if hooks.generate is not None:
            generate = hooks.generate
            state.generation = BackgroundGeneration(lambda: generate(prompts, index))

    def finish(self, train: tuple[float, float]) -> None:
        """Join the background generation: it ends before the sync (one version per batch)."""
        start, generation = time.perf_counter(), self.state.generation
        if generation is not None:
            self.state.result = generation.join()
            interval = (generation.started, generation.finished)
            self._generated.append(interval)
            self._overlapped = overlap(interval, train)
            self.state.generation = None
        self._joining = time.perf_counter() - start

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The generator rank's timings on every rank (a collective), and ``time/trainer_idle``."""
        generation = sum(end - begin for begin, end in self._generated)
        timing = {
            "time/generation": generation,
            "async/overlap_fraction": self._overlapped / generation if generation > 0 else 0.0,
            "time/engine_idle": max(0.0, metrics["time/step"] - generation),
        }
        out = dict(self.hooks.share(timing))
        out["time/trainer_idle"] = metrics["time/rollout"] + self._joining
        return out

    def trained_sampler_state(self) -> dict:
        """A batch drawn ahead is not trained on yet: the state from before it was drawn."""
        if self.state.pending:
            return dict(self.state.sampler_before)
        return self.hooks.sampler.state_dict()

    def clear(self) -> None:
        """Wait for a generation still running (an error mid-step) and drop the batch."""
        self.state.clear()


def staleness_metrics(versions: list[int], current: int, max_staleness: int) -> dict[str, float]:
    """``async/staleness_mean`` and ``async/staleness_hist/d`` (samples ``d`` versions behind
    ``current``, for every ``d`` in ``0..max_staleness``: fixed keys, every rank the same)."""
    behind = [current - v for v in versions]
    out = {"async/staleness_mean": sum(behind) / len(behind) if behind else 0.0}
    for d in range(max_staleness + 1):
        out[f"async/staleness_hist/{d}"] = float(sum(b == d for b in behind))
    return out


def overlap(a: tuple[float, float], b: tuple[float, float]) -> float:
    """Seconds two ``(start, end)`` intervals share."""
    return max(0.0, min(a[1], b[1]) - max(a[0], b[0]))
