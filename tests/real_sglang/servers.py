"""Start and stop the real SGLang 0.5.23 server and sglang-router 0.3.2 on CPU, for tests.

Both run from the separate venv ``.venv-sglang/`` at the repository root (``make sglang-env``,
see ``README.md`` beside this file), never from the project's venv: this module imports neither
sglang nor the router. Each process starts in its own session (process group) with the two
test-only shims of ``shims/`` on its ``PYTHONPATH``; `RealServer.stop` / `RealRouter.stop`
signal that group only (SIGTERM, SIGKILL after 30 s) and run at interpreter exit too, so a
failed test run leaves no server behind (a test process killed with SIGKILL still does).

``MEGATRON_RL_REAL_SGLANG=require`` turns a missing venv from a skip into an error (CI).
"""

from __future__ import annotations

import atexit
import contextlib
import http.client
import json
import os
import random
import signal
import socket
import subprocess
import time
from collections.abc import Sequence
from pathlib import Path

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

# SGLang's CPU engine with torch-native kernels only, sized for a tiny model
SERVER_ENV = {
    "SGLANG_USE_CPU_ENGINE": "1",
    "SGLANG_HEALTH_CHECK_TIMEOUT": str(int(HEALTH_CHECK_TIMEOUT_S)),
    "HF_HUB_OFFLINE": "1",
    "TRANSFORMERS_OFFLINE": "1",
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
)  # fmt: skip


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


def free_port() -> int:
    """A TCP port on 127.0.0.1 that is free now, drawn below the kernel's ephemeral range.

    A port the OS picks (``bind(0)``) comes from that range, and while an SGLang server starts
    (tens of seconds under load) any outgoing connection of the other test worker (gloo, HTTP
    clients) can be handed the same port: the server then fails with "address already in use".
    """
    ephemeral_low = 32768  # Linux's default start of ip_local_port_range
    with contextlib.suppress(OSError, ValueError):
        ephemeral_low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    draw = random.SystemRandom()  # not the tests' seeded generator: workers must differ
    for _ in range(100):
        port = draw.randrange(20000, max(ephemeral_low, 20001))
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            try:
                sock.bind((HOST, port))
            except OSError:
                continue
            return port
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:  # the OS's pick
        sock.bind((HOST, 0))
        return sock.getsockname()[1]


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
    """A command in its own session with output to ``log_path``; `stop` ends its group."""

    kind = "process"

    def __init__(self, cmd: Sequence[str], *, env: dict, log_path, port: int) -> None:
        self.port = port
        self.url = f"http://{HOST}:{port}"
        self.log_path = Path(log_path)
        self.command = list(cmd)
        self.started_at = time.monotonic()
        with open(self.log_path, "ab") as log:
            self.process = subprocess.Popen(
                self.command,
                stdin=subprocess.DEVNULL,
                stdout=log,
                stderr=subprocess.STDOUT,
                env={**os.environ, "PYTHONPATH": str(SHIMS_DIR), **env},
                cwd=REPO_ROOT,
                start_new_session=True,
                # a test run killed with SIGKILL (no atexit) takes its servers with it; their own
                # processes die with them (SGLang's kill_itself_when_parent_died)
                preexec_fn=popen_dies_with_this_thread(),
            )
        self._stopped = False
        atexit.register(self.stop)

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
        """Poll until the process answers; returns the seconds since it was started.

        Raises RuntimeError (with the log's tail) if the process exits first, TimeoutError
        after ``timeout_s``; either way the process group is stopped first.
        """
        deadline = time.monotonic() + timeout_s
        while True:
            if not self.alive():
                code = self.process.returncode
                self.stop()
                raise RuntimeError(
                    f"{self.kind} {self.url} (pid {self.pid}) exited with code {code} before it "
                    f"was ready; log {self.log_path}:\n{self.log_tail()}"
                )
            try:
                if self._ready():
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

    def __init__(self, cmd: Sequence[str], *, env: dict, log_path, port: int, workers: int):
        super().__init__(cmd, env=env, log_path=log_path, port=port)
        self.workers = workers

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
    """Launch the real SGLang server on ``model_dir`` (HF folder) at 127.0.0.1:``port`` (a free
    one by default); ``dtype``: "bfloat16" or "float32" (or "auto"). ``extra_args`` follow the
    defaults (a later flag wins). Returns at once: call ``wait_ready`` (start-up ~20-50 s)."""
    port = free_port() if port is None else port
    cmd = [
        str(SGLANG_PYTHON), "-m", "sglang.launch_server",
        "--model-path", os.fspath(model_dir),
        "--host", HOST, "--port", str(port),
        "--dtype", dtype,
        *SERVER_FLAGS, *extra_args,
    ]  # fmt: skip
    return RealServer(cmd, env=SERVER_ENV, log_path=log_path, port=port)


def start_router(worker_urls: Sequence[str], *, port: int | None = None, log_path) -> RealRouter:
    """Launch sglang-router in front of ``worker_urls`` at 127.0.0.1:``port``; its Prometheus
    exporter goes to another free port on 127.0.0.1 (default 0.0.0.0:29000 would collide).
    ``wait_ready`` returns once every worker is registered and healthy."""
    if not worker_urls:
        raise ValueError("start_router: worker_urls is empty")
    port = free_port() if port is None else port
    cmd = [
        str(SGLANG_PYTHON), "-m", "sglang_router.launch_router",
        "--worker-urls", *worker_urls,
        "--host", HOST, "--port", str(port),
        "--prometheus-host", HOST, "--prometheus-port", str(free_port()),
    ]  # fmt: skip
    # the launcher imports sglang (hence torchvision): the same shims as the server
    return RealRouter(
        cmd, env={"HF_HUB_OFFLINE": "1"}, log_path=log_path, port=port, workers=len(worker_urls)
    )
