"""Routing-replay benchmark: codec throughput, replay step-time overhead, R3 routing memory.

    megatron-rl bench routing [--quick]

1. Encode/decode throughput of every codec on Qwen3-30B-A3B-shaped routes (128 experts, top-8),
   and the bytes each stores per token-layer.
2. Forward+backward step time of the tiny megatron model (world size 1, CPU) without routing
   replay, with R2 replay, and with R2 replay + agreement measurement. The three arms run
   interleaved in rotating order within each repeat; reported: each arm's median time and its
   paired per-repeat ratio to no replay, median [min-max]. Target: replay within 5% of no replay.
3. Routing memory of each rank in a 2-rank data-parallel R3 run (8 MoE layers, 128 experts
   top-8, uint8 routes), three arms in fresh processes: no replay (the same routes are generated
   and dropped: the noise floor), R3 holding only the rank's own samples' routes, and a
   counter-example holding the whole batch's routes on every rank. Computed: bytes of the held
   blobs (``RoutingBlob.nbytes``) and of one decoded micro-batch. Measured, after a warm-up
   micro-batch of the same shape and ``malloc_trim``: the growth of the bytes in use by the C
   allocator (glibc ``mallinfo2``, which every CPU tensor storage goes through) and of current
   RSS (``/proc/self/statm``) from before creating the routing state to after it, and to the peak
   over replaying two micro-batches (sampled after decoding each and after its fwd+bwd; RSS there
   also holds what the allocator keeps of the activations, the same in every arm). Claim, on the
   bytes in use: the own-shard arm grows by at most 1.2x its own shard + one decoded micro-batch
   and by less than 0.75x the whole-batch arm, which exceeds that bound.
"""

from __future__ import annotations

import os

# Before torch is imported: OpenMP reads OMP_NUM_THREADS once, when torch loads it. Every
# process of this bench (and the gloo ranks it starts, which inherit the environment) uses 1.
os.environ.setdefault("OMP_NUM_THREADS", "1")

import argparse
import ctypes
import json
import statistics
import tempfile
import time
from pathlib import Path

import torch
import torch.multiprocessing as mp
from rich.console import Console
from rich.table import Table

from megatron_rl.routing import RoutingCodec, local_token_sources

MIB = 1024**2
MEMORY_ARMS = ("no replay", "R3 own shard", "R3 whole batch")
# the memory ranks' model: 8 MoE layers of Qwen3-30B-A3B's routing shape (128 experts, top-8)
MEMORY_MODEL = dict(num_hidden_layers=8, num_experts=128, num_experts_per_tok=8)


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


STEP_ARMS = (
    ("no replay", False, False),
    ("R2 replay", True, False),
    ("R2 replay + agreement", True, True),
)


def _step_times(tmp: str, repeats: int, batch: int, seq: int) -> dict[str, list[float]]:
    """Per arm, fwd+bwd seconds of each repeat; the arms interleaved in rotating order."""
    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.model import ModelOptions, build_model, causal_lm_logits, preset_config
    from megatron_rl.moe_layers import moe_layer_numbers
    from megatron_rl.routing.replay import ReplayConfig, RoutingReplay

    init_distributed(ParallelConfig(), init_method=f"file://{tmp}/rdzv_step", device="cpu")
    config = preset_config("tiny")
    layers = moe_layer_numbers(config)
    tokens = torch.randint(0, config.vocab_size, (batch, seq))
    arms, drivers = [], []
    try:
        for label, replay, agreement in STEP_ARMS:
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
                drivers.append(driver)
                with torch.no_grad(), driver.record("mb"):
                    causal_lm_logits(model, tokens)
            arms.append((label, model, driver))
        samples: dict[str, list[float]] = {label: [] for label, _, _ in arms}
        warmup = 2
        for i in range(repeats + warmup):
            shift = i % len(arms)
            for label, model, driver in arms[shift:] + arms[:shift]:
                model.zero_grad(set_to_none=True)
                start = time.perf_counter()
                if driver is None:
                    causal_lm_logits(model, tokens).float().pow(2).mean().backward()
                else:
                    with driver.replay(key="mb"):
                        causal_lm_logits(model, tokens).float().pow(2).mean().backward()
                if i >= warmup:
                    samples[label].append(time.perf_counter() - start)
    finally:
        for driver in drivers:
            driver.close()
        destroy_distributed()
    return samples


