"""``python tools/bench_codecs.py`` is ``megatron-rl bench codecs``; the code:
megatron_rl/cli/bench/codecs.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.bench.codecs import main

if __name__ == "__main__":
    sys.exit(main())
