"""Routing-replay benchmark: codec throughput, replay step-time overhead, R3 host memory.

    python tools/bench_routing.py [--quick]

1. Encode/decode throughput of every codec on Qwen3-30B-A3B-shaped routes (128 experts, top-8),
   and the bytes each stores per token-layer.
2. Forward+backward step time of the tiny megatron model (world size 1, CPU) without routing
   replay, and with R2 replay (with and without agreement measurement); median of repeats.
   Target: replay within 5% of no replay.
3. Peak host memory (ru_maxrss) of rank 0 in a 2-rank data-parallel R3 run, each rank holding
   only its own samples' routes (uint8, 8 MoE layers, top-4 of 16 experts) and replaying two
   micro-batches, against the same run without replay. Target: it grows by no more than rank 0's
   own shard of routing state (plus one micro-batch being decoded), never by the whole batch.
"""

from __future__ import annotations

import os

# Before torch is imported: OpenMP reads OMP_NUM_THREADS once, when torch loads it. Every
# process of this bench (and the gloo ranks it spawns, which inherit the environment) uses 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import resource
import statistics
import tempfile
import time

import torch
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from megatron_rl.routing import RoutingCodec, local_token_sources


def bench_codecs(num_items: int) -> Table:
    table = Table(title=f"codec throughput, 128 experts top-8, {num_items:,} token-layers")
    for column in ("codec", "bytes / token-layer", "encode M/s", "decode M/s"):
        table.add_column(column, justify="right")
    gen = torch.Generator().manual_seed(0)
    routes = torch.rand(num_items, 128, generator=gen).topk(8, dim=-1).indices.reshape(-1, 1, 8)
    for name in ("uint8", "int16", "int32", "packed"):
        codec = RoutingCodec(128, 8, name)
        start = time.perf_counter()
        blob = codec.encode(routes)
        encode_s = time.perf_counter() - start
        start = time.perf_counter()
        codec.decode(blob)
        decode_s = time.perf_counter() - start
        table.add_row(
            name,
            f"{codec.bytes_per_token_layer():g}",
            f"{num_items / encode_s / 1e6:.1f}",
            f"{num_items / decode_s / 1e6:.1f}",
        )
    return table


def _step_times(tmp: str, repeats: int, batch: int, seq: int) -> dict[str, float]:
    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.model import ModelOptions, build_model, causal_lm_logits, preset_config
    from megatron_rl.moe_layers import moe_layer_numbers
    from megatron_rl.routing.replay import ReplayConfig, RoutingReplay

    init_distributed(ParallelConfig(), init_method=f"file://{tmp}/rdzv_step", device="cpu")
    config = preset_config("tiny")
    layers = moe_layer_numbers(config)
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    results = {}
    try:
        for label, replay, agreement in (
            ("no replay", False, False),
            ("R2 replay", True, False),
            ("R2 replay + agreement", True, True),
        ):
            torch.manual_seed(0)
            model = build_model(config, ModelOptions(routing_replay=replay))
            driver = None
            if replay:
                driver = RoutingReplay(
                    model,
                    ReplayConfig(mode="r2", measure_agreement=agreement),
                    num_experts=config.num_experts,
                    topk=config.num_experts_per_tok,
                    moe_layer_numbers=layers,
                )
                with torch.no_grad(), driver.record("mb"):
                    causal_lm_logits(model, tokens)
            samples = []
            for i in range(repeats + 2):
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                if driver is None:
                    causal_lm_logits(model, tokens).float().pow(2).mean().backward()
                else:
                    with driver.replay(key="mb"):
                        causal_lm_logits(model, tokens).float().pow(2).mean().backward()
                if i >= 2:
                    samples.append(time.perf_counter() - start)
            results[label] = statistics.median(samples)
            if driver is not None:
                driver.close()
    finally:
        destroy_distributed()
    return results


