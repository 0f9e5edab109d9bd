"""``serve --heartbeat-file``: the servers of a serving node stop when the training job on other
nodes is gone. The servers here are fake: a small HTTP process (and a child of its own, in its
process group) started by serve's own `start_process`; no sglang, no GPU. Each server's port is
held by the test (`ports.HeldPort`) until the server, which binds with ``SO_REUSEADDR``
(``http.server``), has it."""

from __future__ import annotations

import argparse
import signal
import sys
import threading
import time
from pathlib import Path

import pytest
from ports import HeldPort

from megatron_rl.rollout import serve
from megatron_rl.rollout.launch import DEFAULT_PROBE_TIMEOUT_S

FAKE_SERVER = """
import http.server, os, subprocess, sys
port, pid_file = int(sys.argv[1]), sys.argv[2]
child = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
with open(pid_file + ".tmp", "w") as f:
    f.write(f"{os.getpid()} {child.pid}")
os.replace(pid_file + ".tmp", pid_file)

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _running(pid: int) -> bool:
    """Alive and not a zombie (a reparented child may wait unreaped in a container)."""
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except (FileNotFoundError, ProcessLookupError):
        return False
    return state not in ("Z", "X")


def _all_gone(pids: list[int], timeout_s: float = 10.0) -> bool:
    """The group leader is reaped by `stop_process`; its child dies of the same group signal,
    asynchronously: allow it a moment."""
    deadline = time.monotonic() + timeout_s
    while any(_running(pid) for pid in pids):
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True


DYING_SERVER = """
import http.server, sys, threading, time, os
port = int(sys.argv[1])

