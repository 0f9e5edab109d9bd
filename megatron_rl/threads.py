"""How many intra-op threads torch may use in this process: from the cores it may run on and
the processes sharing them, never torch's default of one thread per core in every process.

On a shared machine torch's default oversubscribes: two gloo ranks, the rollout engine and other
jobs each start a thread per core, and a tiny model's small kernels then spend their time
waiting for each other (the measurement: docs/performance.md, "Threads").

`auto_threads`: ``OMP_NUM_THREADS`` when the user set it; else the cores this process may use,
minus one left to the system and other jobs, divided over the local processes
(``LOCAL_WORLD_SIZE`` under torchrun, or the ranks a launcher passes); at least 1.
"""

from __future__ import annotations

import logging
import os

import torch

logger = logging.getLogger(__name__)


def cores_available() -> int:
    """CPU cores this process may run on (its affinity mask, else the machine's count)."""
    try:
        return len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not on Linux
        return os.cpu_count() or 1


def auto_threads(local_processes: int | None = None) -> int:
    """Intra-op threads for one of ``local_processes`` processes on this machine (see above)."""
    env = os.environ.get("OMP_NUM_THREADS")
    if env:
        try:
            return max(1, int(env))
        except ValueError:
            raise ValueError(f"OMP_NUM_THREADS={env!r}: must be an integer >= 1") from None
    local = local_processes or int(os.environ.get("LOCAL_WORLD_SIZE", "1") or 1)
    return max(1, (cores_available() - 1) // max(1, local))


def configure_threads(num_threads: int | None = None, *, local_processes: int | None = None) -> int:
    """Set torch's intra-op threads: ``num_threads``, or `auto_threads`; returns the count."""
    if num_threads is not None and num_threads < 1:
        raise ValueError(f"num_threads={num_threads}: must be >= 1 (or None for auto)")
    count = num_threads or auto_threads(local_processes)
    if torch.get_num_threads() != count:
        torch.set_num_threads(count)
    logger.info("torch intra-op threads: %d (%d cores available)", count, cores_available())
    return count
