"""Asynchronous rollouts (``--async-rollout``): generation overlaps training, K batches ahead.

The schedule (slime's ``train_async.py``, verl's one-step-off-policy trainer, generalised to K
batches as AReaL's bounded staleness): ``K = --max-staleness`` rollouts are drawn ahead of the
trainer and generated in the background, one after another, by a producer thread on each
generator rank, while the trainer trains. With K = 1 (the default), rollout ``k + 1`` generates
while step ``k`` trains; with K = 2 rollout ``k + 2`` may start as soon as ``k + 1`` is done, and
so on: generation waits for the trainer only when K batches are ready. Before each weight sync
the running generation finishes and no other starts until the sync is done, so every batch is
generated under one weight version, which every `TrainSample` carries (``weight_version``). A
batch drawn at step ``k`` is trained at step ``k + K`` at the latest, so the trained samples are
at most K versions behind the trainer's weights (0 at the first step and after a resume, where
the batch is generated in the foreground).

Bounded staleness: a batch more than ``--max-staleness`` versions behind the trainer's current
weights (when it is about to be trained on) is dropped and generated again, for the same
prompts, with the current weights (metric ``async/dropped_batches``). In a normal run this does
not happen; it guards against a batch that waited while the weights moved more often (an extra
sync between steps, a resumed or replayed schedule).

Partial rollouts (``--partial-rollout``): the running batch does not end before the sync; the
sync pauses it in the engine's pause mode (SGLang ``--sglang-pause-mode retract|in_place``; the
in-process engine parks its decoding loop at a token boundary), updates the weights and lets it
continue, so a sample may span versions and carries its per-segment versions
(``TrainSample.weight_versions``). Its behaviour log-probs are the engine's (enforced at parse
time), and ``--mask-stale-tokens`` drops tokens more than K versions old from the loss
(`megatron_rl.train.token_versions`). The staleness guard then looks at each sample's newest
token. Without ``--carry-over-groups`` a batch is taken when all of its samples are done; with it,
unfinished groups are carried to the next rollout (`megatron_rl.train.carry_over`), and a batch
past the staleness bound is trained as it is (its carried groups exist once: generating it again
would train them twice); ``--mask-stale-tokens`` then keeps its too-old tokens out of the loss.

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
updates the weights after the producer has stopped (`Producer.hold`). On CPU the trainer counts
the generation thread as one more local process when it chooses torch's thread count
(`megatron_rl.threads`).

Checkpoints record the sampler position of the last batch trained on: batches generated in the
background but not yet trained on are not saved, and are drawn and generated again (same prompts
and seeds, the restored weights) after a resume, so no prompt is lost or duplicated.
"""

from __future__ import annotations

import collections
import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

from megatron_rl.train.rollout_source import RolloutBatch, RolloutHooks

logger = logging.getLogger(__name__)


