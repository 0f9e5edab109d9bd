"""Child processes that end when the process that started them ends (Linux ``PR_SET_PDEATHSIG``).

A process killed with SIGKILL runs no clean-up, so its children live on unless they watch it.
The kernel can do the watching: ``prctl(PR_SET_PDEATHSIG, SIGKILL)``, called in the child, has
the child killed when its parent *thread* exits (so the process must be started from a thread that
lives as long as the parent: the main thread, in the trainer). It is cleared in every forked
child, so each generation sets it again. A parent that died before the child set it is caught by
comparing ``os.getppid()`` with the parent's pid recorded before the start.

Off Linux (no ``prctl``) these are no-ops: the children may outlive a SIGKILLed parent there.
Import cost: ``os``, ``ctypes``, ``signal``, ``functools`` only (it runs in spawned children).
"""

from __future__ import annotations

import contextlib
import ctypes
import functools
import os
import signal
import sys
from collections.abc import Callable

PR_SET_PDEATHSIG = 1  # <linux/prctl.h>

_prctl = None  # libc's prctl, resolved in the parent (a forked child must not dlopen)
_armed = [0]  # > 0 while `forks_die_with_parent` is active
_born_armed = [False]  # this process was forked armed: so are its own forks, block or not
_forking_pid = [0]  # the pid of the process that forks, recorded just before it does
_hooks_registered = [False]


def _libc_prctl():
    global _prctl
    if _prctl is None and sys.platform.startswith("linux"):
        with contextlib.suppress(OSError, AttributeError):
            _prctl = ctypes.CDLL(None, use_errno=True).prctl
    return _prctl


def die_with_parent(parent_pid: int) -> None:
    """In a child process: get SIGKILL when the thread of ``parent_pid`` that started it exits.

    Exits at once (status 1) when ``parent_pid`` is no longer the parent: it died before this call
    and the child was handed to another process. A no-op off Linux.
    """
    prctl = _libc_prctl()
    if prctl is None:
        return
    prctl(PR_SET_PDEATHSIG, int(signal.SIGKILL), 0, 0, 0)
    if os.getppid() != parent_pid:
        os._exit(1)


def popen_dies_with_this_thread() -> Callable[[], None]:
    """A ``preexec_fn`` for `subprocess.Popen`: the command it starts gets SIGKILL when the
    calling thread exits, the process's death by SIGKILL included (the flag survives the
    exec). Call it from a thread that lives as long as the process (the main thread); prctl is
    resolved here, in the parent."""
    _libc_prctl()
    return functools.partial(die_with_parent, os.getpid())


@contextlib.contextmanager
def forks_die_with_parent():
    """Every process forked (``os.fork``, multiprocessing's ``fork`` context) while the block
    runs, and every process those fork in turn at any time, is SIGKILLed when its parent exits.

    Processes started with ``spawn`` or ``subprocess`` are not covered (they exec; give them
    `die_with_parent` as their first call).
    """
    if _libc_prctl() is not None and not _hooks_registered[0]:
        os.register_at_fork(before=_record_forking_pid, after_in_child=_arm_child)
        _hooks_registered[0] = True
    _armed[0] += 1
    try:
        yield
    finally:
        _armed[0] -= 1


def _record_forking_pid() -> None:
    _forking_pid[0] = os.getpid()


def _arm_child() -> None:
    if _armed[0] > 0 or _born_armed[0]:
        _born_armed[0] = True
        die_with_parent(_forking_pid[0])
