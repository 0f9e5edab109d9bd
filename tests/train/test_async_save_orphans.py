"""``--async-save`` leaves no process behind: megatron's writer processes end with the trainer.

The trainer runs as ``python -m megatron_rl.train``-like child in a session of its own, so every
process it starts (megatron's write-results Manager, multiprocessing's resource tracker, the
forked writer and its workers) carries that session id, also once orphaned and handed to init;
the tests count the session's processes in ``/proc``. A worker of the writer is held (it
announces itself with a file and waits) so the kill lands while a write is in flight. Before the
fix, every kill left the Manager (~295 MB) and the resource tracker alive (4 of 4), and a kill
during a write left the writer and its workers too.
"""

from __future__ import annotations

import contextlib
import os
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
POLL_LIMIT_S = 300  # generous: a loaded machine; the tests wait on events, never on this
CHILD = textwrap.dedent(
    """
    import os, sys, time
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    markers = sys.argv[1]

    def held(*args, **kwargs):  # a worker of the async writer: announce, then wait (bounded)
        open(os.path.join(markers, f"worker_{os.getpid()}"), "w").close()
        time.sleep(600)

    if markers != "-":
        FileSystemWriterAsync.write_preloaded_data = staticmethod(held)
    from megatron_rl.train.__main__ import main

    sys.exit(main(sys.argv[2:]))
    """
)


def _trainer(tmp_path, markers: str, train_iters: int) -> subprocess.Popen:
    argv = [
        "--model", "tiny", "--device", "cpu", "--train-iters", str(train_iters),
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--micro-batch-size", "4", "--max-response-length", "3", "--seed", "7", "--no-progress",
        "--run-dir", str(tmp_path / "run"), "--save", str(tmp_path / "ckpt"),
        "--save-interval", "1", "--ckpt-format", "torch_dist", "--async-save",
    ]  # fmt: skip
    with open(tmp_path / "trainer.log", "w") as log:  # the child keeps its own descriptor
        return subprocess.Popen(
            [sys.executable, "-c", CHILD, markers, *argv],
            cwd=ROOT,
            stdout=log,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )


def _session(sid: int) -> dict[int, str]:
    """``{pid: command line}`` of every live process of session ``sid`` (zombies excluded)."""
    found = {}
    for entry in os.listdir("/proc"):
        if not entry.isdigit():
            continue
        try:
            with open(f"/proc/{entry}/stat") as handle:
                fields = handle.read().rsplit(")", 1)[1].split()
            with open(f"/proc/{entry}/cmdline", "rb") as handle:
                command = handle.read().replace(b"\0", b" ").decode(errors="replace")
        except OSError:
            continue  # it exited meanwhile
        state, session = fields[0], int(fields[3])
        if session == sid and state != "Z":
            found[int(entry)] = command[:160]
    return found


def _left_after_polling(sid: int) -> dict[int, str]:
    """The processes of session ``sid``, polled until none is left (or `POLL_LIMIT_S`)."""
    deadline = time.monotonic() + POLL_LIMIT_S
    while (left := _session(sid)) and time.monotonic() < deadline:
        time.sleep(0.1)
    return left


def _end_leftovers(trainer: subprocess.Popen) -> None:
    """SIGKILL, by pid, the trainer and what is left of the session this test started."""
    if trainer.poll() is None:
        trainer.kill()
        trainer.wait()
    for pid in _session(trainer.pid):
        with contextlib.suppress(ProcessLookupError):
            os.kill(pid, signal.SIGKILL)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_sigkill_during_an_async_write_leaves_no_process_of_the_trainer(tmp_path):
    markers = tmp_path / "markers"
    markers.mkdir()
    trainer = _trainer(tmp_path, str(markers), train_iters=3)
    try:
        deadline = time.monotonic() + POLL_LIMIT_S
        while not any(markers.iterdir()):  # a worker of the writer of step 1 is running
            log = (tmp_path / "trainer.log").read_text()[-3000:]
            assert trainer.poll() is None, f"the trainer exited ({trainer.returncode}):\n{log}"
            assert time.monotonic() < deadline, f"no writer worker after {POLL_LIMIT_S} s"
            time.sleep(0.1)
        in_flight = _session(trainer.pid)
        assert len(in_flight) >= 4, in_flight  # trainer, Manager, tracker, writer (+ workers)
        assert (tmp_path / "ckpt" / ".tmp_step_00000001").is_dir()  # not committed
        os.kill(trainer.pid, signal.SIGKILL)
        trainer.wait()
        left = _left_after_polling(trainer.pid)
        assert not left, f"left behind by the SIGKILLed trainer: {left} (was: {in_flight})"
    finally:
        _end_leftovers(trainer)


@pytest.mark.slow
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="reads /proc")
def test_a_normal_exit_after_async_saves_leaves_no_process_behind(tmp_path):
    trainer = _trainer(tmp_path, "-", train_iters=2)
    try:
        assert trainer.wait() == 0, (tmp_path / "trainer.log").read_text()[-3000:]
        assert (tmp_path / "ckpt" / "latest").read_text().strip() == "2"
        left = _left_after_polling(trainer.pid)
        assert not left, f"left behind after a normal exit: {left}"
    finally:
        _end_leftovers(trainer)
