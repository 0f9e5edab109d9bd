"""Start and stop the real SGLang 0.5.23 server and sglang-router 0.3.2 on CPU, for tests.

Both run from the separate venv ``.venv-sglang/`` at the repository root (``make sglang-env``,
see ``README.md`` beside this file), never from the project's venv: this module imports neither
sglang nor the router. Each process starts in its own session (process group) with the two
test-only shims of ``shims/`` on its ``PYTHONPATH``; `RealServer.stop` / `RealRouter.stop`
signal that group only (SIGTERM, SIGKILL after 30 s) and run at interpreter exit too, so a
failed test run leaves no server behind (a test process killed with SIGKILL still does).

Ports: neither the server nor the router can bind port 0 and report it, and each picks ports of
its own while it starts (the server's scheduler group, the router's metrics). So each start
draws its port below the kernel's ephemeral range and holds it (`ports.HeldPort`: no ``bind(0)``,
outgoing connection or other test's draw gets it; the server binds it with ``SO_REUSEADDR``)
until the process is ready; a start that exits having logged a failed bind ("address already
in use") is started again on a fresh port by `wait_ready`, `START_ATTEMPTS` times at most.

``MEGATRON_RL_REAL_SGLANG=require`` turns a missing venv from a skip into an error (CI).
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import re
import signal
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

from ports import HeldPort

from megatron_rl.parent_death import popen_dies_with_this_thread

REPO_ROOT = Path(__file__).resolve().parents[2]
SGLANG_VENV = REPO_ROOT / ".venv-sglang"
SGLANG_PYTHON = SGLANG_VENV / "bin" / "python"
SHIMS_DIR = Path(__file__).resolve().parent / "shims"
REQUIRE_ENV = "MEGATRON_RL_REAL_SGLANG"
HOST = "127.0.0.1"

# SGLang's /health waits this long for a generation before answering 503
# (sglang/srt/entrypoints/http_server.py: HEALTH_CHECK_TIMEOUT, env SGLANG_HEALTH_CHECK_TIMEOUT)
HEALTH_CHECK_TIMEOUT_S = 20.0
STOP_TIMEOUT_S = 30.0
# starts of one server or router, the first included, when a start fails to bind a port
START_ATTEMPTS = 3
# what the server (uvicorn, SGLang's port checks, torch's TCPStore) and the router log when a
# port they bind is taken
BIND_FAILURE = re.compile(
    r"address already in use|EADDRINUSE|is not available in \d+ seconds|"
    r"Port is already in use|error while attempting to bind",
    re.IGNORECASE,
)

# SGLang's CPU engine with torch-native kernels only, sized for a tiny model
SERVER_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_HEALTH_CHECK_TIMEOUT": str(int(HEALTH_CHECK_TIMEOUT_S)),
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
    # one torch thread, as the trainers under test (--torch-threads 1): SGLang sets no thread
    # count on CPU, and torch's two OpenMP threads spin at every barrier while the other test
    # worker holds a core (the trainer-learns test took 37 s to 219 s from run to run)
    "OMP_NUM_THREADS": "1",
}
SERVER_FLAGS = (
    "--device", "cpu",
    "--attention-backend", "torch_native",
    "--sampling-backend", "pytorch",
    "--disable-cuda-graph",
    "--disable-overlap-schedule",
    "--skip-server-warmup",
    "--grammar-backend", "none",
    "--max-total-tokens", "2048",
    "--mem-fraction-static", "0.05",
    "--enable-return-routed-experts",
    "--skip-tokenizer-init",
    # an idle scheduler polls its sockets in a busy loop: one core per server (30 CPU-s in 30 s
    # idle, measured), taken from the trainer it serves and from the other test worker; with
    # the flag it blocks in zmq's poll until a request comes (1 CPU-s in 30 s)
    "--sleep-on-idle",
)  # fmt: skip


KERNEL_PATH_ENV = ("ATEN_CPU_CAPABILITY", "MKL_ENABLE_INSTRUCTIONS")
"""The variables that force torch's and MKL's kernels onto another path (`make test-kernel-paths`,
docs/testing.md). The SGLang server does not inherit them: on an AVX-512 machine torch's bf16
attention (SGLang's torch_native backend) packs its operands with an AVX-512-only routine and
stops the scheduler under ``ATEN_CPU_CAPABILITY=avx2`` ("pack_vnni2 is only supported when
avx512 is supported"). The lane checks the trainer's verdicts; the server keeps the machine's
kernels."""


def _server_environ() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if k not in KERNEL_PATH_ENV}


def available() -> bool:
    """Whether ``make sglang-env`` has completed (its stamp file exists)."""
    return (SGLANG_VENV / ".installed").is_file() and SGLANG_PYTHON.exists()


def require() -> None:
    """Return if the venv is installed; else skip the test, or raise under
    ``MEGATRON_RL_REAL_SGLANG=require``."""
    if available():
        return
    reason = f"the real SGLang venv {SGLANG_VENV.name}/ is not installed: run `make sglang-env`"
    if os.environ.get(REQUIRE_ENV) == "require":
        raise RuntimeError(f"{reason} ({REQUIRE_ENV}=require)")
    import pytest

    pytest.skip(reason, allow_module_level=True)


def task_hf_config(**overrides):
    """The trainer's ``--model tiny`` policy for the built-in task (its 16-token vocabulary),
    as `megatron_rl.train.task.build_task` builds it; ``overrides`` change the preset."""
    from megatron_rl.model import preset_config
    from megatron_rl.train.task import TaskConfig, build_task

    config = build_task(TaskConfig(model="tiny")).hf_config
    if overrides:
        config = preset_config("tiny", **{"vocab_size": config.vocab_size, **overrides})
        config._attn_implementation = "eager"
    return config


def calculator_hf_config(max_response_length: int = 12):
    """The trainer's ``--model tiny`` policy for ``--task calculator`` (its 19-symbol
    vocabulary, padded to 24), as `megatron_rl.train.task.build_task` builds it for
    ``--max-response-length max_response_length`` (8 or more)."""
    from megatron_rl.train.task import TaskConfig, build_task

    task = TaskConfig(model="tiny", task="calculator", max_response_length=max_response_length)
    return build_task(task).hf_config


def write_tiny_checkpoint(folder, config=None, *, seed: int = 0, **overrides) -> Path:
    """A random HF Qwen3-MoE checkpoint (``config.json`` + ``model.safetensors``, per-expert
    names) in ``folder``; no tokenizer (the server runs with ``--skip-tokenizer-init``).

    ``config``: a ``Qwen3MoeConfig``, default `task_hf_config` with ``overrides``. The weights
    depend on ``seed`` only (the caller's RNG state is left alone); routers are drawn from
    N(0, 0.5) as the rollout tests' ``random_hf_model`` does (HF's zeros would tie all experts).
    """
    import torch
    from rollout.rollout_testing import random_hf_model

    if config is None:
        config = task_hf_config(**overrides)
    elif overrides:
        raise ValueError("write_tiny_checkpoint: give a config or overrides, not both")
    folder = Path(folder)
    with torch.random.fork_rng(devices=[]):
        model = random_hf_model(config, seed=seed)
    model.save_pretrained(folder)
    saved = json.loads((folder / "config.json").read_text())
    if saved.get("architectures") != ["Qwen3MoeForCausalLM"]:  # SGLang picks the model by it
        saved["architectures"] = ["Qwen3MoeForCausalLM"]
        (folder / "config.json").write_text(json.dumps(saved, indent=2))
    return folder


def request(url: str, method: str, path: str, body=None, *, timeout_s: float = 30.0):
    """``(status, answer)``: one HTTP request without proxies; JSON answers are decoded."""
    host, port = url.removeprefix("http://").rsplit(":", 1)
    connection = http.client.HTTPConnection(host, int(port), timeout=timeout_s)
    try:
        data = None if body is None else json.dumps(body).encode()
        headers = {} if body is None else {"Content-Type": "application/json"}
        connection.request(method, path, body=data, headers=headers)
        response = connection.getresponse()
        raw = response.read().decode(errors="replace")
    finally:
        connection.close()
    try:
        return response.status, json.loads(raw)
    except ValueError:
        return response.status, raw


class _Process:
    """A command in its own session with output to ``log_path``; `stop` ends its group.

    ``command(port, hold)`` gives the command line for a start on ``port``; ``hold()`` gives it
    one more port, held like the main one (drawn below the ephemeral range) until the process
    is ready. ``port`` None: drawn and held for each start, and a start that exits having
    logged a failed bind is started again on fresh ports by `wait_ready` (`START_ATTEMPTS` in
    all); a given port is used as it is, once.
    """

    kind = "process"

    def __init__(
        self,
        command: Callable[[int, Callable[[], int]], Sequence[str]],
        *,
        env: dict,
        log_path,
        port: int | None,
    ) -> None:
        self.log_path = Path(log_path)
        self.attempts = 0
        self._command, self._env, self._given_port = command, env, port
        self._held: list[HeldPort] = []
        self._stopped = True
        self._start()

    def _hold(self) -> int:
        held = HeldPort.below_ephemeral(HOST)
        self._held.append(held)
        return held.port

    def _release_ports(self) -> None:
        for held in self._held:
            held.close()
        self._held = []

    def _start(self) -> None:
        self.attempts += 1
        self.port = self._hold() if self._given_port is None else self._given_port
        self.url = f"http://{HOST}:{self.port}"
        self.command = list(self._command(self.port, self._hold))
        self._log_start = self.log_path.stat().st_size if self.log_path.exists() else 0
        self.started_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**_server_environ(), "PYTHONPATH": str(SHIMS_DIR), **self._env},
                cwd=REPO_ROOT,
                start_new_session=True,
                # a test run killed with SIGKILL (no atexit) takes its servers with it; their own
                # processes die with them (SGLang's kill_itself_when_parent_died)
                preexec_fn=popen_dies_with_this_thread(),
            )
        self._stopped = False
        atexit.register(self.stop)

    def _restartable(self) -> bool:
        """Whether this start failed to bind a port and may be retried on fresh ones."""
        if self._given_port is not None or self.attempts >= START_ATTEMPTS:
            return False
        with open(self.log_path, "rb") as log:
            log.seek(self._log_start)
            text = log.read().decode(errors="replace")
        return BIND_FAILURE.search(text) is not None

    @property
    def pid(self) -> int:
        return self.process.pid

    def alive(self) -> bool:
        return self.process.poll() is None

    def log_tail(self, chars: int = 6000) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError as error:
            return f"(log {self.log_path} unreadable: {error})"
        return text[-chars:]

    def _ready(self) -> bool:
        raise NotImplementedError

    def wait_ready(self, timeout_s: float = 300.0, poll_s: float = 0.5) -> float:
        """Poll until the process answers; returns the seconds since its last start.

        A start that exits having logged a failed bind is started again on fresh ports (see
        the class). Raises RuntimeError (with the log's tail) if the process exits otherwise,
        TimeoutError after ``timeout_s`` (all starts together); either way the process group
        is stopped first.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                code = self.process.returncode
                if self._restartable():
                    self.stop()
                    with open(self.log_path, "a") as log:
                        log.write(
                            f"\n[servers.py] port {self.port}: a bind failed (exit code {code}); "
                            f"starting again on another port (start {self.attempts + 1})\n"
                        )
                    self._start()
                    continue
                self.stop()
                raise RuntimeError(
                    f"{self.kind} {self.url} (pid {self.pid}) exited with code {code} before it "
                    f"was ready (start {self.attempts}); log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if self._ready():
                    self._release_ports()  # the process listens on them now
                    return time.monotonic() - self.started_at
            except (OSError, http.client.HTTPException):
                pass
            if time.monotonic() > deadline:
                self.stop()
                raise TimeoutError(
                    f"{self.kind} {self.url} (pid {self.pid}) not ready within {timeout_s} s; "
                    f"log {self.log_path}:\n{self.log_tail()}"
                )
            time.sleep(poll_s)

    def stop(self, timeout_s: float = STOP_TIMEOUT_S) -> int | None:
        """SIGTERM the process group, SIGKILL it after ``timeout_s``; idempotent.

        Returns the exit code of the started process."""
        if self._stopped:
            return self.process.returncode
        self._stopped = True
        atexit.unregister(self.stop)
        group = self.pid  # start_new_session: the process leads its own group
        _signal_group(group, signal.SIGTERM)
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            self.process.poll()  # reap the leader; its children are reaped by init
            if not _group_exists(group):
                break
            time.sleep(0.1)
        else:
            _signal_group(group, signal.SIGKILL)
        self._release_ports()
        return self.process.wait()


def _signal_group(group: int, sig: int) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.killpg(group, sig)


def _group_exists(group: int) -> bool:
    try:
        os.killpg(group, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


class RealServer(_Process):
    """``python -m sglang.launch_server`` (see `start_server`)."""

    kind = "SGLang server"

    def _ready(self) -> bool:
        # a one-token generation: ready means the scheduler runs, not only that HTTP is up
        status, _ = request(
            self.url, "GET", "/health_generate", timeout_s=HEALTH_CHECK_TIMEOUT_S + 10.0
        )
        return status == 200


class RealRouter(_Process):
    """``python -m sglang_router.launch_router`` (see `start_router`)."""

    kind = "sglang-router"

    def __init__(self, command, *, env: dict, log_path, port: int | None, workers: int):
        self.workers = workers
        super().__init__(command, env=env, log_path=log_path, port=port)

    def _ready(self) -> bool:
        # /health answers 200 before the router has registered its workers (it probes their
        # /health, /server_info and /model_info first); /readiness counts the healthy ones
        status, answer = request(self.url, "GET", "/readiness", timeout_s=10.0)
        return (
            status == 200
            and isinstance(answer, dict)
            and answer.get("healthy_workers", 0) >= self.workers
        )


def start_server(
    model_dir,
    *,
    port: int | None = None,
    dtype: str = "bfloat16",
    extra_args: Sequence[str] = (),
    log_path,
) -> RealServer:
    """Launch the real SGLang server on ``model_dir`` (HF folder) at 127.0.0.1:``port`` (drawn
    and held by default, started again on another if a bind fails: see the module);
    ``dtype``: "bfloat16" or "float32" (or "auto"). ``extra_args`` follow the defaults (a later
    flag wins). Returns at once: call ``wait_ready`` (start-up ~20-50 s), then read ``url``."""

    def command(port: int, hold) -> list[str]:
        return [
            str(SGLANG_PYTHON), "-m", "sglang.launch_server",
            "--model-path", os.fspath(model_dir),
            "--host", HOST, "--port", str(port),
            "--dtype", dtype,
            *SERVER_FLAGS, *extra_args,
        ]  # fmt: skip

    return RealServer(command, env=SERVER_ENV, log_path=log_path, port=port)


def start_router(worker_urls: Sequence[str], *, port: int | None = None, log_path) -> RealRouter:
    """Launch sglang-router in front of ``worker_urls`` at 127.0.0.1:``port`` (drawn and held
    by default, as the server's); its Prometheus exporter goes to another held port on
    127.0.0.1 (default 0.0.0.0:29000 would collide). ``wait_ready`` returns once every worker
    is registered and healthy."""
    if not worker_urls:
        raise ValueError("start_router: worker_urls is empty")

    def command(port: int, hold) -> list[str]:
        return [
            str(SGLANG_PYTHON), "-m", "sglang_router.launch_router",
            "--worker-urls", *worker_urls,
            "--host", HOST, "--port", str(port),
            "--prometheus-host", HOST, "--prometheus-port", str(hold()),
        ]  # fmt: skip

    # the launcher imports sglang (hence torchvision): the same shims as the server
    return RealRouter(
        command,
        env={"HF_HUB_OFFLINE": "1"},
        log_path=log_path,
        port=port,
        workers=len(worker_urls),
    )
