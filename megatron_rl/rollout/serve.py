"""``python -m megatron_rl.rollout.serve``: start SGLang servers (+ router) for a training job.

    python -m megatron_rl.rollout.serve --model-path HF_DIR --num-servers 2 --tp-size 8 \
        --gpus-per-server 8 --base-port 30000 [--router-port 29000] [--routed-experts] [--dry-run]

Server ``i`` runs on GPUs ``i * gpus_per_server ...`` (``CUDA_VISIBLE_DEVICES``) and port
``base_port + i``; every server must answer ``/health`` within ``--health-timeout`` seconds. The
URLs the trainer should use (``--sglang-url``) are printed, one per line, prefixed ``URL ``. The
process then waits; SIGTERM or SIGINT stops every server it started (their process groups only).
``--dry-run`` prints the commands and exits.
"""

from __future__ import annotations

import argparse
import logging
import signal
import sys
import threading

from megatron_rl.rollout.launch import (
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
        plan.append((server_command(config), env, config.url))
        urls.append(config.url)
    if args.router_port:
        url = f"http://{args.host}:{args.router_port}"
        plan.append((router_command(urls, args.router_port, args.host), {}, url))
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
    parser.add_argument("--log-dir", default=None)
    parser.add_argument("--dry-run", action="store_true")
    args = parser.parse_args(argv)
    if args.gpus_per_server is None:
        args.gpus_per_server = args.tp_size
    if args.gpus_per_server < args.tp_size:
        parser.error(f"--gpus-per-server {args.gpus_per_server} < --tp-size {args.tp_size}")
    plan = build_plan(args)
    if args.dry_run:
        for cmd, env, url in plan:
            prefix = " ".join(f"{k}={v}" for k, v in env.items())
            print(f"{prefix} {' '.join(cmd)}".strip())  # noqa: T201 (the CLI's output)
            print(f"URL {url}")  # noqa: T201
        return 0
    return _serve(plan, args)


def _serve(plan, args) -> int:
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(message)s")
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    processes = []
    try:
        for i, (cmd, env, url) in enumerate(plan):
            log = f"{args.log_dir}/sglang_{i}.log" if args.log_dir else None
            process = start_process(cmd, log_path=log, env=env)
            processes.append(process)
            wait_healthy(url, timeout_s=args.health_timeout, process=process)
            print(f"URL {url}", flush=True)  # noqa: T201
        stop.wait()
        return 0
    finally:
        for process in reversed(processes):
            stop_process(process)


if __name__ == "__main__":
    sys.exit(main())
