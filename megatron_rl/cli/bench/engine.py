"""The in-process engine on a study-sized request: expert kernels and batch sizes, paired.

    megatron-rl bench engine [--preset tiny] [--dtype float32 bfloat16] [--prompts 16]
                             [--n 8] [--new-tokens 4] [--repeats 20]
                             [--batch-sizes 64 256] [--json out.json]

One ``generate`` call of ``--prompts`` prompts x ``--n`` samples (the study's rollout: 16 x 8,
prompts of 3 tokens over the built-in task's 16-token vocabulary, ``--new-tokens`` 4, seeded
sampling), one torch thread. Arms, one engine each (same weights):

- ``old``: transformers' ``"grouped_mm"`` experts (``torch._grouped_mm``), the engine's default;
- ``new``: ``"padded_bmm"`` (`megatron_rl.rollout.padded_experts`);
- ``--batch-sizes A B ...``: the default experts with ``max_batch_size`` A, B, ... (ratios
  against A);
- ``matmul`` (bf16 dtypes): ``native``, torch's bf16 kernels, against ``fp32``, the bf16
  operands through fp32 kernels (`megatron_rl.rollout.fp32_matmuls`, the engine's default on
  the CPU).

- ``rows``: ``keep``, finished rows fed on until the batch's longest row ends, against ``drop``,
  finished rows leaving the batch (`megatron_rl.rollout.live_rows`, the engine's default); it
  needs responses of uneven length: ``--checkpoint DIR --task NAME`` (a trained policy, e.g.
  the study's warm start, and its built-in task's prompts, stopping at its end-of-sequence
  token).

``--compare`` picks among ``experts``, ``matmul``, ``batch`` and ``rows`` (default: the first
three). ``--checkpoint DIR``: the engine loads these weights instead of random ones; ``--task
NAME``: the prompts are that built-in task's (`megatron_rl.data.builtin_tasks`), sampling stops
at its tokenizer's end-of-sequence token.

The arms alternate (ABBA) within every repeat. Each call is timed on the wall clock and on the
thread's CPU clock (on a shared machine the CPU clock is the steadier one); ratios are
first-arm time / arm time, paired per repeat: median [min-max]. Every arm's samples are
compared with the first arm's: equal tokens, and the largest log-prob difference.

Measured 2026-12-03 on a 2-core AMD EPYC (AVX2, no native bf16) shared with other jobs, 16 x 8
x 4 tokens, CPU clock, ratio = old (or batch64) / arm, median [min-max]:

    preset         dtype     padded_bmm vs grouped_mm   max_batch_size 256 vs 64
    tiny           float32   0.94 [0.91-1.37] (20 rep.)  1.41 [1.35-1.51]  (114 vs 160 us/token)
    tiny           bfloat16  0.72 [0.70-0.97] (20 rep.)  1.23 [1.00-1.45]  (201 vs 246 us/token)
    tiny-mismatch  float32   0.51 [0.45-0.57] (10 rep.)  1.43 [1.09-1.51]  (244 vs 347 us/token)
    tiny-mismatch  bfloat16  0.27 [0.26-0.33] (10 rep.)  1.17 [1.06-1.39]  (634 vs 738 us/token)

bf16 products (``--compare matmul``, tiny-mismatch, 16 x 8 x 64 tokens, 6 repeats, CPU clock,
native / fp32, measured 2026-12-03 on the same machine under load): bfloat16 2.02 [1.94-2.07]
(454 vs 224 us/token), float8 1.96 [1.93-2.00] (462 vs 236); the same tokens, log-probs within
2.3e-3 (bf16) and 1.1e-3 (float8) of the native kernels'.

Every arm drew the same tokens; log-probs were bitwise equal except fp32 across batch sizes
(2.4e-7: MKL rounds a row by the matrix's row count). The padded kernel loses because the
study's rows repeat (10 distinct prompts, 16-token vocabulary), so routing piles onto a few
experts and every expert's slice is padded to the busiest one; the grouped matmul does no
padded work.
"""

