"""``python tools/bench_step.py`` is ``megatron-rl bench step``; the code:
megatron_rl/cli/bench/step.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.bench.step import main

if __name__ == "__main__":
    sys.exit(main())