class Producer:
    """The generator rank's background generation: batches in submission order, one at a time.

    ``generate(prompts, index)`` runs in a daemon thread (torch releases the GIL inside its ops).
    `hold` stops it from starting another batch and waits for the running one (a weight sync
    then finds the engine idle: one weight version per batch); `release` lets it go on. Errors
    are re-raised by `result` in the trainer's thread. ``intervals``: ``(start, end)`` of the last
    16 generations, for the timing metrics, the running one (if any) ending now (`spans`).
    """

    def __init__(self, generate: Callable[[list[int], int], object]) -> None:
        self._generate = generate
        self._jobs: collections.deque[tuple[int, list[int]]] = collections.deque()
        self._results: dict[int, tuple[object, BaseException | None]] = {}
        self._cond = threading.Condition()
        self._open, self._busy, self._stopped = True, False, False
        self.intervals: list[tuple[float, float]] = []  # replaced, never mutated
        self._running_since: float | None = None  # the running generation's start
        self._thread = threading.Thread(target=self._loop, daemon=True, name="rollout-producer")
        self._thread.start()

    def submit(self, index: int, prompts: list[int]) -> None:
        with self._cond:
            self._jobs.append((index, prompts))
            self._cond.notify_all()

    def result(self, index: int) -> object:
        """Rollout ``index``'s ``(samples, metrics)``, waiting for it; raises its error."""
        with self._cond:
            self._cond.wait_for(lambda: index in self._results)
            value, error = self._results.pop(index)
        if error is not None:
            raise error
        return value

    def hold(self) -> None:
        """Start no other batch, and wait for the running one."""
        with self._cond:
            self._open = False
            self._cond.wait_for(lambda: not self._busy)

    def release(self) -> None:
        with self._cond:
            self._open = True
            self._cond.notify_all()

    def discard(self) -> None:
        """Drop the batches not started and the results not taken; wait for the running one."""
        with self._cond:
            self._jobs.clear()
            self._cond.wait_for(lambda: not self._busy)
            self._results.clear()

    def close(self) -> None:
        with self._cond:
            self._stopped = True
            self._jobs.clear()
            self._cond.notify_all()
        self._thread.join()

    def spans(self) -> list[tuple[float, float]]:
        """``intervals`` and, if a generation is running (one that outlives a step: partial
        rollouts), ``(its start, now)``, so a step counts the part of it that fell within."""
        with self._cond:
            running = self._running_since
            spans = list(self.intervals)
        return spans if running is None else [*spans, (running, time.perf_counter())]

    def _loop(self) -> None:
        while True:
            with self._cond:
                self._cond.wait_for(lambda: self._stopped or (self._open and self._jobs))
                if self._stopped:
                    return
                index, prompts = self._jobs.popleft()
                self._busy = True
                start, value, error = time.perf_counter(), None, None
                self._running_since = start
            try:
                value = self._generate(prompts, index)
            except BaseException as err:  # re-raised in the trainer's thread by `result`
                error = err
            with self._cond:
                self.intervals = [*self.intervals[-15:], (start, time.perf_counter())]
                self._running_since = None
                self._results[index] = (value, error)
                self._busy = False
                self._cond.notify_all()


@dataclass
class PendingBatch:
    """A rollout drawn ahead of its step (and generating, or queued, on the generator rank)."""

    index: int
    prompts: list[int]  # this rank's share
    sampler_before: dict  # the sampler state before it was drawn


