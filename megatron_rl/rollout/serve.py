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
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

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


def build_plan(args) -> list[tuple[list[str], dict, str]]:
    """``(command, extra environment, url)`` for every process to start, router last."""
    return [(cmd, env, url) for cmd, env, url, _ in _plan(args)]


def _plan(args) -> list[tuple[list[str], dict, str, str]]:
    """As `build_plan`, with the output label of each url (``URL`` or ``ROUTER_URL``)."""
    plan = []
    urls = []
    for i in range(args.num_servers):
        config = SGLangServerConfig(
            model_path=args.model_path,
            port=args.base_port + i,
            host=args.host,
            tp_size=args.tp_size,
            ep_size=args.ep_size,
            mem_fraction_static=args.mem_fraction_static,
            return_routed_experts=args.routed_experts,
        )
        gpus = range(i * args.gpus_per_server, (i + 1) * args.gpus_per_server)
        env = {"CUDA_VISIBLE_DEVICES": ",".join(map(str, gpus))}
        plan.append((server_command(config), env, config.url, "URL"))
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
    parser.add_argument("--health-timeout", type=float, default=900.0)
    parser.add_argument(
        "--health-probe-timeout",
        type=float,
        default=DEFAULT_PROBE_TIMEOUT_S,
        help="seconds one /health probe may take (SGLang: >= 1 s, 503 after 20 s)",
    )
    parser.add_argument("--log-dir", default=None)
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
    plan = _plan(args)
    if args.dry_run:
        for cmd, env, url, label in plan:
            prefix = " ".join(f"{k}={v}" for k, v in env.items())
            print(f"{prefix} {' '.join(cmd)}".strip())  # noqa: T201 (the CLI's output)
            print(f"{label} {url}")  # noqa: T201
        return 0
    return _serve(plan, args)


def _serve(plan, args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    processes = []
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
        stop.wait()
        return 0
    finally:
        for process in reversed(processes):
            stop_process(process)


if __name__ == "__main__":
    sys.exit(main())
