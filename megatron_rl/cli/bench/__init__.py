"""``megatron-rl bench <name> [options]``: the benchmarks, one module each (imported when run).

Each measures against a baseline in the same session (paired, interleaved repeats) and prints
its table; docs/performance.md gives the numbers they measured. The benchmarks that need the
SGLang stand-in of the tests (`megatron_rl.testing`: rollout, weight sync, async rollouts) stay
in a checkout's ``tools/`` (``python tools/bench_rollout.py`` and the like).
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from megatron_rl.cli.dispatch import Command, dispatch

PROG = "megatron-rl bench"
DESCRIPTION = "Benchmarks, each against a baseline measured in the same session."

# the explicit allowlist of benchmarks, in the order `--help` lists them
BENCHES = {
    "step": Command(
        module="megatron_rl.cli.bench.step",
        summary="the embedded RL step's cost, paired against a baseline run at the same time",
    ),
    "losses": Command(
        module="megatron_rl.cli.bench.losses",
        summary="forward + backward time of every registered loss relative to GRPO",
    ),
    "engine": Command(
        module="megatron_rl.cli.bench.engine",
        summary="the in-process engine: expert kernels, bf16 products, batch sizes, rows",
    ),
    "model": Command(
        module="megatron_rl.cli.bench.model",
        summary="the megatron model's fwd+bwd tokens/s and HF export throughput",
    ),
    "optimizer": Command(
        module="megatron_rl.cli.bench.optimizer",
        summary="one optimizer step: megatron's per-tensor path against the buffer-level one",
    ),
    "logprobs": Command(
        module="megatron_rl.cli.bench.logprobs",
        summary="token log-probs and entropy: peak memory and time, chunked against the old code",
    ),
    "routing": Command(
        module="megatron_rl.cli.bench.routing",
        summary="routing replay: codec throughput, step-time overhead, R3 routing memory",
    ),
    "codecs": Command(
        module="megatron_rl.cli.bench.codecs",
        summary="routing-codec throughput against minimal numpy baselines",
    ),
    "pipeline": Command(
        module="megatron_rl.cli.bench.pipeline",
        summary="the pipeline bubble: time per update at PP 2, plain 1F1B against VP 2",
    ),
    "batching": Command(
        module="megatron_rl.cli.bench.batching",
        summary="padding waste and data-parallel imbalance: micro-batches against token budgets",
    ),
}


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    return dispatch(PROG, DESCRIPTION, BENCHES, argv)
