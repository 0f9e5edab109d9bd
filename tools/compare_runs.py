"""``python tools/compare_runs.py`` is ``megatron-rl study``; the code:
megatron_rl/cli/study.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.study import main

if __name__ == "__main__":
    sys.exit(main())
