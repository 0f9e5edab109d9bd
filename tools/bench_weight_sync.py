"""Weight-sync throughput against the limit of the same machine, measured in the same process.

    python tools/bench_weight_sync.py [--hidden 1024 2048] [--repeats 5] [--bucket-mb 64]
                                      [--old-tree DIR]

A megatron-core model of the ``tiny`` preset widened to ``--hidden`` (1024: 106 MB, 2048: 420 MB
of fp32 HF tensors) syncs into an in-process engine behind the loopback server, one torch
thread everywhere. Every repeat runs every arm once, in a rotating order:

- ``distributed``, ``disk``, ``tensor``: `SGLangEngine.update_weights` end to end (pause, flush,
  buckets, engine load, version update and check, continue), bytes / wall time;
- limits: ``gloo`` = the same bytes broadcast in buckets of the same size to a second process
  over a gloo group (what ``distributed`` moves, without HTTP or loading), ``safetensors`` = the
  same tensors saved in shards of the bucket size and read back into memory (``disk`` without
  HTTP, fsync or version folders), ``memcpy`` = one copy of every tensor (a load's floor).

Ratios are paired per repeat (project time / limit time of the same repeat): median
[min-max]. ``--old-tree DIR``: a checkout of an older commit measured by the same script in a
subprocess (its own limits, same sizes), for before/after rows.
"""

from __future__ import annotations

import os

os.environ.setdefault("OMP_NUM_THREADS", "1")  # before torch loads OpenMP

import argparse
import json
import multiprocessing
import statistics
import subprocess
import sys
import tempfile
import time

import torch

ARMS = ("distributed", "gloo", "disk", "safetensors", "tensor", "memcpy")
RATIOS = (("distributed", "gloo"), ("disk", "safetensors"), ("tensor", "gloo"))


def _sync_config(transport: str, disk_dir: str, bucket_bytes: int):
    from megatron_rl.rollout.weight_sync import WeightSyncConfig

    extra = {}
    if "tensor_serializer" in WeightSyncConfig.__dataclass_fields__:  # before flat buckets
        extra["tensor_serializer"] = "torch_b64"
    return WeightSyncConfig(
        transport=transport, disk_dir=disk_dir, bucket_bytes=bucket_bytes, **extra
    )


def _receiver(port: int, name: str, sizes: list[int], rounds: int, conn) -> None:
    torch.set_num_threads(1)
    from megatron_rl.rollout.weight_group import broadcast_tensor, init_weight_group

    group = init_weight_group(
        backend="gloo", master_address="127.0.0.1", master_port=port, rank=1, world_size=2,
        group_name=name,
    )  # fmt: skip
    buffers = [torch.empty(size, dtype=torch.uint8) for size in sizes]
    for _ in range(rounds):
        for buffer in buffers:
            broadcast_tensor(group, buffer)
        conn.send("done")


class GlooLimit:
    """The same bytes, in the same bucket sizes, broadcast to a second process."""

    def __init__(self, sizes: list[int], rounds: int) -> None:
        from megatron_rl.rollout.weight_group import init_weight_group, unique_group_name

        port, name = _free_port(), unique_group_name("limit")
        context = multiprocessing.get_context("spawn")
        self.conn, child = context.Pipe()
        self.process = context.Process(
            target=_receiver, args=(port, name, sizes, rounds, child), daemon=True
        )
        self.process.start()
        self.group = init_weight_group(
            backend="gloo", master_address="127.0.0.1", master_port=port, rank=0, world_size=2,
            group_name=name,
        )  # fmt: skip
        self.buffers = [torch.randint(0, 255, (size,), dtype=torch.uint8) for size in sizes]

    def run(self) -> None:
        from megatron_rl.rollout.weight_group import broadcast_tensor

        for buffer in self.buffers:
            broadcast_tensor(self.group, buffer)
        self.conn.recv()


def _free_port() -> int:
    import socket

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _bucket_sizes(named, bucket_bytes: int) -> list[int]:
    sizes, size = [], 0
    for _, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if size and size + nbytes > bucket_bytes:
            sizes.append(size)
            size = 0
        size += nbytes
    return [*sizes, size] if size else sizes