from __future__ import annotations

import argparse
import json
import statistics
import time

import torch

from megatron_rl.model import PRESET_NAMES, preset_config
from megatron_rl.rollout import InProcessEngine, InProcessEngineConfig, SamplingParams
from megatron_rl.rollout.route_capture import moe_gates

COMPARISONS = ("experts", "matmul", "batch", "rows")
MATMULS = ("native", "fp32")  # InProcessEngineConfig.bf16_matmul arms, the first the baseline
BUILTIN_VOCAB = 16  # the built-in task's tokenizer (`megatron_rl.data.builtin_tokenizer`)


def study_prompts(num_prompts: int) -> list[list[int]]:
    """``<bos> d =``-shaped prompts of 3 tokens (ids below the built-in vocabulary)."""
    return [[1, 2 + i % 10, 13] for i in range(num_prompts)]


def build_engine(preset: str, config: InProcessEngineConfig) -> InProcessEngine:
    """Seed-0 weights with routers drawn as megatron draws them, N(0, 0.02): transformers
    initialises routers to zeros, whose ties send every token to the same top-k experts."""
    engine = InProcessEngine.from_hf_config(preset_config(preset, vocab_size=BUILTIN_VOCAB), config)
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for gate in moe_gates(engine.model):
            noise = torch.randn(gate.weight.shape, generator=generator) * 0.02
            gate.weight.copy_(noise.to(gate.weight.dtype))
    return engine


def timed_call(engine: InProcessEngine, prompts, params, n: int):
    wall, cpu = time.perf_counter(), time.thread_time()
    samples = engine.generate(prompts, params, n=n)
    return time.perf_counter() - wall, time.thread_time() - cpu, samples


def compare_samples(a, b) -> dict:
    """Whether every sample's tokens are equal, and the largest |log-prob difference|."""
    tokens = all(torch.equal(x.response_ids_R, y.response_ids_R) for x, y in zip(a, b, strict=True))
    gap = max(float((x.logprobs_R - y.logprobs_R).abs().max()) for x, y in zip(a, b, strict=True))
    return {"same_tokens": tokens, "max_logprob_gap": gap if tokens else None}


def task_prompts(task: str, num_prompts: int) -> tuple[list[list[int]], tuple[int, ...]]:
    """The first ``num_prompts`` prompts of built-in task ``task`` and its stop token."""
    from megatron_rl.data.builtin_tasks import builtin_task_spec

    tokenizer, records = builtin_task_spec(task).build(0)
    return [list(r.prompt_ids) for r in records[:num_prompts]], (tokenizer.eos_token_id,)


def run_arms(args, arms: dict[str, InProcessEngineConfig]) -> dict:
    """Per arm: wall and CPU seconds per call, and whether its samples equal the first arm's."""
    if args.checkpoint:
        engines = {n: InProcessEngine.from_pretrained(args.checkpoint, c) for n, c in arms.items()}
    else:
        engines = {name: build_engine(args.preset, config) for name, config in arms.items()}
    prompts, stop = study_prompts(args.prompts), ()
    if args.task:
        prompts, stop = task_prompts(args.task, args.prompts)
    params = SamplingParams(max_new_tokens=args.new_tokens, seed=0, stop_token_ids=stop)
    names = list(arms)
    first: dict[str, list] = {}
    for name in names:  # warm-up, and each arm's samples
        first[name] = timed_call(engines[name], prompts, params, args.n)[2]
    wall: dict[str, list[float]] = {name: [] for name in names}
    cpu: dict[str, list[float]] = {name: [] for name in names}
    for repeat in range(args.repeats):
        for name in names if repeat % 2 == 0 else names[::-1]:
            w, c, _ = timed_call(engines[name], prompts, params, args.n)
            wall[name].append(w)
            cpu[name].append(c)
    tokens = sum(s.response_ids_R.numel() for s in first[names[0]])  # the responses' tokens
    out = {}
    for name in names:
        row = compare_samples(first[names[0]], first[name])
        for clock, times in (("wall", wall), ("cpu", cpu)):
            ms = [1e3 * t for t in times[name]]
            ratios = [a / b for a, b in zip(times[names[0]], times[name], strict=True)]
            row[clock] = {
                "ms_median": statistics.median(ms),
                "ms_min": min(ms),
                "ms_max": max(ms),
                "us_per_token": 1e3 * statistics.median(ms) / tokens,
                "ratio_median": statistics.median(ratios),
                "ratio_min": min(ratios),
                "ratio_max": max(ratios),
            }
        out[name] = row
    return out


