"""`megatron_rl.parent_death`: forked children (and their own children) die with a SIGKILLed
parent; the same fork outside the block survives it (so the test sees orphans); a command started
by `subprocess.Popen` in its own session dies with it too."""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time

import pytest

POLL_LIMIT_S = 120  # generous: the tests wait on events, never on this
# The parent forks a child (inside the block when asked); the child forks a grandchild; each
# writes its pid into the folder, then all three wait (bounded) to be killed.
FAMILY = textwrap.dedent(
    """
    import contextlib, os, sys, time
    from megatron_rl.parent_death import forks_die_with_parent

    folder, guarded = sys.argv[1], sys.argv[2] == "1"
    with forks_die_with_parent() if guarded else contextlib.nullcontext():
        child = os.fork()
    if child == 0:
        grandchild = os.fork()
        name = "grandchild" if grandchild == 0 else "child"
        open(os.path.join(folder, f"{name}_{os.getpid()}"), "w").close()
        time.sleep(300)
        os._exit(0)
    time.sleep(300)
    """
)


def _session(sid: int) -> list[int]:
    pids = []
    for entry in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[3]) == sid and fields[0] != "Z":
            pids.append(int(entry))
    return pids


def _kill_parent(tmp_path, guarded: bool) -> list[int]:
    """Start the family, SIGKILL the parent once both descendants run; what is left of it."""
    parent = subprocess.Popen(
        [sys.executable, "-c", FAMILY, str(tmp_path), "1" if guarded else "0"],
        start_new_session=True,
    )
    try:
        deadline = time.monotonic() + POLL_LIMIT_S
        while len(os.listdir(tmp_path)) < 2:
            assert parent.poll() is None and time.monotonic() < deadline, parent.returncode
            time.sleep(0.05)
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        if not guarded:  # nothing would end them before the 300 s sleep: look once
            return _session(parent.pid)
        deadline = time.monotonic() + POLL_LIMIT_S
        while (left := _session(parent.pid)) and time.monotonic() < deadline:
            time.sleep(0.05)
        return left
    finally:
        for pid in _session(parent.pid):  # only this test's processes, by pid
            with contextlib.suppress(ProcessLookupError):
                os.kill(pid, signal.SIGKILL)


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_children_forked_in_the_block_and_their_children_die_with_a_sigkilled_parent(tmp_path):
    assert _kill_parent(tmp_path, guarded=True) == []


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_without_the_block_the_same_children_outlive_the_parent(tmp_path):
    assert len(_kill_parent(tmp_path, guarded=False)) == 2


# The parent starts ``sleep`` in a session of its own (as the real SGLang servers of the tests
# are started), with or without the preexec_fn, writes its pid, and waits to be killed.
POPEN = textwrap.dedent(
    """
    import os, subprocess, sys, time
    from megatron_rl.parent_death import popen_dies_with_this_thread

    folder, guarded = sys.argv[1], sys.argv[2] == "1"
    preexec = popen_dies_with_this_thread() if guarded else None
    child = subprocess.Popen(["sleep", "300"], start_new_session=True, preexec_fn=preexec)
    open(os.path.join(folder, f"child_{child.pid}"), "w").close()
    time.sleep(300)
    """
)


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as handle:
            return handle.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
@pytest.mark.parametrize("guarded", [True, False], ids=["preexec", "without"])
def test_a_popen_command_in_its_own_session_dies_with_a_sigkilled_parent(tmp_path, guarded):
    parent = subprocess.Popen([sys.executable, "-c", POPEN, str(tmp_path), "1" if guarded else "0"])
    child = None
    try:
        deadline = time.monotonic() + POLL_LIMIT_S
        while not os.listdir(tmp_path):
            assert parent.poll() is None and time.monotonic() < deadline, parent.returncode
            time.sleep(0.05)
        child = int(os.listdir(tmp_path)[0].split("_")[1])
        os.kill(parent.pid, signal.SIGKILL)
        parent.wait()
        if not guarded:  # nothing would end it before the 300 s sleep
            assert _alive(child)
            return
        deadline = time.monotonic() + POLL_LIMIT_S
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(child)
    finally:
        if child is not None and _alive(child):
            with contextlib.suppress(ProcessLookupError):
                os.kill(child, signal.SIGKILL)
