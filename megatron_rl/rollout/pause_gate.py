"""Per-scope pause, abort and admission of the in-process engine's generation calls.

SGLang's ``/pause_generation`` modes (``PauseGenerationReqInput.mode`` in
``srt/managers/io_struct.py``) as the in-process engine applies them at decode-step boundaries
(`megatron_rl.rollout.inprocess` describes what each mode does to a running call). The gate holds
the state: per scope (any hashable; the loopback server passes itself, so stand-in servers over
one engine pause independently) the pause mode, the abort epoch, and how many calls are computing
or parked. A call is `admitted` (it waits while its scope is paused), asks `due` at every step
boundary (two dict reads: nothing else runs on a call that is never paused) and then `hold`,
which parks it while paused.

Two locks: the engine's lock (an ``RLock`` a computing call holds for its whole generation; a
parked or waiting call releases it through ``wake``, a ``Condition`` on it) and the gate's own
state condition, which pause changes take without ever waiting on the engine's lock.
"""

from __future__ import annotations

import contextlib
import threading
from collections.abc import Hashable, Iterator

PAUSE_MODES = ("abort", "retract", "in_place")  # SGLang's PauseGenerationReqInput.mode
_PARKED_POLL_S = 0.02  # a parked or waiting call re-checks its pause this often (lock released)


class PauseGate:
    """The pause state of an engine whose calls hold ``lock`` while they compute."""

    def __init__(self, lock: threading.RLock) -> None:
        self._lock = lock
        self._wake = threading.Condition(lock)  # parked calls wait here, lock released
        # guarded by `_state` (read without it at step boundaries)
        self._state = threading.Condition()
        self._pauses: dict[Hashable, str] = {}  # scope -> pause mode
        self._abort_epochs: dict[Hashable, int] = {}  # scope -> aborts so far
        self._busy: dict[Hashable, int] = {}  # scope -> calls computing (admitted, not parked)
        self._parked: dict[Hashable, int] = {}  # scope -> calls parked by a pause

    # ------------------------------------------------------------------ the controls
    def pause(self, mode: str, scope: Hashable) -> None:
        """Pause ``scope``'s calls at their next step boundary; returns once none of them is
        computing. Pausing again changes the mode (``abort`` also ends the parked calls)."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode {mode!r}: choose one of {PAUSE_MODES}")
        with self._state:
            self._pauses[scope] = mode
            if mode == "abort":
                self._abort_epochs[scope] = self._abort_epochs.get(scope, 0) + 1
            self._state.wait_for(lambda: self._busy.get(scope, 0) == 0)
        self._poke()

    def resume(self, scope: Hashable) -> None:
        """End ``scope``'s pause (a no-op when not paused)."""
        with self._state:
            self._pauses.pop(scope, None)
        self._poke()

    def abort_all(self, scope: Hashable) -> None:
        """End the unfinished rows of ``scope``'s running or parked calls at their next step
        boundary; returns at once, the pause state as it was."""
        with self._state:
            self._abort_epochs[scope] = self._abort_epochs.get(scope, 0) + 1
        self._poke()

    def paused(self, scope: Hashable) -> str | None:
        """``scope``'s pause mode, or None."""
        return self._pauses.get(scope)

    def parked(self, scope: Hashable) -> int:
        """How many of ``scope``'s calls are parked by a pause right now."""
        with self._state:
            return self._parked.get(scope, 0)

    # ------------------------------------------------------------------ a call's side
    @contextlib.contextmanager
    def admitted(self, scope: Hashable) -> Iterator[int]:
        """Wait (engine lock released) while ``scope`` is paused, then count the call as
        computing until the block ends; yields the abort epoch it starts in. The caller holds
        the engine lock."""
        while True:
            with self._state:
                if scope not in self._pauses:
                    self._busy[scope] = self._busy.get(scope, 0) + 1
                    epoch = self._abort_epochs.get(scope, 0)
                    break
            self._wake.wait(timeout=_PARKED_POLL_S)
        try:
            yield epoch
        finally:
            with self._state:
                self._busy[scope] -= 1
                self._state.notify_all()

    def due(self, scope: Hashable, epoch: int) -> bool:
        """True when a call of ``scope`` started in ``epoch`` must `hold` at this boundary."""
        return bool(self._pauses) or self._abort_epochs.get(scope, 0) != epoch

    def hold(self, scope: Hashable, epoch: int) -> str | None:
        """At a step boundary: "abort" (end the unfinished rows), or after parking while
        ``scope`` is paused, the mode it was parked in ("in_place" or "retract"); None when
        there was nothing to do. The caller holds the engine lock; parking releases it."""
        mode = None
        with self._state:
            if self._abort_epochs.get(scope, 0) != epoch:
                return "abort"
            if scope not in self._pauses:
                return None
            self._busy[scope] -= 1
            self._parked[scope] = self._parked.get(scope, 0) + 1
            self._state.notify_all()
        try:
            while True:
                with self._state:
                    if self._abort_epochs.get(scope, 0) != epoch:
                        return "abort"
                    now = self._pauses.get(scope)
                    if now is None:
                        return mode
                    mode = now
                self._wake.wait(timeout=_PARKED_POLL_S)
        finally:
            with self._state:
                self._parked[scope] -= 1
                self._busy[scope] += 1

    def _poke(self) -> None:
        """Wake parked and waiting calls now if the engine lock is free (else they see the
        change within `_PARKED_POLL_S`): pause changes never wait on the engine lock, which a
        call of another scope may hold for its whole generation."""
        if self._lock.acquire(blocking=False):
            try:
                self._wake.notify_all()
            finally:
                self._lock.release()
