"""``python tools/bench_routing.py`` is ``megatron-rl bench routing``; the code:
megatron_rl/cli/bench/routing.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.bench.routing import main

if __name__ == "__main__":
    sys.exit(main())