def step_time_table(samples: dict[str, list[float]], batch: int, seq: int) -> Table:
    repeats = len(samples["no replay"])
    table = Table(title=f"tiny model fwd+bwd, batch {batch} x {seq}, {repeats} interleaved repeats")
    for column in ("run", "median ms", "paired ratio to no replay, median \\[min-max]"):
        table.add_column(column, justify="right")
    base = samples["no replay"]
    for label, times in samples.items():
        ratios = [t / b for t, b in zip(times, base, strict=True)]
        table.add_row(
            label,
            f"{statistics.median(times) * 1e3:.1f}",
            f"{statistics.median(ratios):.3f}x [{min(ratios):.3f}-{max(ratios):.3f}]",
        )
    return table


_MALLINFO2_FIELDS = "arena ordblks smblks hblks hblkhd usmblks fsmblks uordblks fordblks keepcost"


class _MallInfo2(ctypes.Structure):
    _fields_ = [(name, ctypes.c_size_t) for name in _MALLINFO2_FIELDS.split(" ")]


def _memory() -> tuple[int, int]:
    """(bytes the C allocator has handed out and not freed, current RSS).

    The first is glibc's ``mallinfo2`` (heap in use + mmapped chunks): every CPU tensor's storage,
    counted when allocated, whatever the allocator keeps cached or the kernel keeps resident; -1
    without glibc. The second is ``/proc/self/statm``."""
    with open("/proc/self/statm") as statm:
        rss = int(statm.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")
    try:
        mallinfo2 = ctypes.CDLL(None).mallinfo2
    except AttributeError:
        return -1, rss
    mallinfo2.restype = _MallInfo2
    info = mallinfo2()
    return info.uordblks + info.hblkhd, rss


def _sample_routes(codec: RoutingCodec, rows: int, layers: int, gen: torch.Generator):
    """One sample's engine routes (``rows`` token positions), encoded; distinct experts per set.

    Built directly in uint8 so the temporaries stay the size of the blob itself."""
    base = torch.randint(0, codec.num_experts, (rows, layers, 1), generator=gen, dtype=torch.uint8)
    offsets = torch.arange(codec.topk, dtype=torch.uint8)
    return codec.encode((base + offsets) % codec.num_experts)


def _memory_rank(rank, tmp, arm, samples_per_rank, length, queue):
    """One rank of one arm: RSS around creating the routing state and replaying 2 micro-batches."""
    torch.set_num_threads(1)
    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
    from megatron_rl.model import ModelOptions, build_model, causal_lm_logits, preset_config
    from megatron_rl.moe_layers import moe_layer_numbers
    from megatron_rl.routing.replay import ReplayConfig, RoutingReplay

    init_distributed(
        ParallelConfig(),
        rank=rank,
        world_size=2,
        init_method=f"file://{tmp}/rdzv_mem_{MEMORY_ARMS.index(arm)}",
        device="cpu",
    )
    try:
        config = preset_config("tiny", **MEMORY_MODEL)
        layers = len(moe_layer_numbers(config))
        replay = arm != "no replay"
        model = build_model(config, ModelOptions(routing_replay=replay))
        codec = RoutingCodec(config.num_experts, config.num_experts_per_tok, "auto")
        driver = None
        if replay:
            driver = RoutingReplay(
                model,
                ReplayConfig(mode="r3"),
                num_experts=config.num_experts,
                topk=config.num_experts_per_tok,
                moe_layer_numbers=moe_layer_numbers(config),
            )
        gen = torch.Generator().manual_seed(rank)
        tokens = torch.randint(0, config.vocab_size, (2, length), generator=gen)
        lengths = [length] * 2
        sources = local_token_sources(lengths, seq_len=length)
        rows = length - 1  # an engine returns routes for the positions it processed

        def micro_batch(blobs) -> int:
            """fwd+bwd of one 2-sample micro-batch (replaying ``blobs``); decoded bytes."""
            if driver is None:
                causal_lm_logits(model, tokens).float().pow(2).mean().backward()
                return 0
            routes = driver.routes_for_micro_batch(blobs, lengths, sources)
            samples.append(_memory())  # one micro-batch decoded
            with driver.replay(routes=routes):
                causal_lm_logits(model, tokens).float().pow(2).mean().backward()
            return sum(t.nbytes for t in routes)

        # warm-up micro-batch of the same shape (its routes dropped): model caches, gradients
        # (kept: later backwards accumulate into them), the decode and replay paths; then the
        # freed activations' pages go back to the kernel, so new allocations show in RSS
        samples: list[tuple[int, int]] = []
        micro_batch([_sample_routes(codec, rows, layers, gen) for _ in range(2)])
        if hasattr(libc := ctypes.CDLL(None), "malloc_trim"):  # glibc
            libc.malloc_trim(0)
        before = _memory()
        # the own shard is samples [rank * n, (rank + 1) * n) of the batch; the whole-batch arm
        # holds all 2 n, the no-replay arm generates the own shard and drops it
        first = 0 if arm == "R3 whole batch" else rank * samples_per_rank
        count = 2 * samples_per_rank if arm == "R3 whole batch" else samples_per_rank
        held, own_bytes = [], 0
        for i in range(first, first + count):
            blob = _sample_routes(codec, rows, layers, torch.Generator().manual_seed(i))
            if rank * samples_per_rank <= i < (rank + 1) * samples_per_rank:
                own_bytes += blob.nbytes
            if replay:
                held.append(blob)
            del blob
        state = _memory()
        own = held[rank * samples_per_rank - first :] if arm == "R3 whole batch" else held
        samples = [state]
        decoded = 0
        for mb in range(2):  # replay this rank's first two micro-batches of 2 samples
            decoded = max(decoded, micro_batch(own[2 * mb : 2 * mb + 2]))
            samples.append(_memory())
        queue.put(
            dict(
                rank=rank,
                arm=arm,
                own=own_bytes,
                held=sum(blob.nbytes for blob in held),
                decoded=decoded,
                state_delta=state[0] - before[0],
                peak_delta=max(s[0] for s in samples) - before[0],
                rss_state_delta=state[1] - before[1],
                rss_peak_delta=max(s[1] for s in samples) - before[1],
                heap=before[0] >= 0,
            )
        )
    finally:
        if driver is not None:
            driver.close()
        destroy_distributed()


def measure_memory(samples_per_rank: int, length: int) -> dict[tuple[str, int], dict]:
    """Every arm's per-rank result (``_memory_rank``), each arm in 2 fresh processes."""
    # forkserver with the heavy imports preloaded: each rank is a fresh process (its own heap,
    # nothing inherited from another arm) without paying the megatron import again
    ctx = mp.get_context("forkserver")
    ctx.set_forkserver_preload(["torch", "megatron_rl.backend", "megatron_rl.model"])
    queue = ctx.Queue()
    results = {}
    with tempfile.TemporaryDirectory() as tmp:
        for arm in MEMORY_ARMS:
            procs = [
                ctx.Process(
                    target=_memory_rank, args=(rank, tmp, arm, samples_per_rank, length, queue)
                )
                for rank in range(2)
            ]
            for p in procs:
                p.start()
            for _ in procs:
                result = queue.get(timeout=600)
                results[(result["arm"], result["rank"])] = result
            for p in procs:
                p.join()
                if p.exitcode != 0:
                    raise RuntimeError(f"memory rank of arm {arm!r} exited with {p.exitcode}")
    return results


def memory_verdict(results: dict[tuple[str, int], dict]) -> tuple[bool, list[str]]:
    """Per rank: own-shard arm peak <= 1.2 (own + one decoded micro-batch) and < 0.75 whole arm."""
    lines, ok = [], True
    key = "peak_delta" if results[("no replay", 0)]["heap"] else "rss_peak_delta"
    for rank in range(2):
        own = results[("R3 own shard", rank)]
        whole = results[("R3 whole batch", rank)]
        bound = 1.2 * (own["own"] + own["decoded"])
        within = own[key] <= bound
        below = own[key] < 0.75 * whole[key]
        caught = whole[key] > bound
        ok = ok and within and below and caught
        lines.append(
            f"rank {rank}: own-shard arm peak {own[key] / MIB:.2f} MiB "
            f"{'<=' if within else '>'} 1.2 x (own shard + 1 decoded mb) = {bound / MIB:.2f} MiB "
            f"[{'PASS' if within else 'FAIL'}]; "
            f"{'<' if below else '>='} 0.75 x whole-batch arm peak "
            f"{0.75 * whole[key] / MIB:.2f} MiB [{'PASS' if below else 'FAIL'}]; "
            f"whole-batch arm {'exceeds' if caught else 'within'} the bound "
            f"[{'caught' if caught else 'NOT caught'}]"
        )
    return ok, lines


def memory_table(results: dict[tuple[str, int], dict], samples_per_rank: int, length: int):
    own0, own1 = results[("no replay", 0)]["own"], results[("no replay", 1)]["own"]
    table = Table(
        title=f"2-rank R3 routing memory, {samples_per_rank} samples/rank x {length} tokens, "
        "8 MoE layers, 128 experts top-8 (uint8); whole batch "
        f"{(own0 + own1) / MIB:.2f} MiB; in use: glibc mallinfo2; RSS: /proc/self/statm"
    )
    columns = (
        "arm",
        "rank",
        "own shard",
        "held (computed)",
        "1 decoded mb",
        "in use: delta holding state",
        "in use: peak delta in replay",
        "RSS: delta holding state",
        "RSS: peak delta in replay",
    )
    for column in columns:
        table.add_column(column, justify="right")
    for arm in MEMORY_ARMS:
        for rank in range(2):
            r = results[(arm, rank)]
            table.add_row(
                arm,
                str(rank),
                f"{r['own'] / MIB:.2f} MiB",
                f"{r['held'] / MIB:.2f} MiB",
                f"{r['decoded'] / MIB:.2f} MiB",
                *(
                    f"{r[key] / MIB:.2f} MiB" if r["heap"] or key.startswith("rss") else "n/a"
                    for key in ("state_delta", "peak_delta", "rss_state_delta", "rss_peak_delta")
                ),
            )
    return table


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description="Routing-replay benchmark.")
    parser.add_argument("--quick", action="store_true", help="small sizes (CI smoke run)")
    parser.add_argument(
        "--memory-json", type=Path, help="also write the memory arms' per-rank results here"
    )
    args = parser.parse_args(argv)
    console = Console(width=160)
    console.print(bench_codecs(20_000 if args.quick else 2_000_000))
    repeats, batch, seq = (3, 2, 32) if args.quick else (15, 2, 128)
    with tempfile.TemporaryDirectory() as tmp:
        times = _step_times(tmp, repeats, batch, seq)
    console.print(step_time_table(times, batch, seq))
    samples, length = (64, 128) if args.quick else (1024, 1024)
    results = measure_memory(samples, length)
    if args.memory_json:
        args.memory_json.write_text(json.dumps(list(results.values()), indent=1))
    console.print(memory_table(results, samples, length))
    ok, lines = memory_verdict(results)
    for line in lines:
        console.print(line, highlight=False, markup=False)
    console.print(
        f"claim (rank holds its own shard, never the whole batch): {'PASS' if ok else 'FAIL'}"
    )
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
