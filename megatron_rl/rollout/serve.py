"""``python -m megatron_rl.rollout.serve``: start SGLang servers (+ router) for a training job.

    python -m megatron_rl.rollout.serve --model-path HF_DIR --num-servers 2 --tp-size 8 \
        --gpus-per-server 8 --base-port 30000 [--router-port 29000] [--routed-experts] [--dry-run]

Server ``i`` runs on GPUs ``i * gpus_per_server ...`` (``CUDA_VISIBLE_DEVICES``) and port
``base_port + i``; every server must answer ``/health`` within ``--health-timeout`` seconds (each
probe waits up to ``--health-probe-timeout`` seconds: SGLang's ``/health`` generates one token
and sleeps 1 s before answering). The worker URLs the trainer should use (``--sglang-url``) are
printed, one per line, prefixed ``URL ``; the router's, if any, is printed prefixed
``ROUTER_URL `` (generation only: give it as the router URL, never as an ``--sglang-url``, since
sglang-router serves none of the pause / weight-update routes). The process then waits;
SIGTERM or SIGINT stops every server it started (their process groups only).
``--dry-run`` prints the commands and exits.

``--memory-saver`` starts servers whose memory a colocated trainer (``--colocate``) releases and
resumes: SGLang's ``--enable-memory-saver``, ``SGLANG_MEMORY_SAVER_CUDA_GRAPH=1`` so that the
``cuda_graph`` tag frees the CUDA graphs' memory too (without it the tag frees nothing), and
``--disable-prefill-cuda-graph``, since SGLang's breakable prefill graph backend (its default on
CUDA) refuses the memory saver's graph pool. ``--python`` names the servers' interpreter (default:
this one); ``--sglang-args "..."`` adds flags to every server's ``sglang.launch_server`` command
(the one-machine rehearsal runs SGLang's CPU engine this way).

``--heartbeat-file PATH`` ties the servers to a training job on other nodes: the job rewrites PATH
(on a filesystem every node sees) every few seconds and removes it when it ends. The servers are
stopped when PATH is removed (exit 0: the job ended) or when its content has not changed for
``--heartbeat-timeout`` seconds (exit 1: the job or its node is gone). Staleness is judged by this
node's own clock on the file's content, never by comparing clocks across nodes; the timeout runs
from the moment every server answers ``/health``, so a job that starts later has that long to
write its first beat.

Every ``--heartbeat-poll`` seconds the servers themselves are checked too: when one exits (a
crash, an out-of-memory kill) the others are stopped and ``serve`` exits 2 naming it and its log,
so the node's task fails (SLURM's ``--kill-on-bad-exit`` then ends the job) instead of serving
on with a server missing.
"""

from __future__ import annotations

import argparse
import logging
import shlex
import signal
import sys
import threading
import time
from pathlib import Path

from megatron_rl.rollout.http_pool import SGLANG_HEALTH_MIN_S
from megatron_rl.rollout.launch import (
    DEFAULT_PROBE_TIMEOUT_S,
    SGLangServerConfig,
    router_command,
    server_command,
    start_process,
    stop_process,
    wait_healthy,
)

logger = logging.getLogger(__name__)

HEARTBEAT_REMOVED = 0  # exit status: the training job removed its heartbeat (a clean end)
HEARTBEAT_STALE = 1  # exit status: the heartbeat stopped changing (the job or its node is gone)
SERVER_DIED = 2  # exit status: a server this process started exited on its own
_STOP_SIGNALS = (signal.SIGTERM, signal.SIGINT)

# A server whose memory a colocated trainer releases and resumes (`/release_memory_occupation`):
# torch_memory_saver's regions; the CUDA graphs' pool joins them only under the environment
# variable, and SGLang's breakable prefill graph backend (its default on CUDA) then refuses to
# start, so the prefill graphs are off (SGLang 0.5.23 flags; slime sets the same variable).
MEMORY_SAVER_ARGS = ("--enable-memory-saver", "--disable-prefill-cuda-graph")
MEMORY_SAVER_ENV = {"SGLANG_MEMORY_SAVER_CUDA_GRAPH": "1"}


