"""Dropped servers are re-probed in the background, on an exponential backoff; a weight sync
never waits for a probe.

A server that a weight sync dropped (dead, failing, or stalled: it accepts connections and never
answers) is probed with ``/health`` by a daemon thread of its own, first ``interval_s`` after the
drop, then after each failed probe with the wait doubled, up to ``max_interval_s``:

    wait_k = min(max_interval_s, interval_s * 2**k)    (k = failed probes so far)

A probe that answers 200 makes the server `ready`: the next weight sync takes it in, and it
rejoins the pool only once that sync reached it whole (`WeightSync`). A ready server whose sync
fails is watched again with its backoff where it left off (`retry`); an admitted one is
forgotten (`forget`), so a later drop starts from ``interval_s`` again.

The same semantics as sglang-router's background health checker and slime's rollout heartbeat
(a thread per check, outside the request path), minus the thresholds: one good probe only earns a
full weight sync, which is itself the real check. A stalled server costs a thread blocked in a
probe for up to the pool's ``health_timeout_s``, never a step.
"""

from __future__ import annotations

import dataclasses
import logging
import math
import threading
from collections.abc import Callable

logger = logging.getLogger(__name__)


@dataclasses.dataclass(kw_only=True, slots=True)
class ReprobeConfig:
    """``interval_s``: seconds from a drop to the first re-probe (``--sglang-reprobe-interval``);
    ``max_interval_s``: the cap of the doubling wait (``--sglang-reprobe-max-interval``)."""

    interval_s: float = 10.0
    max_interval_s: float = 300.0

    def __post_init__(self) -> None:
        if not (math.isfinite(self.interval_s) and self.interval_s > 0):
            raise ValueError(
                f"ReprobeConfig.interval_s={self.interval_s!r}: must be a number of seconds > 0 "
                "(--sglang-reprobe-interval)"
            )
        if not (math.isfinite(self.max_interval_s) and self.max_interval_s >= self.interval_s):
            raise ValueError(
                f"ReprobeConfig.max_interval_s={self.max_interval_s!r}: must be >= interval_s="
                f"{self.interval_s!r} (--sglang-reprobe-max-interval >= --sglang-reprobe-interval)"
            )

    def wait_s(self, failures: int) -> float:
        """Seconds before the next probe after ``failures`` failed ones."""
        return min(self.max_interval_s, self.interval_s * 2.0 ** min(failures, 60))


class Reprober:
    """Background re-probing of dropped servers; ``probe(url) -> bool`` is `HttpPool.probe`.

    Thread-safe. ``probes_started`` counts probes sent (tests and logs); `ready` never blocks.
    """

    def __init__(self, probe: Callable[[str], bool], config: ReprobeConfig) -> None:
        self._probe = probe
        self.config = config
        self._lock = threading.Lock()
        self._closed = threading.Event()
        self._failures: dict[str, int] = {}  # url -> failed probes (and failed rejoins) so far
        self._threads: dict[str, threading.Thread] = {}  # url -> its probing thread
        self._ready: set[str] = set()
        self.probes_started = 0

    def watch(self, url: str) -> None:
        """Start re-probing ``url`` unless it is already being probed or is ready."""
        with self._lock:
            if url in self._threads or url in self._ready or self._closed.is_set():
                return
            failures = self._failures.setdefault(url, 0)
            thread = threading.Thread(
                target=self._run,
                args=(url, self.config.wait_s(failures)),
                name=f"reprobe {url}",
                daemon=True,
            )
            self._threads[url] = thread
        thread.start()

    def ready(self) -> list[str]:
        """The watched servers whose last probe answered, sorted; they wait for a full sync."""
        with self._lock:
            return sorted(self._ready)

    def retry(self, url: str) -> None:
        """``url`` was ready but did not take the whole sync: probe it again, backing off."""
        with self._lock:
            self._ready.discard(url)
            self._failures[url] = self._failures.get(url, 0) + 1
        self.watch(url)

    def forget(self, url: str) -> None:
        """``url`` rejoined the pool: stop watching it and reset its backoff."""
        with self._lock:
            self._ready.discard(url)
            self._failures.pop(url, None)
            self._threads.pop(url, None)  # a probe still running ends without effect

    def close(self) -> None:
        """Stop every probing thread (a probe in flight ends by its own timeout)."""
        self._closed.set()

    def _run(self, url: str, wait_s: float) -> None:
        me = threading.current_thread()
        while not self._closed.wait(wait_s):
            with self._lock:
                if self._threads.get(url) is not me:
                    return  # forgotten meanwhile
                self.probes_started += 1
            try:
                answered = self._probe(url)
            except Exception as err:  # a probe that raises is a failed probe, not a dead thread
                logger.debug("re-probe of %s raised %s: %s", url, type(err).__name__, err)
                answered = False
            with self._lock:
                if self._threads.get(url) is not me:
                    return
                if answered:
                    del self._threads[url]
                    self._ready.add(url)
                else:
                    self._failures[url] += 1
                    wait_s = self.config.wait_s(self._failures[url])
            if answered:
                logger.warning(
                    "dropped server %s answers /health again: it takes part in the next weight "
                    "sync and rejoins the pool once it has received all of it",
                    url,
                )
                return
            logger.debug("dropped server %s does not answer; next probe in %.1f s", url, wait_s)
