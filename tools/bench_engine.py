"""``python tools/bench_engine.py`` is ``megatron-rl bench engine``; the code:
megatron_rl/cli/bench/engine.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.bench.engine import main

if __name__ == "__main__":
    sys.exit(main())