class Heartbeat:
    """Watches a file that another node's job rewrites; `check` says whether that job is gone.

    Every content change (by this process's monotonic clock) renews the job's lease of
    ``timeout_s`` seconds; the first lease starts when the watcher is made. A file that was seen
    and then removed means the job ended.
    """

    def __init__(self, path: str | Path, timeout_s: float, clock=time.monotonic) -> None:
        if not timeout_s > 0:
            raise ValueError(f"Heartbeat timeout_s={timeout_s!r}: must be > 0")
        self.path = Path(path)
        self.timeout_s = timeout_s
        self._clock = clock
        self._content: bytes | None = None
        self._seen = False
        self._changed_at = clock()

    def check(self) -> tuple[int, str] | None:
        """None while the job lives; else ``(exit status, reason)``."""
        try:
            content = self.path.read_bytes()  # open/read: NFS revalidates on open
        except FileNotFoundError:
            if self._seen:
                return HEARTBEAT_REMOVED, f"{self.path} was removed: the training job ended"
            content = None
        except OSError as error:  # a transient read error counts as no beat
            logger.warning("heartbeat %s unreadable: %s", self.path, error)
            content = self._content
        now = self._clock()
        if content is not None and content != self._content:
            self._content, self._seen, self._changed_at = content, True, now
        if now - self._changed_at > self.timeout_s:
            what = "has not changed" if self._seen else "has not appeared"
            return HEARTBEAT_STALE, (
                f"{self.path} {what} for {self.timeout_s:g} s: the training job (or its node, or "
                "this node's view of the shared filesystem) is gone"
            )
        return None


def build_plan(args) -> list[tuple[list[str], dict, str]]:
    """``(command, extra environment, url)`` for every process to start, router last."""
    return [(cmd, env, url) for cmd, env, url, _ in _plan(args)]


def _plan(args) -> list[tuple[list[str], dict, str, str]]:
    """As `build_plan`, with the output label of each url (``URL`` or ``ROUTER_URL``)."""
    plan = []
    urls = []
    extra = shlex.split(args.sglang_args)
    for i in range(args.num_servers):
        config = SGLangServerConfig(
            model_path=args.model_path,
            port=args.base_port + i,
            host=args.host,
            tp_size=args.tp_size,
            ep_size=args.ep_size,
            mem_fraction_static=args.mem_fraction_static,
            return_routed_experts=args.routed_experts,
            extra_args=(*(MEMORY_SAVER_ARGS if args.memory_saver else ()), *extra),
        )
        gpus = range(i * args.gpus_per_server, (i + 1) * args.gpus_per_server)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        if args.memory_saver:
            env.update(MEMORY_SAVER_ENV)
        plan.append((server_command(config, args.python), env, config.url, "URL"))
        urls.append(config.url)
    if args.router_port:
        url = f"http://{args.host}:{args.router_port}"
        plan.append((router_command(urls, args.router_port, args.host), {}, url, "ROUTER_URL"))
    return plan


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model-path", required=True)
    parser.add_argument("--num-servers", type=int, default=1)
    parser.add_argument("--tp-size", type=int, default=1)
    parser.add_argument("--ep-size", type=int, default=1)
    parser.add_argument("--gpus-per-server", type=int, default=None)
    parser.add_argument("--host", default="127.0.0.1")
    parser.add_argument("--base-port", type=int, default=30000)
    parser.add_argument("--router-port", type=int, default=0, help="0: no sglang-router")
    parser.add_argument("--mem-fraction-static", type=float, default=0.7)
    parser.add_argument("--routed-experts", action="store_true", help="R3: return routes")
    parser.add_argument(
        "--memory-saver",
        action="store_true",
        help="colocated servers: SGLang's memory saver, CUDA graphs included (see above)",
    )
    parser.add_argument("--python", default=sys.executable, help="the servers' interpreter")
    parser.add_argument(
        "--sglang-args",
        default="",
        help="more flags for every server's sglang.launch_server, one shell-quoted string "
        '(e.g. "--device cpu --attention-backend torch_native")',
    )
    parser.add_argument("--health-timeout", type=float, default=900.0)
    parser.add_argument(
        "--health-probe-timeout",
        type=float,
        default=DEFAULT_PROBE_TIMEOUT_S,
        help="seconds one /health probe may take (SGLang: >= 1 s, 503 after 20 s)",
    )
    parser.add_argument("--log-dir", default=None)
    parser.add_argument(
        "--heartbeat-file",
        default=None,
        help="stop the servers when the training job stops rewriting this file (shared "
        "filesystem) or removes it",
    )
    parser.add_argument(
        "--heartbeat-timeout",
        type=float,
        default=300.0,
        help="seconds without a change of --heartbeat-file before the servers are stopped",
    )
    parser.add_argument(
        "--heartbeat-poll",
        type=float,
        default=5.0,
        help="seconds between checks of the heartbeat and of the servers (a server that exits "
        "stops the others: exit status 2)",
    )
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.gpus_per_server is None:
        args.gpus_per_server = args.tp_size
    if args.gpus_per_server < args.tp_size:
        parser.error(f"--gpus-per-server {args.gpus_per_server} < --tp-size {args.tp_size}")
    if args.health_probe_timeout <= SGLANG_HEALTH_MIN_S:
        parser.error(
            f"--health-probe-timeout {args.health_probe_timeout}: must exceed the "
            f"{SGLANG_HEALTH_MIN_S} s SGLang's /health takes at least"
        )
    if not args.heartbeat_poll > 0:
        parser.error("--heartbeat-poll must be > 0")
    if args.heartbeat_file and not args.heartbeat_timeout > 0:
        parser.error("--heartbeat-timeout must be > 0")
    plan = _plan(args)
    if args.dry_run:
        for cmd, env, url, label in plan:
            prefix = " ".join(f"{k}={v}" for k, v in env.items())
            print(f"{prefix} {' '.join(cmd)}".strip())  # noqa: T201 (the CLI's output)
            print(f"{label} {url}")  # noqa: T201
        if args.heartbeat_file:
            print(  # noqa: T201
                f"# stops the servers when {args.heartbeat_file} is removed or unchanged for "
                f"{args.heartbeat_timeout:g} s"
            )
        return 0
    return _serve(plan, args)


