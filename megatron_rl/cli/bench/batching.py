"""Padding waste and data-parallel token imbalance: fixed micro-batches vs token balancing.

Pure Python, seconds. Sample lengths follow a long-tailed, DAPO-Math-like distribution: prompt
80-400 tokens (uniform), response lognormal with the given median and 99th percentile, clipped to
``--max-response``; responses of one prompt share a per-prompt difficulty factor (hard prompts
make long answers for all their samples), which is what makes whole-prompt shares uneven.

* Padding: one rank's ``--samples`` samples, as today (``--micro-batch-size`` rows in rollout
  order, padded to the longest row) against ``--max-tokens-per-gpu`` budgets (rows sorted by
  length, fewest micro-batches then least padding). Waste = pad tokens / real tokens; the
  peak is the largest micro-batch in padded tokens (what sets activation memory).
* Imbalance: ``--dp`` ranks, mini-batches of ``--global-batch-size``; today each rank keeps its
  own prompts' samples, balanced each mini-batch is re-split by Karmarkar-Karp (equal counts).
  Imbalance = the busiest rank's tokens / the mean rank's, per mini-batch (the step waits for
  the busiest rank), for real tokens and for padded tokens under a token budget.

    megatron-rl bench batching [--samples 512 --dp 8 --seed 0]
"""

from __future__ import annotations

import argparse
import math
import random
import statistics
import time

from megatron_rl.train.balance import (
    karmarkar_karp,
    padded_tokens,
    padding_waste,
    token_budget_micro_batches,
)

Z99 = 2.3263478740408408  # standard normal 99th percentile


def sample_lengths(args) -> list[int]:
    """Prompt + response lengths, ``n_samples_per_prompt`` consecutive samples per prompt."""
    rng = random.Random(args.seed)
    sigma = (math.log(args.p99) - math.log(args.median)) / Z99
    prompt_sigma = sigma * args.prompt_share**0.5  # the per-prompt share of the log-variance
    sample_sigma = sigma * (1 - args.prompt_share) ** 0.5
    lengths = []
    for _ in range(args.samples // args.n_samples_per_prompt):
        prompt = rng.randint(80, 400)
        difficulty = rng.gauss(0.0, prompt_sigma)
        for _ in range(args.n_samples_per_prompt):
            response = rng.lognormvariate(math.log(args.median) + difficulty, sample_sigma)
            lengths.append(prompt + max(1, min(args.max_response, round(response))))
    return lengths


def _quantile(values: list[int], q: float) -> int:
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


def padding_table(lengths: list[int], args) -> None:
    print(f"\n## padding, one rank, {len(lengths)} samples (seq multiple {args.seq_multiple})")
    print(f"{'micro-batches by':>24} {'count':>6} {'waste':>7} {'padded/real':>12} {'peak':>8}")

    def row(name, groups):
        rows = [[lengths[i] for i in g] for g in groups]
        peak = max(padded_tokens([r], args.seq_multiple) for r in rows)
        waste = padding_waste(rows, args.seq_multiple)
        print(f"{name:>24} {len(rows):>6} {waste:>7.3f} {1 + waste:>12.3f} {peak:>8}")

    order = list(range(len(lengths)))
    for size in args.micro_batch_sizes:
        row(f"{size} rows (today)", [order[i : i + size] for i in range(0, len(order), size)])
    for budget in args.budgets:
        groups = token_budget_micro_batches(lengths, budget, args.seq_multiple)
        row(f"budget {budget} tokens", groups)


def imbalance_table(lengths: list[int], args) -> None:
    dp, mini = args.dp, args.global_batch_size
    print(f"\n## data-parallel imbalance, dp={dp}, {len(lengths) // mini} mini-batches of {mini}")
    print("## busiest rank / mean rank, mean (worst) over mini-batches; balanced: equal sample")
    print("## counts per rank (what --balance-data does); any counts: Karmarkar-Karp unconstrained")
    per_rank = len(lengths) // dp
    # rank r generated samples [r * per_rank, (r + 1) * per_rank); chunk j of each makes step j
    owned = [list(range(r * per_rank, (r + 1) * per_rank)) for r in range(dp)]
    chunk = mini // dp
    today, balanced, free = [], [], []
    for j in range(len(lengths) // mini):
        shares = [mine[j * chunk : (j + 1) * chunk] for mine in owned]
        today.append(shares)
        pool = [i for share in shares for i in share]
        for equal, out in ((True, balanced), (False, free)):
            parts = karmarkar_karp([lengths[i] for i in pool], dp, equal_size=equal)
            # the trainer keeps a balanced share longest first
            out.append(
                [sorted((pool[i] for i in part), key=lambda i: -lengths[i]) for part in parts]
            )

    def ratio(tokens):
        return max(tokens) / statistics.fmean(tokens)

    def real(share):
        return sum(lengths[i] for i in share)

    def padded(budget):
        def cost(share):
            groups = token_budget_micro_batches([lengths[i] for i in share], budget)
            return padded_tokens([[lengths[share[i]] for i in g] for g in groups])

        return cost

    def fixed(size):
        def cost(share):
            rows = [[lengths[i] for i in share[k : k + size]] for k in range(0, len(share), size)]
            return padded_tokens(rows)

        return cost

    print(f"{'tokens counted':>24} {'today':>15} {'balanced':>15} {'any counts':>15}")
    measures = [("real", real)]
    measures += [(f"padded, {s} rows", fixed(s)) for s in args.micro_batch_sizes[-1:]]
    measures += [(f"padded, budget {b}", padded(b)) for b in args.budgets[:1]]
    for name, cost in measures:
        cells = []
        for steps in (today, balanced, free):
            ratios = [ratio([cost(share) for share in shares]) for shares in steps]
            cells.append(f"{statistics.fmean(ratios):.3f} ({max(ratios):.3f})")
        print(f"{name:>24} {cells[0]:>15} {cells[1]:>15} {cells[2]:>15}")


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=512)
    parser.add_argument("--n-samples-per-prompt", type=int, default=16)
    parser.add_argument("--median", type=float, default=1500.0, help="median response tokens")
    parser.add_argument("--p99", type=float, default=16000.0, help="99th percentile response")
    parser.add_argument("--max-response", type=int, default=20480)
    parser.add_argument("--prompt-share", type=float, default=0.35, help="log-variance per prompt")
    parser.add_argument("--micro-batch-sizes", type=int, nargs="+", default=[1, 2, 4, 8])
    parser.add_argument("--budgets", type=int, nargs="+", default=[24576, 49152, 98304])
    parser.add_argument("--seq-multiple", type=int, default=1)
    parser.add_argument("--dp", type=int, default=8)
    parser.add_argument("--global-batch-size", type=int, default=128)
    parser.add_argument("--seed", type=int, default=0)
    args = parser.parse_args(argv)
    start = time.perf_counter()
    lengths = sample_lengths(args)
    print(  # rows: prompt + response (the trainer pads whole rows)
        f"# {len(lengths)} samples, row tokens: median {_quantile(lengths, 0.5)}, "
        f"p90 {_quantile(lengths, 0.9)}, p99 {_quantile(lengths, 0.99)}, "
        f"max {max(lengths)}, total {sum(lengths)}"
    )
    padding_table(lengths, args)
    imbalance_table(lengths, args)
    print(f"\n# {time.perf_counter() - start:.2f} s")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
