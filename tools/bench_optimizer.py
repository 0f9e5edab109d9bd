"""``python tools/bench_optimizer.py`` is ``megatron-rl bench optimizer``; the code:
megatron_rl/cli/bench/optimizer.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.bench.optimizer import main

if __name__ == "__main__":
    sys.exit(main())