def report(title: str, rows: dict) -> None:
    names = list(rows)
    print(f"{title}; ms per call median [min-max], us/token; ratio = {names[0]} / arm")
    for name, row in rows.items():
        line = f"  {name:>12}:"
        for clock in ("cpu", "wall"):
            r = row[clock]
            line += (
                f"  {clock} {r['ms_median']:7.1f} [{r['ms_min']:.1f}-{r['ms_max']:.1f}]"
                f" {r['us_per_token']:5.0f} us/tok"
            )
            if name != names[0]:
                spread = f"{r['ratio_min']:.2f}-{r['ratio_max']:.2f}"
                line += f" ratio {r['ratio_median']:.2f} [{spread}]"
        if name != names[0]:
            line += f"  same tokens: {row['same_tokens']}, log-prob gap {row['max_logprob_gap']}"
        print(line)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--preset", default="tiny", choices=PRESET_NAMES)
    parser.add_argument("--dtype", nargs="+", default=["float32", "bfloat16"])
    parser.add_argument("--prompts", type=int, default=16)
    parser.add_argument("--n", type=int, default=8, help="samples per prompt")
    parser.add_argument("--new-tokens", type=int, default=4)
    parser.add_argument("--repeats", type=int, default=20)
    parser.add_argument("--batch-sizes", type=int, nargs="*", default=[64, 256])
    parser.add_argument("--compare", nargs="+", default=list(COMPARISONS[:3]), choices=COMPARISONS)
    parser.add_argument("--checkpoint", help="engine weights from this folder (HF layout)")
    parser.add_argument("--task", help="a built-in task's prompts and end-of-sequence stop")
    parser.add_argument("--json", help="write the numbers to this file")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    results = {}
    for dtype in args.dtype:
        experts = {
            "old": InProcessEngineConfig(dtype=dtype, experts_implementation="grouped_mm"),
            "new": InProcessEngineConfig(dtype=dtype, experts_implementation="padded_bmm"),
        }
        if "experts" in args.compare:
            results[f"{dtype}/experts"] = run_arms(args, experts)
        if "matmul" in args.compare and dtype != "float32":  # bf16 kernels vs fp32 products
            matmuls = {m: InProcessEngineConfig(dtype=dtype, bf16_matmul=m) for m in MATMULS}
            results[f"{dtype}/matmul"] = run_arms(args, matmuls)
        if args.batch_sizes and "batch" in args.compare:
            sizes = {
                f"batch{size}": InProcessEngineConfig(dtype=dtype, max_batch_size=size)
                for size in args.batch_sizes
            }
            results[f"{dtype}/batch"] = run_arms(args, sizes)
        if "rows" in args.compare:
            rows = {
                arm: InProcessEngineConfig(dtype=dtype, drop_finished_rows=arm == "drop")
                for arm in ("keep", "drop")
            }
            results[f"{dtype}/rows"] = run_arms(args, rows)
    shape = f"{args.preset}, {args.prompts} prompts x {args.n} x {args.new_tokens} tokens"
    for key, rows in results.items():
        report(f"{key} ({shape}, {args.repeats} interleaved repeats, 1 thread)", rows)
    if args.json:
        with open(args.json, "w", encoding="utf-8") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
