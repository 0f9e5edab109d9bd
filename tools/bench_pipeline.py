"""``python tools/bench_pipeline.py`` is ``megatron-rl bench pipeline``; the code:
megatron_rl/cli/bench/pipeline.py (a shim, as for the other benchmarks)."""

import sys

from megatron_rl.cli.bench.pipeline import main

if __name__ == "__main__":
    sys.exit(main())
