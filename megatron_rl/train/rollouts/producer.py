"""The generator rank's background generation thread of ``--async-rollout``.

Batches are generated one at a time, in submission order. Which weights generate a batch must
not depend on when this thread wakes up (`megatron_rl.train.rollouts.async_rollout`): `hold`, called
before a weight sync, returns only once every batch submitted so far has been generated (or,
with partial rollouts, started), so a batch is never left for after a sync it was submitted
before; until `release` no batch may be submitted.
"""

from __future__ import annotations

import collections
import threading
import time
from collections.abc import Callable

THREAD_NAME = "rollout-producer"


class Producer:
    """``generate(prompts, index)`` of each submitted batch, in a daemon thread (torch releases
    the GIL inside its ops); errors are re-raised by `result` in the trainer's thread.
    ``intervals``: ``(start, end)`` of the last 16 generations, for the timing metrics, the
    running one (if any) ending now (`spans`)."""

    def __init__(self, generate: Callable[[list[int], int], object]) -> None:
        self._generate = generate
        self._jobs: collections.deque[tuple[int, list[int]]] = collections.deque()
        self._results: dict[int, tuple[object, BaseException | None]] = {}
        self._cond = threading.Condition()
        self._busy, self._held, self._stopped = False, False, False
        self.intervals: list[tuple[float, float]] = []  # replaced, never mutated
        self._running_since: float | None = None  # the running generation's start
        self._thread = threading.Thread(target=self._loop, daemon=True, name=THREAD_NAME)
        self._thread.start()

    def submit(self, index: int, prompts: list[int]) -> None:
        """Queue rollout ``index``; refused between `hold` and `release` (a weight sync)."""
        with self._cond:
            if self._held:
                raise RuntimeError(
                    f"rollout {index} submitted while a weight sync holds the producer: the "
                    "weights it would be generated with depend on thread timing"
                )
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

    def hold(self, *, started_only: bool = False) -> None:
        """Before a weight sync: wait until every submitted batch has been generated
        (``started_only``: has started, the running one going on), then refuse submissions
        until `release`."""
        with self._cond:
            self._cond.wait_for(lambda: not self._jobs and (started_only or not self._busy))
            self._held = True

    def release(self) -> None:
        """After the weight sync: batches may be submitted again."""
        with self._cond:
            self._held = False

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
                self._cond.wait_for(lambda: self._stopped or self._jobs)
                if self._stopped:
                    return
                index, prompts = self._jobs.popleft()
                self._busy = True
                start, value, error = time.perf_counter(), None, None
                self._running_since = start
                self._cond.notify_all()  # a `hold(started_only=True)` may go on
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
