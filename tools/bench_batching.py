"""``python tools/bench_batching.py`` is ``megatron-rl bench batching``; the code:
megatron_rl/cli/bench/batching.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.bench.batching import main

if __name__ == "__main__":
    sys.exit(main())
