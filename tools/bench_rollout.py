"""Rollout bridge on CPU: generation speed and HTTP client overhead.

    python tools/bench_rollout.py [--prompts 16] [--n 2] [--new-tokens 32] [--hidden 64]
                                  [--repeats 3] [--threads N] [--json out.json]

Weight-sync throughput has its own tool, ``tools/bench_weight_sync.py`` (against the limits).

1. Tokens/s of the in-process engine (fp32 and bf16, with and without routed-expert capture):
   generated response tokens over wall time of ``generate``, median of ``--repeats``.
2. HTTP overhead: the same batch through ``SGLangEngine`` -> loopback server -> the same engine,
   against calling the engine directly, batched and one sample at a time (the loopback server
   answers one sample per request, so "batched" includes lost cross-sample batching).
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch
from rich.console import Console
from rich.table import Table

from megatron_rl.model import preset_config
from megatron_rl.rollout import InProcessEngine, InProcessEngineConfig, SamplingParams
from megatron_rl.rollout.http_pool import HttpPoolConfig
from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig
from megatron_rl.testing.loopback_server import LoopbackServer


def median_time(fn, repeats: int) -> float:
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def make_config(hidden: int):
    config = preset_config(
        "tiny", hidden_size=hidden, intermediate_size=2 * hidden, moe_intermediate_size=hidden // 2
    )
    config._attn_implementation = "sdpa"
    return config


def bench_generation(args, config, prompts) -> list[dict]:
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=0)
    rows = []
    for dtype in ("float32", "bfloat16"):
        engine = InProcessEngine.from_hf_config(config, InProcessEngineConfig(dtype=dtype))
        engine.generate(prompts[:2], SamplingParams(max_new_tokens=2))  # warm-up
        for routes in (False, True):
            out = {}

            def run(engine=engine, routes=routes, out=out):
                out["samples"] = engine.generate(
                    prompts, params, n=args.n, return_routed_experts=routes
                )

            seconds = median_time(run, args.repeats)
            tokens = sum(s.response_ids_R.numel() for s in out["samples"])
            rows.append(
                {"dtype": dtype, "routes": routes, "tokens": tokens, "seconds": seconds,
                 "tokens_per_s": tokens / seconds}
            )  # fmt: skip
    return rows


def bench_http_overhead(args, config, prompts) -> dict:
    engine = InProcessEngine.from_hf_config(config)
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=0)

    def one_by_one():
        for p in prompts:
            for j in range(args.n):
                engine.generate_one(p, params, sample_seed=j)

    direct = median_time(lambda: engine.generate(prompts, params, n=args.n), args.repeats)
    single = median_time(one_by_one, args.repeats)
    with LoopbackServer(engine) as server:
        client_config = SGLangEngineConfig.from_hf_config(
            config, http=HttpPoolConfig(urls=(server.url,)), max_in_flight=8
        )
        with SGLangEngine(client_config) as client:
            client.generate(prompts[:1], params)
            http = median_time(lambda: client.generate(prompts, params, n=args.n), args.repeats)
    num = len(prompts) * args.n
    return {
        "samples": num,
        "direct_batched_s": direct,
        "direct_per_sample_s": single,
        "http_s": http,
        "http_overhead_ms_per_sample": (http - single) / num * 1e3,
    }


def report(results: dict, args) -> None:
    console = Console()
    table = Table(title=f"in-process generation ({args.prompts} prompts x {args.n})")
    for col in ("dtype", "routes", "tokens", "s", "tokens/s"):
        table.add_column(col)
    for r in results["generation"]:
        table.add_row(
            r["dtype"], str(r["routes"]), str(r["tokens"]), f"{r['seconds']:.2f}",
            f"{r['tokens_per_s']:.0f}",
        )  # fmt: skip
    console.print(table)
    h = results["http"]
    console.print(
        f"HTTP client: {h['http_s']:.2f} s for {h['samples']} samples; engine direct "
        f"{h['direct_batched_s']:.2f} s batched, {h['direct_per_sample_s']:.2f} s one by one; "
        f"overhead vs one by one {h['http_overhead_ms_per_sample']:.1f} ms/sample"
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=2)
    parser.add_argument("--new-tokens", type=int, default=32)
    parser.add_argument("--prompt-len", type=int, default=24)
    parser.add_argument("--hidden", type=int, default=64)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--threads", type=int, default=None)
    parser.add_argument("--json", default=None)
    args = parser.parse_args()
    if args.threads:
        torch.set_num_threads(args.threads)
    config = make_config(args.hidden)
    gen = torch.Generator().manual_seed(0)
    prompts = [
        torch.randint(0, config.vocab_size, (args.prompt_len,), generator=gen).tolist()
        for _ in range(args.prompts)
    ]
    results = {
        "generation": bench_generation(args, config, prompts),
        "http": bench_http_overhead(args, config, prompts),
        "torch_threads": torch.get_num_threads(),
    }
    report(results, args)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
