"""``python -m megatron_rl.train [flags]``: see ``--help`` and ``megatron_rl/train/config.py``.

Flags are parsed and validated before megatron-core, transformers or a model are imported, so
``--help`` and flag errors answer at once.
"""

from __future__ import annotations

import logging
import sys

from megatron_rl.quiet_imports import quiet_third_party_warnings
from megatron_rl.train.config import parse_args


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # without a terminal (CI, log files) the progress bar becomes one INFO line per step
    logging.getLogger("megatron_rl.train.run_logger").setLevel(logging.INFO)
    try:
        config = parse_args(argv)
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)  # noqa: T201 (the CLI's own error channel)
        return 2
    quiet_third_party_warnings()
    from megatron_rl.train.run import TrainingStopped, resolve_load, run

    try:
        resolve_load(config)  # checked before megatron builds anything
    except ValueError as err:
        print(f"error: {err}", file=sys.stderr)  # noqa: T201
        return 2
    try:
        run(config)
    except TrainingStopped as err:
        print(f"stopped: {err}", file=sys.stderr)  # noqa: T201
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
