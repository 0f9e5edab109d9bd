"""A stop signal ends a hard wait (one only C code could leave) once it outlives the grace, with
128 + signum; a wait that ends within the grace goes on; outside hard waits, and without an
armed watchdog, a signal stays a flag."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from megatron_rl import stop_signal
from megatron_rl.train.preemption import PreemptionHandler

ROOT = Path(__file__).resolve().parents[1]


GRACE_S = 1.0  # the children's grace (MEGATRON_RL_STOP_GRACE_S): the default 5 s, shortened


def _child(body: str) -> subprocess.Popen:
    """A Python child running ``body`` (stdout: its progress lines; stderr: its log), with a
    grace of `GRACE_S`."""
    code = "import logging, time\nlogging.basicConfig(level=logging.INFO)\n" + textwrap.dedent(body)
    return subprocess.Popen(
        [sys.executable, "-c", code],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env={**os.environ, stop_signal.GRACE_ENV: str(GRACE_S)},
    )


@pytest.mark.slow  # a Python child per test
def test_sigterm_in_a_hard_wait_ends_the_process_after_the_grace_with_143():
    child = _child(
        """
        from megatron_rl import stop_signal
        from megatron_rl.train.preemption import PreemptionHandler
        with PreemptionHandler(), stop_signal.hard_wait("waiting for a peer that never comes"):
            print("waiting", flush=True)
            time.sleep(120)
        print("left the wait", flush=True)
        """
    )
    try:
        assert child.stdout.readline().strip() == "waiting"
        sent = time.monotonic()
        child.send_signal(signal.SIGTERM)
        out, err = child.communicate(timeout=30)
        waited = time.monotonic() - sent
    finally:
        child.kill()
    assert child.returncode == 128 + signal.SIGTERM, err
    assert GRACE_S - 0.5 < waited < GRACE_S + 5, waited
    assert "left the wait" not in out
    assert "SIGTERM while waiting for a peer that never comes: still waiting" in err
    assert "exiting now with 143" in err


@pytest.mark.slow  # a Python child per test
def test_a_wait_that_ends_within_the_grace_goes_on_and_one_entered_after_the_signal_gets_it():
    child = _child(
        """
        import os, signal
        from megatron_rl import stop_signal
        from megatron_rl.train.preemption import PreemptionHandler
        with PreemptionHandler():
            with stop_signal.hard_wait("a short wait"):
                os.kill(os.getpid(), signal.SIGUSR1)
                time.sleep(stop_signal.GRACE_S / 5)  # well within the grace
            print("went on", flush=True)
            time.sleep(stop_signal.GRACE_S)  # the grace of the next wait counts from its entry
            with stop_signal.hard_wait("the weight push"):
                print("entered", flush=True)
                time.sleep(120)
        """
    )
    out, err = child.communicate(timeout=60)
    assert child.returncode == 128 + signal.SIGUSR1, err
    assert out.splitlines() == ["went on", "entered"]
    assert "SIGUSR1 while the weight push: still waiting" in err
    assert "a short wait" not in err


def test_outside_a_hard_wait_a_signal_only_sets_the_flag():
    with PreemptionHandler() as handler:
        stop_signal.request()  # as the handler does; no hard wait is open
        time.sleep(3 * stop_signal._POLL_S)  # the watchdog polls and must not exit
        assert stop_signal.requested() and not handler.requested
    assert not stop_signal.requested()  # served on exit


def test_without_an_armed_watchdog_a_hard_wait_only_runs_its_body():
    stop_signal.request()
    try:
        with stop_signal.hard_wait("a test's wait"):
            ran = True
    finally:
        stop_signal.clear()
    assert ran and not stop_signal.Watchdog.armed()


def test_the_handler_arms_one_watchdog_and_gives_the_wakeup_fd_back_on_exit():
    with PreemptionHandler():
        assert stop_signal.Watchdog.armed()
        assert stop_signal.Watchdog.arm((signal.SIGTERM,)) is None  # one per process
        ours = signal.set_wakeup_fd(-1)
        signal.set_wakeup_fd(ours)
        assert ours != -1
    assert not stop_signal.Watchdog.armed()
    assert signal.set_wakeup_fd(-1) == -1  # nothing of ours stays registered


def test_a_forked_childs_own_signal_does_not_reach_the_parents_watchdog():
    """The wake-up socket is inherited on fork; the child's handler (inherited too) must not
    write its signal into it, or the parent would stop on a signal it never received."""
    import os

    with PreemptionHandler() as handler:
        pid = os.fork()
        if pid == 0:  # the child: a signal of its own, then gone
            os.kill(os.getpid(), signal.SIGUSR1)
            os._exit(0)
        os.waitpid(pid, 0)
        time.sleep(4 * stop_signal._POLL_S)
        assert not stop_signal.requested() and not handler.requested


def test_a_bad_grace_names_the_variable(monkeypatch):
    monkeypatch.setenv(stop_signal.GRACE_ENV, "soon")
    with pytest.raises(ValueError, match="MEGATRON_RL_STOP_GRACE_S='soon'"):
        stop_signal._grace_s()
    monkeypatch.setenv(stop_signal.GRACE_ENV, "2.5")
    assert stop_signal._grace_s() == 2.5