class AsyncRollouts:
    """`RolloutSource` of ``--async-rollout``: up to ``depth = --max-staleness`` rollouts are
    drawn ahead and generated in the background, one after another, while the trainer trains
    (see the module docstring); the first step's batch, and the first after a resume, is
    generated in the foreground.

    Metrics: ``async/staleness_*`` and ``async/dropped_batches`` of the batch taken;
    ``time/generation`` (the generator's seconds generating within the step),
    ``async/overlap_fraction`` (the part of it that overlapped training) and ``time/engine_idle``
    (step time minus generation) as the generator rank saw them; ``time/trainer_idle`` (waiting
    for the rollout: the fetch at the start, the hold before the sync).
    """

    def __init__(
        self,
        hooks: RolloutHooks,
        *,
        max_staleness: int,
        last_index: int,
        partial: bool = False,
        regenerate_stale: bool = True,
    ) -> None:
        self.hooks = hooks
        self.max_staleness = max_staleness
        self.partial = partial  # the sync pauses the running batch instead of waiting for it
        self.regenerate_stale = regenerate_stale  # False: a stale batch is trained as it is
        self.depth = max_staleness
        self.last_index = last_index  # no rollout at or beyond it is drawn (--train-iters)
        self.pending: collections.deque[PendingBatch] = collections.deque()
        self.producer = Producer(hooks.generate) if hooks.generate is not None else None
        self._step_start = 0.0
        self._train: tuple[float, float] = (0.0, 0.0)
        self._foreground: list[tuple[float, float]] = []  # generations in the trainer's thread
        self._waiting = 0.0  # seconds the trainer waited for the rollout

    def take(self, index: int, weight_version: int) -> RolloutBatch:
        """Rollout ``index``: drawn ahead (regenerated when more than ``max_staleness`` versions
        behind ``weight_version``), or drawn and generated now when none is pending."""
        hooks = self.hooks
        self._step_start, self._foreground, self._waiting = time.perf_counter(), [], 0.0
        if self.pending and self.pending[0].index != index:
            raise RuntimeError(
                f"async rollouts: step {index} but the next pending rollout is "
                f"{self.pending[0].index}; call clear() after changing the step"
            )
        if not self.pending:  # the first step, or after a resume: generate in the foreground
            before = hooks.sampler.state_dict()
            self.pending.append(PendingBatch(index, hooks.draw(), before))
            if self.producer is not None:
                self.producer.submit(index, self.pending[0].prompts)
        batch = self.pending.popleft()
        result = None
        if self.producer is not None:
            start = time.perf_counter()
            result = self.producer.result(index)
            self._waiting += time.perf_counter() - start
        dropped = 0.0
        if self.producer is not None:
            samples, _ = result
            behind = weight_version - min(newest_version(s) for s in samples)
            if behind > self.max_staleness and not self.regenerate_stale:
                logger.warning(
                    "step %d: rollout %d versions behind (> --max-staleness %d): trained as it "
                    "is (carried groups are never generated twice)",
                    index,
                    behind,
                    self.max_staleness,
                )
            elif behind > self.max_staleness:  # too old: the same prompts, current weights
                start = time.perf_counter()
                result = hooks.generate(batch.prompts, index)
                self._foreground.append((start, time.perf_counter()))
                dropped = 1.0
                logger.warning(
                    "step %d: rollout %d versions behind (> --max-staleness %d): regenerated",
                    index,
                    behind,
                    self.max_staleness,
                )
        samples, metrics = hooks.share(result)
        versions = [s.weight_version for s in samples]
        metrics.update(staleness_metrics(versions, weight_version, self.max_staleness))
        metrics["async/dropped_batches"] = dropped
        return RolloutBatch(
            samples=samples,
            metrics=metrics,
            prompts=list(batch.prompts),
            sampler_before=batch.sampler_before,
        )

    def start_next(self, index: int) -> None:
        """Draw rollouts ``index .. index + depth - 1`` not drawn yet (none at or beyond
        ``last_index``) and queue them for the background generation."""
        hooks = self.hooks
        drawn = self.pending[-1].index + 1 if self.pending else index
        for next_index in range(drawn, min(index + self.depth, self.last_index)):
            before = hooks.sampler.state_dict()
            batch = PendingBatch(next_index, hooks.draw(), before)
            self.pending.append(batch)
            if self.producer is not None:
                self.producer.submit(next_index, batch.prompts)

    def finish(self, train: tuple[float, float]) -> None:
        """Before the weight sync: the running generation ends first (one version per batch)
        and none starts until `resume`; with partial rollouts it runs on, and the sync pauses
        it (the engine's pause mode) and lets it continue under the new weights."""
        self._train = train
        if self.producer is not None and not self.partial:
            start = time.perf_counter()
            self.producer.hold()
            self._waiting += time.perf_counter() - start

    def resume(self) -> None:
        """After the weight sync: the background generation goes on, with the new weights."""
        if self.producer is not None:
            self.producer.release()

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        """The generator rank's timings on every rank (a collective), and ``time/trainer_idle``."""
        timing = None
        if self.producer is not None:
            window = (self._step_start, time.perf_counter())
            background = self.producer.spans()
            generation = sum(overlap(span, window) for span in [*background, *self._foreground])
            overlapped = sum(overlap(span, self._train) for span in background)
            timing = {
                "time/generation": generation,
                "async/overlap_fraction": overlapped / generation if generation > 0 else 0.0,
                "time/engine_idle": max(0.0, metrics["time/step"] - generation),
            }
        out = dict(self.hooks.share(timing))
        out["time/trainer_idle"] = self._waiting
        return out

    def trained_sampler_state(self) -> dict:
        """Batches drawn ahead are not trained on yet: the state from before the first was
        drawn."""
        if self.pending:
            return dict(self.pending[0].sampler_before)
        return self.hooks.sampler.state_dict()

    def clear(self) -> None:
        """Drop the batches drawn ahead (a resume draws them again), after the running one."""
        self.pending.clear()
        if self.producer is not None:
            self.producer.discard()
            self.producer.release()

    def close(self) -> None:
        self.clear()
        if self.producer is not None:
            self.producer.close()


def newest_version(sample) -> int:
    """The weight version of a sample's newest token (its last span's, else its only one)."""
    spans = getattr(sample, "weight_versions", ())
    return max([sample.weight_version, *(version for version, _, _ in spans)])


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
