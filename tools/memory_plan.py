"""``python tools/memory_plan.py`` is ``megatron-rl plan``; the code:
megatron_rl/cli/plan.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.plan import main

if __name__ == "__main__":
    sys.exit(main())
