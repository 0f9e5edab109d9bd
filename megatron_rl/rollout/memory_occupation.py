"""SGLang's memory-occupation tags: which parts of a server's GPU memory are released.

SGLang 0.5.23 (``srt/constants.py``: ``GPU_MEMORY_ALL_TYPES``) releases and resumes three
regions through torch_memory_saver, by tag: ``kv_cache``, ``weights`` and ``cuda_graph``.
``/release_memory_occupation`` and ``/resume_memory_occupation`` take ``{"tags": [...]}``; no
tags (None or empty) means all three. The scheduler keeps the released tags in a set
(``SchedulerWeightUpdaterManager.offload_tags``,
``srt/managers/scheduler_components/weight_updater.py``): release adds each tag (a tag released
twice stays one entry), resume removes each with ``set.remove``, so resuming a tag that is not
released raises ``KeyError`` in the scheduler, which ends the server (``run_scheduler_process``
sends SIGQUIT to its parent on any exception). `MemoryOccupation` keeps the same set and
refuses that resume with a ``ValueError`` instead.

Calling them (`ServerMemory`, the client side of ``--colocate``). SGLang 0.5.23's release
*asserts* an idle scheduler (``is_fully_idle``); the assertion ends the scheduler, and with it
the server. Idle is more than "every answer came back": the scheduler clears its last batch
only on a later pass, and a request the client gave up on (read timeout, a retry elsewhere) may
still run. So each release first polls ``/flush_cache`` until the server reports idle (slime
does the same), bounded by the pool's ``flush_timeout_s``: a server still busy then fails the
release with a RuntimeError naming it, the server untouched. The calls go to every configured
server, never only the pool's current members: a server the pool dropped keeps its memory
(KV cache, weights) on GPUs the trainer is about to take, so a dropped server fails the call.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

RELEASE, RESUME = "/release_memory_occupation", "/resume_memory_occupation"

KV_CACHE = "kv_cache"
WEIGHTS = "weights"
CUDA_GRAPH = "cuda_graph"
MEMORY_TAGS = (KV_CACHE, WEIGHTS, CUDA_GRAPH)  # SGLang's GPU_MEMORY_ALL_TYPES, in its order


def memory_tags(tags: Sequence[str] | None) -> tuple[str, ...]:
    """The tags a request means: ``tags`` itself, or all three when None or empty (SGLang)."""
    return tuple(tags) if tags else MEMORY_TAGS


def check_memory_tags(tags: Sequence[str] | None) -> tuple[str, ...] | None:
    """``tags`` as a tuple (None stays None: all three); ValueError naming an unknown tag.

    SGLang itself accepts an unknown tag silently (it enters ``offload_tags`` and frees
    nothing); a client refuses it, so that a typo cannot leave memory occupied."""
    if tags is None:
        return None
    if isinstance(tags, str):
        raise ValueError(f"memory tags {tags!r}: pass a list of tags, e.g. [{tags!r}]")
    unknown = [t for t in tags if t not in MEMORY_TAGS]
    if unknown:
        raise ValueError(f"unknown memory tags {unknown}: choose from {MEMORY_TAGS}")
    return tuple(tags)


class MemoryOccupation:
    """The released tags of one server (thread-safe)."""

    def __init__(self) -> None:
        self._released: set[str] = set()
        self._lock = threading.Lock()

    def release(self, tags: Sequence[str] | None) -> tuple[str, ...]:
        """Mark ``tags`` (None/empty: all) released; the tags meant."""
        meant = memory_tags(tags)
        with self._lock:
            self._released.update(meant)
        return meant

    def resume(self, tags: Sequence[str] | None) -> tuple[str, ...]:
        """Mark ``tags`` (None/empty: all) resident again; ValueError, and nothing changed, when
        one of them is not released (SGLang's scheduler raises KeyError and dies there)."""
        meant = memory_tags(tags)
        with self._lock:
            missing = [t for t in meant if t not in self._released]
            if missing:
                raise ValueError(
                    f"resume_memory_occupation of {missing}, which are not released (released: "
                    f"{sorted(self._released)}); SGLang's scheduler raises KeyError here"
                )
            self._released.difference_update(meant)
        return meant

    def released(self) -> frozenset[str]:
        with self._lock:
            return frozenset(self._released)

    def missing_for(self, what: str, needed: Sequence[str]) -> str | None:
        """An error message when any of ``needed`` is released, else None."""
        gone = sorted(set(needed) & self.released())
        if not gone:
            return None
        return f"{what} needs GPU memory {gone}, which is released; resume_memory_occupation first"


class ServerMemory:
    """The memory-occupation calls to the worker servers of ``pool`` (an `HttpPool`); see the
    module docstring. Each call goes to every server at once and raises one RuntimeError naming
    every server that failed."""

    def __init__(self, pool) -> None:
        self.pool = pool

    def release(self, tags: Sequence[str] | None) -> None:
        """``/release_memory_occupation`` of ``tags`` (None: all three), each server once it is
        idle (``/flush_cache`` polled for up to the pool's ``flush_timeout_s``)."""
        payload = {"tags": list(memory_tags(check_memory_tags(tags)))}

        def release(url: str) -> None:
            try:
                self.pool.flush_cache(url)
            except RuntimeError as err:
                raise RuntimeError(
                    f"not idle, so not released (SGLang asserts an idle server on a release and "
                    f"its scheduler dies otherwise): {err}"
                ) from err
            self.pool.call_on(url, "POST", RELEASE, payload)

        self._on_every_server(RELEASE, payload["tags"], release)

    def resume(self, tags: Sequence[str] | None) -> None:
        """``/resume_memory_occupation`` of ``tags`` (None: all three); each must be released."""
        payload = {"tags": list(memory_tags(check_memory_tags(tags)))}
        self._on_every_server(
            RESUME, payload["tags"], lambda url: self.pool.call_on(url, "POST", RESUME, payload)
        )

    def _on_every_server(self, path: str, tags: list[str], call) -> None:
        urls = list(self.pool.config.urls)
        dropped = self.pool.dropped()
        if dropped:
            raise RuntimeError(
                f"{path} {tags}: servers {sorted(dropped)} left the pool ({dropped}); their "
                "memory shares the trainer's GPUs and cannot be managed without them, so the "
                "colocated run stops (restart it with every server up)"
            )
        failed: dict[str, str] = {}

        def one(url: str) -> bool:
            try:
                call(url)
            except RuntimeError as err:
                failed[url] = str(err)
                return False
            return True

        self.pool.each(one, urls)
        if failed:
            raise RuntimeError(f"{path} {tags} failed on {len(failed)} servers: {failed}")
