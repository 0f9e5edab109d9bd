"""A producer thread that wakes as late as a loaded machine may wake it (for the async tests).

`LateWakingCondition` replaces the producer's condition variable: when the producer thread's
wait for work is satisfied (a batch was submitted), the thread goes on only once the trainer's
thread has blocked on the producer since (entered a ``wait_for``: `Producer.result`,
`Producer.hold`, `Producer.discard`), as if the scheduler had not run it before. Events, not
sleeps: the same interleaving whatever the load. An asynchronous schedule that is a function of
the step gives the same batches, versions and staleness with it as without it.

`install` puts it into the module that defines `Producer` (its ``threading`` is replaced by a
proxy whose ``Condition`` is this one) and makes `Producer.close` end a late wait.
"""

from __future__ import annotations

import sys
import threading
import types

PRODUCER_THREAD = "rollout-producer"


class LateWakingCondition(threading.Condition):
    """``wait_for`` in the producer thread returns only after the trainer's thread has entered
    a ``wait_for`` since it last notified (submitted work). ``delayed``: how many times the
    producer waited so."""

    def __init__(self, lock=None) -> None:
        super().__init__(lock)
        self.entries = 0  # trainer-thread wait_for calls so far
        self.notified_at = 0  # ``entries`` when the trainer's thread last notified
        self.closing = False
        self.delayed = 0

    def notify(self, n: int = 1) -> None:
        if threading.current_thread().name != PRODUCER_THREAD:
            self.notified_at = self.entries
        super().notify(n)

    def notify_all(self) -> None:
        self.notify(sys.maxsize)

    def wait_for(self, predicate, timeout=None):
        if threading.current_thread().name != PRODUCER_THREAD:
            self.entries += 1
            super().notify(sys.maxsize)  # a late producer may go on
            return super().wait_for(predicate, timeout)
        while True:
            result = super().wait_for(predicate, timeout)
            if self.closing:
                return result
            if self.entries <= self.notified_at:  # the trainer has not waited for it yet
                self.delayed += 1
                super().wait_for(lambda: self.closing or self.entries > self.notified_at)
            if predicate():
                return result


CONDITIONS: list[LateWakingCondition] = []  # every one made since `install`


def _late_condition(lock=None) -> LateWakingCondition:
    condition = LateWakingCondition(lock)
    CONDITIONS.append(condition)
    return condition


def install(monkeypatch=None) -> None:
    """Every `Producer` made from now on wakes late (undone by ``monkeypatch`` when given)."""
    from megatron_rl.train.rollouts.async_rollout import Producer

    module = sys.modules[Producer.__module__]
    proxy = types.ModuleType("threading")
    proxy.__dict__.update(vars(threading))
    proxy.Condition = _late_condition
    real_close = Producer.close

    def close(self) -> None:
        with self._cond:
            self._cond.closing = True
            self._cond.notify_all()
        real_close(self)

    for owner, name, value in ((module, "threading", proxy), (Producer, "close", close)):
        if monkeypatch is not None:
            monkeypatch.setattr(owner, name, value)
        else:
            setattr(owner, name, value)
