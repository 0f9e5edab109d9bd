"""``python tools/convert_checkpoint.py`` is ``megatron-rl convert``; the code:
megatron_rl/cli/convert.py (this shim keeps the old entry point)."""

import sys

from megatron_rl.cli.convert import main

if __name__ == "__main__":
    sys.exit(main())
