"""``python tools/bench_losses.py`` is ``megatron-rl bench losses``; the code:
megatron_rl/cli/bench/losses.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.bench.losses import main

if __name__ == "__main__":
    sys.exit(main())
