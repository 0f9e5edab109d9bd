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
"""

from __future__ import annotations

import threading
from collections.abc import Sequence

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
