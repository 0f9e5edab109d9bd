"""Start SGLang servers (and the router) and wait until they answer ``/health``.

Used by the example launchers. `server_command` only builds the argument list, so it is testable
without sglang; `start_process` runs any such command in its own process group (stop it with
`stop_process`, which signals that group only).
"""

from __future__ import annotations

import dataclasses
import http.client
import logging
import os
import signal
import subprocess
import sys
import time
from collections.abc import Sequence

from megatron_rl.rollout.http_pool import (
    SGLANG_HEALTH_CHECK_TIMEOUT_S,
    SGLANG_HEALTH_MIN_S,
    request_json,
)

logger = logging.getLogger(__name__)

# one /health probe: longer than SGLang's own health-check timeout (20 s), so a slow first
# generation is reported as SGLang decides it (200 or 503), not as a client timeout
DEFAULT_PROBE_TIMEOUT_S = SGLANG_HEALTH_CHECK_TIMEOUT_S + 10.0


@dataclasses.dataclass(kw_only=True, slots=True)
class SGLangServerConfig:
    """One ``sglang.launch_server`` process."""

    model_path: str
    port: int
    host: str = "127.0.0.1"
    tp_size: int = 1
    ep_size: int = 1
    mem_fraction_static: float = 0.7
    return_routed_experts: bool = False  # R3: --enable-return-routed-experts
    skip_tokenizer_init: bool = True
    dtype: str = "auto"
    extra_args: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        if not 0 < self.port < 65536:
            raise ValueError(f"SGLangServerConfig.port={self.port!r}: must be in 1..65535")
        for name in ("tp_size", "ep_size"):
            if not isinstance(getattr(self, name), int) or getattr(self, name) < 1:
                raise ValueError(f"SGLangServerConfig.{name}={getattr(self, name)!r}: int >= 1")
        if self.tp_size % self.ep_size:
            raise ValueError(
                f"SGLangServerConfig.ep_size={self.ep_size} must divide tp_size={self.tp_size} "
                "(SGLang's expert parallelism runs inside the TP group)"
            )
        if not 0 < self.mem_fraction_static < 1:
            raise ValueError(
                f"SGLangServerConfig.mem_fraction_static={self.mem_fraction_static!r}: in (0, 1)"
            )

    @property
    def url(self) -> str:
        return f"http://{self.host}:{self.port}"


def server_command(config: SGLangServerConfig, python: str = sys.executable) -> list[str]:
    """The argument list of ``python -m sglang.launch_server`` for ``config``."""
    cmd = [
        python, "-m", "sglang.launch_server",
        "--model-path", config.model_path,
        "--host", config.host,
        "--port", str(config.port),
        "--tp-size", str(config.tp_size),
        "--mem-fraction-static", str(config.mem_fraction_static),
        "--dtype", config.dtype,
    ]  # fmt: skip
    if config.ep_size > 1:
        cmd += ["--ep-size", str(config.ep_size)]
    if config.skip_tokenizer_init:
        cmd.append("--skip-tokenizer-init")
    if config.return_routed_experts:
        cmd.append("--enable-return-routed-experts")
    return [*cmd, *config.extra_args]


def router_command(
    worker_urls: Sequence[str], port: int, host: str = "127.0.0.1", python: str = sys.executable
) -> list[str]:
    """``python -m sglang_router.launch_router`` over ``worker_urls``."""
    if not worker_urls:
        raise ValueError("router_command: worker_urls is empty")
    return [
        python, "-m", "sglang_router.launch_router",
        "--host", host, "--port", str(port), "--worker-urls", *worker_urls,
    ]  # fmt: skip


def start_process(
    cmd: Sequence[str], *, log_path: str | os.PathLike | None = None, env: dict | None = None
) -> subprocess.Popen:
    """Start ``cmd`` in a new session (process group), output to ``log_path`` or inherited."""
    log = open(log_path, "ab") if log_path is not None else None  # noqa: SIM115
    logger.info("starting: %s", " ".join(cmd))
    return subprocess.Popen(
        list(cmd),
        stdout=log,
        stderr=subprocess.STDOUT if log else None,
        env={**os.environ, **(env or {})},
        start_new_session=True,
    )


def wait_healthy(
    url: str,
    *,
    timeout_s: float,
    process: subprocess.Popen | None = None,
    poll_s: float = 0.5,
    probe_timeout_s: float = DEFAULT_PROBE_TIMEOUT_S,
) -> float:
    """Poll ``url/health`` until it answers 200; returns the seconds waited.

    SGLang's ``/health`` answers 503 at once while the server starts, then runs a one-token
    generation and sleeps 1 s before its first check (up to ``SGLANG_HEALTH_CHECK_TIMEOUT``,
    20 s, before a 503): each probe therefore waits ``probe_timeout_s`` (default 30 s) for the
    answer, and the wait may overrun ``timeout_s`` by at most one probe.

    Raises:
        RuntimeError: ``process`` exited first (with its exit code), or ``timeout_s`` passed.
    """
    if probe_timeout_s <= SGLANG_HEALTH_MIN_S:
        raise ValueError(
            f"wait_healthy: probe_timeout_s={probe_timeout_s!r} must exceed the "
            f"{SGLANG_HEALTH_MIN_S} s SGLang's /health sleeps before answering"
        )
    start = time.monotonic()
    while True:
        if process is not None and process.poll() is not None:
            raise RuntimeError(
                f"server process for {url} exited with code {process.returncode} before /health "
                "answered; see its log"
            )
        try:
            status, _ = request_json(
                url,
                "GET",
                "/health",
                None,
                timeout_s=probe_timeout_s,
                connect_timeout_s=min(5.0, probe_timeout_s),
            )
            if status == 200:
                return time.monotonic() - start
        except (OSError, http.client.HTTPException):
            pass
        if time.monotonic() - start > timeout_s:
            raise RuntimeError(f"{url}/health did not answer 200 within {timeout_s} s")
        time.sleep(poll_s)


def stop_process(process: subprocess.Popen, timeout_s: float = 30.0) -> int:
    """SIGTERM the process group started by `start_process`, SIGKILL after ``timeout_s``."""
    if process.poll() is None:
        os.killpg(process.pid, signal.SIGTERM)
        try:
            process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            os.killpg(process.pid, signal.SIGKILL)
            process.wait()
    return process.returncode
