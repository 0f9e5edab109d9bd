"""``python tools/study_summary.py`` is ``megatron-rl study-summary``; the code:
megatron_rl/cli/study_summary.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.study_summary import main

if __name__ == "__main__":
    sys.exit(main())
