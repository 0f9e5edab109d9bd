"""`ports`: the ways tests give their child processes ports without a pick-then-release race,
and the real SGLang start's retry on a failed bind (`real_sglang.servers`).

The proof for torchrun: 8 ``torchrun --standalone`` jobs of 2 gloo ranks started at once all
rendezvous, each within itself (every all-reduce sums its own 2 ranks), with no port given.
"""

from __future__ import annotations

import errno
import socket
import subprocess
import sys
import textwrap
import time
import urllib.request
from pathlib import Path

import pytest
from ports import HeldPort, port_from_log, torchrun
from real_sglang import servers

JOBS = 8
ALL_REDUCE = textwrap.dedent(
    """
    import os, pathlib, sys
    import torch, torch.distributed as dist

    dist.init_process_group("gloo")
    value = torch.tensor([float(sys.argv[2])])
    dist.all_reduce(value)
    rank, world = dist.get_rank(), dist.get_world_size()
    pathlib.Path(sys.argv[1], f"rank{rank}").write_text(
        f"{world} {os.environ['MASTER_PORT']} {value.item():g}"
    )
    dist.destroy_process_group()
    """
)


@pytest.mark.slow  # 24 processes importing torch: ~25 s of 2 cores, more under load
@pytest.mark.distributed
def test_eight_standalone_torchruns_started_at_once_each_rendezvous_within_itself(tmp_path):
    script = tmp_path / "all_reduce.py"
    script.write_text(ALL_REDUCE)
    jobs = []
    for job in range(JOBS):
        out = tmp_path / f"job{job}"
        out.mkdir()
        log = (tmp_path / f"job{job}.log").open("w")
        command = [*torchrun(2), str(script), str(out), str(job)]
        jobs.append((out, log, subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)))
    for job, (out, log, process) in enumerate(jobs):
        code = process.wait(timeout=600)
        log.close()
        assert code == 0, Path(log.name).read_text()[-3000:]
        answers = [(out / f"rank{rank}").read_text().split() for rank in (0, 1)]
        # both ranks in a world of 2 on one store, summing this job's values only
        assert answers[0] == answers[1] == ["2", answers[0][1], f"{2 * job:g}"], answers


def _refused(port: int) -> bool:
    with socket.socket() as probe:
        try:
            probe.connect(("127.0.0.1", port))
        except ConnectionRefusedError:
            return True
    return False


def test_a_held_port_is_refused_and_given_to_no_other_bind():
    with HeldPort() as port:
        assert _refused(port)
        with socket.socket() as plain, pytest.raises(OSError) as taken:
            plain.bind(("127.0.0.1", port))
        assert taken.value.errno == errno.EADDRINUSE
        with pytest.raises(OSError):
            HeldPort(port)
        picked = []
        for _ in range(200):
            with socket.socket() as other:
                other.bind(("127.0.0.1", 0))
                picked.append(other.getsockname()[1])
        assert port not in picked


def test_a_server_binding_with_reuseaddr_takes_a_held_port_over(tmp_path):
    (tmp_path / "health").write_text("ok")
    with HeldPort() as port:
        command = [sys.executable, "-m", "http.server", str(port), "--bind", "127.0.0.1"]
        server = subprocess.Popen(
            command, cwd=tmp_path, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE
        )
        try:
            answer = _get(f"http://127.0.0.1:{port}/health", server)
        finally:
            server.terminate()
            server.wait(timeout=30)
    assert answer == "ok"


def _get(url: str, process: subprocess.Popen, timeout_s: float = 60.0) -> str:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            with urllib.request.urlopen(url, timeout=5) as answer:
                return answer.read().decode()
        except OSError:
            assert process.poll() is None, process.stderr.read().decode()[-2000:]
            assert time.monotonic() < deadline, f"{url} did not answer"
            time.sleep(0.05)


