"""The process's stop request, for waits that run before the training loop can poll one.

`megatron_rl.train.preemption.PreemptionHandler` sets it when SIGTERM/SIGUSR1 arrives (SLURM
preemption, a launcher's trap, ``timeout``). The training loop polls the handler itself; a wait
that can last minutes outside it (the trainer waiting for its SGLang servers to answer
``/health``) calls `raise_if_requested` on every poll, so the stop is served within one poll,
not after the wait's own timeout.

A wait that only C code can end (a process group's rendezvous, a collective waiting for rank 0's
weight push) never returns to Python, so the flag is never read there and Python's own handler
does not even run until the call returns. `hard_wait` marks such a wait: a watchdog thread, woken
by the signal itself (`signal.set_wakeup_fd`, written by the C-level handler whatever the main
thread is doing), ends the process when a hard wait is still open ``GRACE_S`` seconds (5, or
``MEGATRON_RL_STOP_GRACE_S``) after the
stop signal (or after the wait began, when the signal came first). A wait that ends within the
grace goes on as before, so the usual stop (finish the step, save, exit 0) is kept wherever it
comes quickly. The exit code is 128 + the signal's number (143 for SIGTERM), as a process the
signal killed reports to a shell. Nothing is saved: the last complete checkpoint is the resume
point, as when torchrun SIGKILLs a worker 30 s after forwarding SIGTERM, only sooner.
"""

from __future__ import annotations

import contextlib
import logging
import math
import os
import select
import signal
import socket
import sys
import threading
import time
from collections.abc import Iterator

logger = logging.getLogger(__name__)

GRACE_ENV = "MEGATRON_RL_STOP_GRACE_S"


def _grace_s() -> float:
    """``MEGATRON_RL_STOP_GRACE_S`` (seconds, > 0), default 5: the grace of a hard wait."""
    text = os.environ.get(GRACE_ENV, "5")
    try:
        value = float(text)
    except ValueError:
        value = float("nan")
    if not (math.isfinite(value) and value > 0):
        raise ValueError(f"{GRACE_ENV}={text!r}: give a number of seconds > 0 (default 5)")
    return value


GRACE_S = _grace_s()  # a hard wait still open this long after the stop signal ends the process
_POLL_S = 0.25
_REQUESTED = threading.Event()
_SIGNAL: list[float] = [signal.SIGTERM, 0.0]  # the first stop signal's number and time
_HARD_WAITS: list[tuple[str, float]] = []  # the open hard waits (what, entered), innermost last


class StopRequested(RuntimeError):
    """A stop signal arrived during a wait: the run exits before (another) step."""


def request(signum: int = signal.SIGTERM) -> None:
    """Record a stop request (safe from a signal handler: it only sets an event)."""
    if not _REQUESTED.is_set():
        _SIGNAL[:] = [int(signum), time.monotonic()]
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


@contextlib.contextmanager
def hard_wait(what: str) -> Iterator[None]:
    """Within: a stop signal ends the process (exit 128 + signum) if the wait is still open
    `GRACE_S` after it, even while the main thread is blocked in C code; ``what`` names the wait
    in the exit's log line.

    Acts only while a `Watchdog` is armed (the trainer's `PreemptionHandler` arms one). Only for
    waits whose interruption loses nothing that is not on disk: never around a checkpoint write.
    """
    _HARD_WAITS.append((what, time.monotonic()))
    try:
        yield
    finally:
        _HARD_WAITS.pop()


def _overdue() -> bool:
    """A stop was requested and the outermost open hard wait outlived its grace."""
    waits = list(_HARD_WAITS)  # the main thread may close one meanwhile
    if not (_REQUESTED.is_set() and waits):
        return False
    since = max(_SIGNAL[1], waits[0][1])
    return time.monotonic() - since >= GRACE_S


def _exit_now() -> None:
    """Log the open hard wait and end the process (no unwinding: the main thread may sit in a
    collective that would never return)."""
    signum = int(_SIGNAL[0])
    waits = list(_HARD_WAITS)
    what = waits[-1][0] if waits else "a hard wait"
    message = (
        f"{signal.Signals(signum).name} while {what}: still waiting {GRACE_S:g} s after the "
        f"stop signal, exiting now with {128 + signum} (the wait cannot be left otherwise; the "
        "last checkpoint is the resume point)"
    )
    logger.error("%s", message)
    for handler in logging.getLogger().handlers:
        with contextlib.suppress(Exception):
            handler.flush()
    with contextlib.suppress(Exception):
        sys.stderr.flush()
    os._exit(128 + signum)


def _after_fork_in_child() -> None:
    """A forked child must not write its own signals into the parent's wake-up socket (the
    fd is inherited): the parent's watchdog would take them for its own stop signal."""
    Watchdog._active = None
    with contextlib.suppress(ValueError):  # forked from a thread other than the main one
        signal.set_wakeup_fd(-1)


os.register_at_fork(after_in_child=_after_fork_in_child)


class Watchdog:
    """The thread that serves `hard_wait`: armed from the main thread, one per process.

    ``arm`` registers a socket as Python's signal wake-up fd (the previous one comes back on
    ``disarm``); the C-level handler writes each signal's number there, so the thread learns of
    a signal while the main thread is blocked, before Python's own handler has run.
    """

    _active: Watchdog | None = None

    def __init__(self, signals: tuple[int, ...]) -> None:
        self.signals = frozenset(int(sig) for sig in signals)
        self._reader, self._writer = socket.socketpair()
        self._reader.setblocking(False)
        self._writer.setblocking(False)
        self._previous_fd = -1
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, name="stop-watchdog", daemon=True)

    @classmethod
    def armed(cls) -> bool:
        return cls._active is not None

    @classmethod
    def arm(cls, signals: tuple[int, ...]) -> Watchdog | None:
        """Start the process's watchdog for ``signals``; None outside the main thread or when
        one is armed already."""
        if cls._active is not None or threading.current_thread() is not threading.main_thread():
            return None
        watchdog = cls(signals)
        watchdog._previous_fd = signal.set_wakeup_fd(
            watchdog._writer.fileno(), warn_on_full_buffer=False
        )
        cls._active = watchdog
        watchdog._thread.start()
        return watchdog

    def disarm(self) -> None:
        """Stop the thread and give the wake-up fd back (main thread)."""
        if Watchdog._active is not self:
            return
        signal.set_wakeup_fd(self._previous_fd)
        Watchdog._active = None
        self._stop.set()
        self._thread.join(timeout=5)
        self._reader.close()
        self._writer.close()

    def _watch(self) -> None:
        while not self._stop.is_set():
            readable, _, _ = select.select([self._reader], [], [], _POLL_S)
            if readable:
                with contextlib.suppress(BlockingIOError, OSError):
                    for signum in self._reader.recv(64):
                        if signum in self.signals:  # Python's handler may not have run yet
                            request(signum)
            if _overdue():
                _exit_now()
