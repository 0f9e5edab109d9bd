"""Graceful stop on SIGTERM/SIGUSR1: the run saves a checkpoint and exits within one update.

Schedulers (SLURM, Kubernetes) send SIGTERM, or SIGUSR1 with ``--signal``, some time before
killing a job (torchrun kills its workers ~30 s after forwarding SIGTERM, while an RL step can
take minutes). The handler only sets a flag; the trainer polls `PreemptionHandler.agreed` after
the rollout and before every optimizer step (see `Trainer.step`), and the run loop once more at
the step boundary. ``agreed`` all-reduces the flag (MAX) so that every rank stops at the same
point even when the signal reached only some of them.

The handler also arms `megatron_rl.stop_signal`'s watchdog: in a wait that only C code can end
(`stop_signal.hard_wait`: the process groups' rendezvous, the wait for rank 0's weight push) a
stop signal ends the process within a second instead of at the wait's timeout.
"""

from __future__ import annotations

import logging
import signal
import threading
from collections.abc import Iterable

import torch.distributed as dist

from megatron_rl import stop_signal
from megatron_rl.collectives import any_rank

logger = logging.getLogger(__name__)

DEFAULT_SIGNALS = (signal.SIGTERM, signal.SIGUSR1)


class PreemptionHandler:
    """Context manager: installs the signal handlers on entry, restores the previous ones on exit.

    Outside the main thread (where Python cannot install handlers) it only serves `request`.
    """

    def __init__(self, signals: Iterable[signal.Signals] = DEFAULT_SIGNALS) -> None:
        self.signals = tuple(signals)
        self._requested = False
        self._received: signal.Signals | None = None
        self._previous: dict[signal.Signals, object] = {}
        self._watchdog: stop_signal.Watchdog | None = None

    @property
    def requested(self) -> bool:
        """Whether this rank received a signal or `request` was called."""
        return self._requested

    def request(self) -> None:
        """Ask for a stop at the next step boundary (tests, programmatic stops)."""
        self._requested = True

    def agreed(self, group: dist.ProcessGroup | None = None) -> bool:
        """Whether any rank of ``group`` (default: all) asked to stop. Collective when distributed.

        Every rank of the group must call it at the same point of the loop.
        """
        flag = any_rank(self._requested, group)
        if flag and not self._requested:
            logger.warning("another rank received a stop signal; stopping at this step")
        elif flag and self._received is not None:
            logger.warning("received %s; stopping at this step", self._received.name)
            self._received = None  # warn once
        self._requested = self._requested or flag
        return flag

    def _handle(self, signum: int, frame: object) -> None:
        del frame
        # Only set flags: logging from a signal handler can re-enter a held handler lock.
        self._received = signal.Signals(signum)
        self._requested = True
        stop_signal.request(signum)  # the waits outside the training loop poll this one

    def __enter__(self) -> PreemptionHandler:
        stop_signal.clear()
        if threading.current_thread() is not threading.main_thread():
            logger.warning("not the main thread: stop signals are not handled, only request()")
            return self
        for sig in self.signals:
            self._previous[sig] = signal.signal(sig, self._handle)
        self._watchdog = stop_signal.Watchdog.arm(self.signals)  # serves stop_signal.hard_wait
        return self

    def __exit__(self, *exc: object) -> None:
        if self._watchdog is not None:  # first: its thread can no longer request a stop
            self._watchdog.disarm()
            self._watchdog = None
        stop_signal.clear()  # served: a later wait in this process starts clean
        for sig, previous in self._previous.items():
            # None: the old handler was not installed from Python; the default is the best guess.
            signal.signal(sig, signal.SIG_DFL if previous is None else previous)
        self._previous.clear()