def test_held_ports_drawn_below_the_ephemeral_range_are_below_it_and_distinct():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    held = [HeldPort.below_ephemeral() for _ in range(5)]
    try:
        ports = [h.port for h in held]
        assert len(set(ports)) == 5
        if low > 20100:
            assert all(20000 <= p < low for p in ports), (ports, low)
    finally:
        for h in held:
            h.close()


BINDS_ON_PORT_0 = """
import http.server, sys
server = http.server.HTTPServer(("127.0.0.1", 0), http.server.BaseHTTPRequestHandler)
print(f"serving on http://127.0.0.1:{server.server_address[1]}", flush=True)
if sys.argv[1] == "serve":
    server.serve_forever()
"""


def test_port_from_log_reads_the_bound_port_and_reports_an_early_exit(tmp_path):
    log = tmp_path / "server.log"
    with log.open("w") as out:
        command = [sys.executable, "-c", BINDS_ON_PORT_0, "serve"]
        server = subprocess.Popen(command, stdout=out, stderr=subprocess.STDOUT)
    try:
        port = port_from_log(log, r"serving on http://127\.0\.0\.1:(\d+)", process=server)
        with socket.create_connection(("127.0.0.1", port), timeout=10):
            pass  # it listens there
    finally:
        server.terminate()
        server.wait(timeout=30)
    dead = subprocess.Popen([sys.executable, "-c", "raise SystemExit(4)"])
    with pytest.raises(RuntimeError, match="exited with code 4"):
        port_from_log(tmp_path / "never.log", r"on port (\d+)", process=dead, timeout_s=60)


# A stand-in for the real server's start: the first start fails to bind (as uvicorn logs it),
# or every start fails otherwise; then it serves on the port it was given.
FLAKY_SERVER = """
import http.server, pathlib, sys
port, marker, mode = int(sys.argv[1]), pathlib.Path(sys.argv[2]), sys.argv[3]
if mode == "crash":
    sys.exit("ModuleNotFoundError: no module named 'sglang'")
if not marker.exists():
    marker.write_text("started once")
    sys.exit(f"ERROR: [Errno 98] error while attempting to bind on address ('127.0.0.1', {port}): "
             "address already in use")
http.server.HTTPServer(("127.0.0.1", port), http.server.BaseHTTPRequestHandler).serve_forever()
"""


class _Flaky(servers._Process):
    kind = "flaky server"

    def _ready(self) -> bool:
        with socket.create_connection(("127.0.0.1", self.port), timeout=5):
            return True


def _flaky(tmp_path: Path, mode: str, port: int | None = None) -> _Flaky:
    script = tmp_path / "flaky.py"
    script.write_text(FLAKY_SERVER)
    marker = tmp_path / "marker"

    def command(port: int, hold) -> list[str]:
        return [sys.executable, str(script), str(port), str(marker), mode]

    return _Flaky(command, env={}, log_path=tmp_path / "flaky.log", port=port)


def test_a_real_server_start_that_fails_to_bind_starts_again_on_another_port(tmp_path):
    flaky = _flaky(tmp_path, "bind")
    first = flaky.port
    try:
        flaky.wait_ready(timeout_s=120, poll_s=0.05)
        assert flaky.attempts == 2 and flaky.port != first
        assert flaky.url == f"http://127.0.0.1:{flaky.port}" and flaky.alive()
        log = (tmp_path / "flaky.log").read_text()
        assert f"port {first}: a bind failed (exit code 1); starting again" in log
    finally:
        flaky.stop()


@pytest.mark.parametrize("mode,given", [("crash", False), ("bind", True)])
def test_a_real_server_start_is_not_retried_on_other_failures_or_a_given_port(
    tmp_path, mode, given
):
    once = r"exited with code 1 before it was ready \(start 1\)"
    with HeldPort() as port:
        flaky = _flaky(tmp_path, mode, port=port if given else None)
        with pytest.raises(RuntimeError, match=once):
            flaky.wait_ready(timeout_s=120, poll_s=0.05)
    assert flaky.attempts == 1 and not flaky.alive()
