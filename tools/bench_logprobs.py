"""``python tools/bench_logprobs.py`` is ``megatron-rl bench logprobs``; the code:
megatron_rl/cli/bench/logprobs.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.bench.logprobs import main

if __name__ == "__main__":
    sys.exit(main())