def _memory_rank(rank, tmp, replay, samples_per_rank, length, queue):
    torch.set_num_threads(1)
    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.model import ModelOptions, build_model, causal_lm_logits, preset_config
    from megatron_rl.moe_layers import moe_layer_numbers
    from megatron_rl.routing.replay import ReplayConfig, RoutingReplay

    init_distributed(
        ParallelConfig(),
        rank=rank,
        world_size=2,
        init_method=f"file://{tmp}/rdzv_mem_{int(replay)}",
        device="cpu",
    )
    try:
        config = preset_config("tiny", num_hidden_layers=8, num_experts=16, num_experts_per_tok=4)
        layers = moe_layer_numbers(config)
        model = build_model(config, ModelOptions(routing_replay=replay))
        codec = RoutingCodec(config.num_experts, config.num_experts_per_tok, "auto")
        gen = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, config.vocab_size, (1, length), generator=gen)
        causal_lm_logits(model, tokens).float().pow(2).mean().backward()  # warm allocator
        rss_before = _current_rss()
        blobs, held = [], 0
        if replay:  # this rank's shard of engine routes: length - 1 rows per sample
            for _ in range(samples_per_rank):
                scores = torch.rand(length - 1, len(layers), config.num_experts, generator=gen)
                blobs.append(codec.encode(scores.topk(config.num_experts_per_tok, -1).indices))
                held += blobs[-1].nbytes
        rss_state = _current_rss() - rss_before
        driver = None
        if replay:
            driver = RoutingReplay(
                model,
                ReplayConfig(mode="r3"),
                num_experts=config.num_experts,
                topk=config.num_experts_per_tok,
                moe_layer_numbers=layers,
            )
        tokens = torch.randint(0, config.vocab_size, (2, length), generator=gen)
        for mb in range(2):  # replay two micro-batches of 2 samples
            if driver is None:
                causal_lm_logits(model, tokens).float().pow(2).mean().backward()
                continue
            sources = local_token_sources([length] * 2, seq_len=length)
            routes = driver.routes_for_micro_batch(
                blobs[2 * mb : 2 * mb + 2], [length] * 2, sources
            )
            with driver.replay(routes=routes):
                causal_lm_logits(model, tokens).float().pow(2).mean().backward()
        peak_kib = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        queue.put((rank, replay, peak_kib * 1024, held, rss_state))
    finally:
        destroy_distributed()


def _current_rss() -> int:
    with open("/proc/self/statm") as statm:
        return int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")


def bench_memory(samples_per_rank: int, length: int) -> Table:
    ctx = mp.get_context("spawn")
    queue = ctx.Queue()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for replay in (False, True):
            procs = [
                ctx.Process(
                    target=_memory_rank,
                    args=(rank, tmp, replay, samples_per_rank, length, queue),
                )
                for rank in range(2)
            ]
            for p in procs:
                p.start()
            for _ in procs:
                rank, rep, peak, held, rss_state = queue.get(timeout=600)
                results[(rank, rep)] = (peak, held, rss_state)
            for p in procs:
                p.join()
    base = results[(0, False)][0]
    peak, held, rss_state = results[(0, True)]
    whole = held + results[(1, True)][1]
    table = Table(title=f"2-rank R3, {samples_per_rank} samples/rank x {length} tokens, rank 0")
    columns = (
        "own shard",
        "whole batch",
        "RSS growth holding it",
        "peak RSS no replay",
        "peak RSS R3",
    )
    for column in columns:
        table.add_column(column, justify="right")
    mib = 1024**2
    table.add_row(
        f"{held / mib:.2f} MiB",
        f"{whole / mib:.2f} MiB",
        f"{rss_state / mib:.2f} MiB",
        f"{base / mib:.1f} MiB",
        f"{peak / mib:.1f} MiB",
    )
    return table


def main() -> None:
    parser = argparse.ArgumentParser(description="Routing-replay benchmark.")
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    args = parser.parse_args()
    console = Console(width=140)
    console.print(bench_codecs(20_000 if args.quick else 2_000_000))
    repeats, batch, seq = (3, 2, 32) if args.quick else (15, 2, 128)
    with tempfile.TemporaryDirectory() as tmp:
        times = _step_times(tmp, repeats, batch, seq)
    table = Table(title=f"tiny model fwd+bwd, batch {batch} x {seq}, median of {repeats}")
    for column in ("run", "ms", "vs no replay"):
        table.add_column(column, justify="right")
    for label, seconds in times.items():
        table.add_row(label, f"{seconds * 1e3:.1f}", f"{seconds / times['no replay']:.3f}x")
    console.print(table)
    samples, length = (4, 64) if args.quick else (256, 1024)
    console.print(bench_memory(samples, length))


if __name__ == "__main__":
    main()