class Health(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")
        threading.Timer(0.3, lambda: os._exit(3)).start()  # healthy once, then it crashes

    def log_message(self, *args):
        pass

http.server.HTTPServer(("127.0.0.1", port), Health).serve_forever()
"""


def _serve_fake(
    tmp_path: Path, heartbeat: Path | None, timeout_s: float, dying: bool = False
) -> tuple[int, list[int], float]:
    """Run serve's own loop over one fake server (and, ``dying``, a second one that crashes
    after its health check); (exit status, the first server's pids, seconds serving)."""
    script = tmp_path / "fake_server.py"
    script.write_text(FAKE_SERVER)
    pid_file = tmp_path / "pids"
    with HeldPort() as port, HeldPort() as other:  # ours until the servers bind them
        plan = [
            (
                [sys.executable, str(script), str(port), str(pid_file)],
                {"CUDA_VISIBLE_DEVICES": "0"},
                f"http://127.0.0.1:{port}",
                "URL",
            )
        ]
        if dying:
            crashing = tmp_path / "dying_server.py"
            crashing.write_text(DYING_SERVER)
            plan.append(
                (
                    [sys.executable, str(crashing), str(other)],
                    {"CUDA_VISIBLE_DEVICES": "1"},
                    f"http://127.0.0.1:{other}",
                    "URL",
                )
            )
        args = argparse.Namespace(
            log_dir=str(tmp_path),
            health_timeout=60.0,
            health_probe_timeout=DEFAULT_PROBE_TIMEOUT_S,
            heartbeat_file=None if heartbeat is None else str(heartbeat),
            heartbeat_timeout=timeout_s,
            heartbeat_poll=0.05,
        )
        handlers = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
        start = time.monotonic()
        status = serve._serve(plan, args)
        elapsed = time.monotonic() - start
    assert {sig: signal.getsignal(sig) for sig in handlers} == handlers  # restored
    pids = [int(pid) for pid in pid_file.read_text().split()]
    return status, pids, elapsed


def test_servers_stop_when_the_heartbeat_goes_stale(tmp_path):
    heartbeat = tmp_path / "job.alive"
    heartbeat.write_text("beat 1\n")  # written once: the job died right after
    status, pids, elapsed = _serve_fake(tmp_path, heartbeat, timeout_s=0.5)
    assert status == serve.HEARTBEAT_STALE
    assert 0.5 < elapsed < 30.0
    assert _all_gone(pids)  # the server and its child (its process group)


@pytest.mark.parametrize("with_heartbeat", [True, False])
def test_a_server_that_dies_stops_the_others_and_serve_fails(tmp_path, with_heartbeat, caplog):
    heartbeat = tmp_path / "job.alive" if with_heartbeat else None
    if heartbeat is not None:
        heartbeat.write_text("beat 0\n")  # a long lease: only the crash can end this
    status, pids, elapsed = _serve_fake(tmp_path, heartbeat, timeout_s=600.0, dying=True)
    assert status == serve.SERVER_DIED
    assert elapsed < 30.0
    assert "server 1 (http://127.0.0.1:" in caplog.text and "exited with status 3" in caplog.text
    assert _all_gone(pids)  # the healthy server (and its child) was stopped too


def test_beats_keep_the_servers_up_and_removal_stops_them_cleanly(tmp_path):
    heartbeat = tmp_path / "job.alive"
    heartbeat.write_text("beat 0\n")
    done = threading.Event()

    def beat():
        deadline = time.monotonic() + 1.5  # three timeouts of beats, then a clean end
        i = 0
        while time.monotonic() < deadline:
            i += 1
            heartbeat.write_text(f"beat {i}\n")
            time.sleep(0.05)
        heartbeat.unlink()
        done.set()

    pid_file = tmp_path / "pids"
    alive_while_beating = []

    def start_beating():
        _wait_for(pid_file)
        alive_while_beating.extend(_running(int(pid)) for pid in pid_file.read_text().split())
        beat()

    thread = threading.Thread(target=start_beating, daemon=True)
    thread.start()
    status, pids, elapsed = _serve_fake(tmp_path, heartbeat, timeout_s=0.5)
    thread.join(timeout=10)
    assert done.is_set() and status == serve.HEARTBEAT_REMOVED
    assert alive_while_beating == [True, True]  # the server and its child ran meanwhile
    assert elapsed > 1.5  # the beats renewed the lease past several timeouts
    assert _all_gone(pids)


def _wait_for(path: Path, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not path.exists() and time.monotonic() < deadline:
        time.sleep(0.02)


class _Clock:
    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        return self.now


def test_heartbeat_leases(tmp_path):
    clock = _Clock()
    path = tmp_path / "job.alive"
    watcher = serve.Heartbeat(path, timeout_s=10.0, clock=clock)
    clock.now += 9.0
    assert watcher.check() is None  # not written yet: the first lease runs from the start
    clock.now += 2.0
    status, reason = watcher.check()
    assert status == serve.HEARTBEAT_STALE and "has not appeared for 10 s" in reason

    watcher = serve.Heartbeat(path, timeout_s=10.0, clock=clock)
    path.write_text("old beat of an earlier run\n")
    clock.now += 5.0
    assert watcher.check() is None  # seen: its lease starts now
    clock.now += 8.0
    path.write_text("a new beat\n")
    assert watcher.check() is None  # changed: renewed
    clock.now += 9.0
    assert watcher.check() is None
    clock.now += 2.0
    status, reason = watcher.check()
    assert status == serve.HEARTBEAT_STALE and "has not changed for 10 s" in reason
    path.unlink()
    assert watcher.check()[0] == serve.HEARTBEAT_REMOVED
    with pytest.raises(ValueError, match="timeout_s"):
        serve.Heartbeat(path, timeout_s=0)


def test_dry_run_names_the_heartbeat(capsys):
    argv = ["--model-path", "m", "--heartbeat-file", "run/job.alive", "--heartbeat-timeout", "60"]
    assert serve.main([*argv, "--dry-run"]) == 0
    assert "# stops the servers when run/job.alive is removed or unchanged for 60 s" in (
        capsys.readouterr().out
    )
    with pytest.raises(SystemExit):
        serve.main([*argv[:4], "--heartbeat-timeout", "0", "--dry-run"])