def _dead_server(plan, processes, log_dir: str | None) -> tuple[int, str] | None:
    """``(SERVER_DIED, reason)`` when a started server has exited, else None."""
    for i, ((_, _, url, _), process) in enumerate(zip(plan, processes, strict=True)):
        code = process.poll()
        if code is not None:
            log = f"; its log: {log_dir}/sglang_{i}.log" if log_dir else ""
            return SERVER_DIED, f"server {i} ({url}) exited with status {code}{log}"
    return None


def _serve(plan, args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    previous = {sig: signal.signal(sig, lambda *_: stop.set()) for sig in _STOP_SIGNALS}
    processes = []
    if args.log_dir:
        Path(args.log_dir).mkdir(parents=True, exist_ok=True)
    try:
        for i, (cmd, env, url, label) in enumerate(plan):
            log = f"{args.log_dir}/sglang_{i}.log" if args.log_dir else None
            process = start_process(cmd, log_path=log, env=env)
            processes.append(process)
            wait_healthy(
                url,
                timeout_s=args.health_timeout,
                process=process,
                probe_timeout_s=args.health_probe_timeout,
            )
            print(f"{label} {url}", flush=True)  # noqa: T201
        heartbeat = None
        if args.heartbeat_file:
            heartbeat = Heartbeat(args.heartbeat_file, args.heartbeat_timeout)
        while not stop.wait(args.heartbeat_poll):
            gone = _dead_server(plan, processes, args.log_dir)
            if gone is None and heartbeat is not None:
                gone = heartbeat.check()
            if gone is not None:
                status, reason = gone
                logger.warning("stopping the servers: %s", reason)
                return status
        return 0
    finally:
        for process in reversed(processes):
            stop_process(process)
        for sig, handler in previous.items():
            signal.signal(sig, handler)


if __name__ == "__main__":
    sys.exit(main())
