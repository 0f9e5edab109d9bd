"""``python tools/bench_model.py`` is ``megatron-rl bench model``; the code:
megatron_rl/cli/bench/model.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.bench.model import main

if __name__ == "__main__":
    sys.exit(main())
