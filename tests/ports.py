"""Ports for the processes tests start, with no window in which another process can take them.

Picking a free port (bind to 0, read the port, close the socket) and handing it to a child is a
race: between the close and the child's bind, any process on the machine (another test worker,
an outgoing connection, which the kernel gives a port from the same ephemeral range) can be
handed the same port, and the child dies with EADDRINUSE. The ways round it, by kind of child:

- torchrun: `torchrun` (``--standalone``): the agent binds its rendezvous store and the
  workers' store (MASTER_PORT) on port 0 and hands its workers the port it got; nothing is
  picked in advance.
- a server this process has the port for (a fake server, a stand-in): `HeldPort` keeps the port
  bound here until the block ends; the kernel gives it to no ``bind(0)`` and no outgoing
  connection meanwhile, and a child that binds it with ``SO_REUSEADDR`` (Python's
  ``socketserver``/``http.server``, asyncio and so uvicorn, Rust's std, torch's ``TCPStore``)
  takes it over.
- a server that can bind port 0 and log the port it got: `port_from_log`.
- the real SGLang server and sglang-router: their start in `real_sglang.servers` holds the
  port too and restarts on another port when a bind fails (their other, internal ports).
"""

from __future__ import annotations

import random
import re
import socket
import subprocess
import sys
import time
from contextlib import suppress
from pathlib import Path

LOCALHOST = "127.0.0.1"


def torchrun(nproc_per_node: int) -> list[str]:
    """``python -m torch.distributed.run --standalone`` for ``nproc_per_node`` workers here.

    The agent hosts the rendezvous on ``localhost:0`` and, as rank 0, the workers' store on a
    port the OS gives it (workers see it as MASTER_PORT, ``TORCHELASTIC_USE_AGENT_STORE``);
    ``--local-addr`` makes MASTER_ADDR 127.0.0.1 (the host's FQDN otherwise), which the
    trainer also gives the servers as the weight group's address. Append the script or
    ``-m module`` and its arguments.
    """
    return [
        sys.executable, "-m", "torch.distributed.run", "--standalone", "--local-addr", LOCALHOST,
        "--nproc-per-node", str(nproc_per_node),
    ]  # fmt: skip


class HeldPort:
    """A TCP port on ``host`` kept bound by this process, not listening, until `close`.

    ``port`` 0: the OS picks one. The bind is exclusive (OSError if any socket has the port);
    ``SO_REUSEADDR`` is set only afterwards, so that a child binding the port with
    ``SO_REUSEADDR`` can take it over, while the kernel hands it to no ``bind(0)`` and no
    outgoing connection, and another `HeldPort` fails on it. Until a child listens, a
    connection to the port is refused. A context manager (``with HeldPort() as port:``).
    """

    def __init__(self, port: int = 0, host: str = LOCALHOST) -> None:
        self.host = host
        self._socket = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        try:
            self._socket.bind((host, port))
        except OSError:
            self._socket.close()
            raise
        self._socket.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self.port: int = self._socket.getsockname()[1]

    @classmethod
    def below_ephemeral(cls, host: str = LOCALHOST, low: int = 20000) -> HeldPort:
        """A held port drawn at random from ``[low, start of the kernel's ephemeral range)``,
        where neither ``bind(0)`` nor outgoing connections ever land; after 100 ports taken,
        one the OS picks."""
        ephemeral_low = 32768  # Linux's default start of ip_local_port_range
        with suppress(OSError, ValueError):
            text = Path("/proc/sys/net/ipv4/ip_local_port_range").read_text()
            ephemeral_low = int(text.split()[0])
        draw = random.SystemRandom()  # not the tests' seeded generator: workers must differ
        for _ in range(100):
            with suppress(OSError):
                return cls(draw.randrange(low, max(ephemeral_low, low + 1)), host)
        return cls(0, host)

    def close(self) -> None:
        """Unbind (idempotent): a child listening on the port keeps it."""
        self._socket.close()

    def __enter__(self) -> int:
        return self.port

    def __exit__(self, *exc) -> None:
        self.close()


def port_from_log(
    log_path: Path,
    pattern: str,
    *,
    process: subprocess.Popen | None = None,
    timeout_s: float = 120.0,
    poll_s: float = 0.05,
) -> int:
    """The port a server started on port 0 reports in its log: the first group of the first
    match of the regex ``pattern`` in ``log_path``. RuntimeError (with the log's tail) when
    ``process`` exits first, TimeoutError after ``timeout_s``."""
    regex = re.compile(pattern)
    deadline = time.monotonic() + timeout_s
    while True:
        text = log_path.read_text(errors="replace") if log_path.exists() else ""
        found = regex.search(text)
        if found:
            return int(found.group(1))
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"the server exited with code {process.returncode} before reporting its port; "
                f"log {log_path}:\n{text[-4000:]}"
            )
        if time.monotonic() > deadline:
            raise TimeoutError(f"no port in {log_path} within {timeout_s} s:\n{text[-4000:]}")
        time.sleep(poll_s)