def measure(hidden: int, repeats: int, bucket_bytes: int, disk_root: str) -> dict:
    """One model size: seconds per arm per repeat, in a rotating order."""
    torch.set_num_threads(1)
    from bench_rollout import make_config
    from safetensors import safe_open
    from safetensors.torch import save_file

    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.model import build_model
    from megatron_rl.model.conversion import iter_hf_tensors
    from megatron_rl.rollout import InProcessEngine
    from megatron_rl.rollout.http_pool import HttpPoolConfig
    from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig
    from megatron_rl.testing.loopback_server import LoopbackServer

    config = make_config(hidden)
    times: dict[str, list[float]] = {arm: [] for arm in ARMS}
    with tempfile.TemporaryDirectory(dir=disk_root) as tmp:
        init_distributed(ParallelConfig(), init_method=f"file://{tmp}/rdzv", device="cpu")
        try:
            model = build_model(config).eval()
            named = [(n, t.detach().clone()) for n, t in iter_hf_tensors(model, config)]
            total = sum(t.numel() * t.element_size() for _, t in named)
            engine = InProcessEngine.from_hf_config(config)
            targets = [torch.empty_like(t) for _, t in named]
            index = {name: i for i, (name, _) in enumerate(named)}
            gloo = GlooLimit(_bucket_sizes(named, bucket_bytes), rounds=repeats + 1)
            server = LoopbackServer(engine).start()
            clients = {}
            for transport in ("distributed", "disk", "tensor"):
                sync = _sync_config(transport, tmp, bucket_bytes)
                client_config = SGLangEngineConfig.from_hf_config(
                    config, http=HttpPoolConfig(urls=(server.url,)), sync=sync
                )
                clients[transport] = SGLangEngine(client_config, hf_config=config)
            version = [0]

            def sync_with(transport):
                def run():
                    version[0] += 1
                    clients[transport].update_weights(iter(named), version=version[0])

                return run

            def safetensors_round_trip():
                folder = os.path.join(tmp, "limit")
                os.makedirs(folder, exist_ok=True)
                shard, size, files = {}, 0, []
                for name, tensor in [*named, (None, None)]:
                    nbytes = 0 if tensor is None else tensor.numel() * tensor.element_size()
                    if shard and (tensor is None or size + nbytes > bucket_bytes):
                        files.append(os.path.join(folder, f"{len(files)}.safetensors"))
                        save_file(shard, files[-1])
                        shard, size = {}, 0
                    if tensor is not None:
                        shard[name], size = tensor, size + nbytes
                for path in files:  # read back into memory (get_tensor maps lazily)
                    with safe_open(path, framework="pt") as handle:
                        for key in handle.keys():  # noqa: SIM118 - safe_open has no __iter__
                            targets[index[key]].copy_(handle.get_tensor(key))

            def memcpy():
                for target, (_, tensor) in zip(targets, named, strict=True):
                    target.copy_(tensor)

            run = {
                "distributed": sync_with("distributed"), "disk": sync_with("disk"),
                "tensor": sync_with("tensor"), "gloo": gloo.run,
                "safetensors": safetensors_round_trip, "memcpy": memcpy,
            }  # fmt: skip
            gloo.run()  # warm-up round of every arm
            for arm in ("distributed", "disk", "tensor", "safetensors", "memcpy"):
                run[arm]()
            for repeat in range(repeats):
                order = ARMS[repeat % len(ARMS) :] + ARMS[: repeat % len(ARMS)]
                for arm in order:
                    start = time.perf_counter()
                    run[arm]()
                    times[arm].append(time.perf_counter() - start)
            for client in clients.values():
                client.close()
            server.stop()
            gloo.process.join(30)
        finally:
            destroy_distributed()
    return {"hidden": hidden, "mb": total / 1e6, "times": times}


def summarize(result: dict) -> dict:
    times, mb = result["times"], result["mb"]
    out = {"hidden": result["hidden"], "mb": mb}
    for arm in ARMS:
        out[f"{arm}_mb_s"] = mb / statistics.median(times[arm])
    for arm, limit in RATIOS:
        ratios = [a / b for a, b in zip(times[arm], times[limit], strict=True)]
        out[f"{arm}/{limit}"] = (statistics.median(ratios), min(ratios), max(ratios))
    return out


def _worker(args) -> None:
    result = measure(args.worker_hidden, args.repeats, args.bucket_mb * 1024**2, args.disk_root)
    print("RESULT " + json.dumps(result))


def _run_worker(tree: str, hidden: int, args) -> dict:
    env = {**os.environ, "PYTHONPATH": tree, "OMP_NUM_THREADS": "1"}
    command = [
        sys.executable, os.path.abspath(__file__), "--worker-hidden", str(hidden),
        "--repeats", str(args.repeats), "--bucket-mb", str(args.bucket_mb),
        "--disk-root", args.disk_root,
    ]  # fmt: skip
    done = subprocess.run(command, env=env, capture_output=True, text=True, cwd=tree)
    lines = [line for line in done.stdout.splitlines() if line.startswith("RESULT ")]
    if done.returncode or not lines:
        raise RuntimeError(f"worker in {tree} failed:\n{done.stderr[-3000:]}")
    return json.loads(lines[-1].removeprefix("RESULT "))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--hidden", type=int, nargs="+", default=[1024, 2048])
    parser.add_argument("--repeats", type=int, default=5)
    parser.add_argument("--bucket-mb", type=int, default=64)
    parser.add_argument("--old-tree", default=None, help="checkout of an older commit")
    parser.add_argument("--disk-root", default="/dev/shm" if os.path.isdir("/dev/shm") else None)
    parser.add_argument("--json", default=None)
    parser.add_argument("--worker-hidden", type=int, default=None, help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker_hidden is not None:
        _worker(args)
        return
    here = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    trees = [("now", here)] + ([("old", os.path.abspath(args.old_tree))] if args.old_tree else [])
    rows = []
    for hidden in args.hidden:
        for label, tree in trees:
            row = summarize(_run_worker(tree, hidden, args))
            rows.append({"tree": label, **row})
            print(_format(rows[-1]), flush=True)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(rows, handle, indent=2)


def _format(row: dict) -> str:
    speeds = ", ".join(f"{arm} {row[f'{arm}_mb_s']:.0f}" for arm in ARMS)
    ratios = ", ".join(
        f"{arm}/{limit} {row[f'{arm}/{limit}'][0]:.2f}x "
        f"[{row[f'{arm}/{limit}'][1]:.2f}-{row[f'{arm}/{limit}'][2]:.2f}]"
        for arm, limit in RATIOS
    )
    return f"[{row['tree']}] {row['mb']:.0f} MB: MB/s {speeds}; time/limit {ratios}"


if __name__ == "__main__":
    main()
