"""The process's stop request, for waits that run before the training loop can poll one.

`megatron_rl.train.preemption.PreemptionHandler` sets it when SIGTERM/SIGUSR1 arrives (SLURM
preemption, a launcher's trap, ``timeout``). The training loop polls the handler itself; a wait
that can last minutes outside it (the trainer waiting for its SGLang servers to answer
``/health``) calls `raise_if_requested` on every poll, so the stop is served within one poll,
not after the wait's own timeout.
"""

from __future__ import annotations

import threading

_REQUESTED = threading.Event()


class StopRequested(RuntimeError):
    """A stop signal arrived during a wait: the run exits before (another) step."""


def request() -> None:
    """Record a stop request (safe from a signal handler: it only sets an event)."""
    _REQUESTED.set()


def clear() -> None:
    """Forget the request (a new run in the same process starts clean)."""
    _REQUESTED.clear()


def requested() -> bool:
    return _REQUESTED.is_set()


def raise_if_requested(what: str) -> None:
    """`StopRequested` naming ``what`` was being waited for, when a stop was requested."""
    if _REQUESTED.is_set():
        raise StopRequested(f"stop signal while {what}: exiting before the first step")
