"""``python -m megatron_rl.train [flags]``: see ``--help`` and ``megatron_rl/train/config.py``.

Flags are parsed and validated before megatron-core, transformers or a model are imported, so
``--help`` and flag errors answer at once. Then ``--load`` is resolved and the task (prompt data,
tokenizer, prompt lengths, reward function) is built (`megatron_rl.train.task.build_task`)
before the model is; the run gets both, so neither is done twice. The run's first act on rank 0
is to check and lock ``--save`` and ``--run-dir`` (`megatron_rl.train.run_lock`). Each of these
errors is one line, ``error: ...`` on stderr, exit status 2; set the environment variable
``MEGATRON_RL_DEBUG=1`` to get the full traceback as well.
"""

from __future__ import annotations

import logging
import os
import sys
import traceback

from megatron_rl.quiet_imports import (
    defer_megatron_tensorboard,
    eager_megatron_fusions,
    quiet_third_party_warnings,
)
from megatron_rl.train.config import parse_args

DEBUG_ENV = "MEGATRON_RL_DEBUG"
"""Set to 1 (or anything but "", "0") to print the traceback of a start-up error too."""


def _start_up_error(err: Exception) -> int:
    if os.environ.get(DEBUG_ENV, "") not in ("", "0"):
        traceback.print_exception(err, file=sys.stderr)
    message = " ".join(str(err).split()) or type(err).__name__  # one line
    print(f"error: {message}", file=sys.stderr)  # noqa: T201 (the CLI's own error channel)
    return 2


def main(argv: list[str] | None = None) -> int:
    logging.basicConfig(level=logging.WARNING, format="%(levelname)s %(name)s: %(message)s")
    # without a terminal (CI, log files) the progress bar becomes one INFO line per step
    logging.getLogger("megatron_rl.train.run_logger").setLevel(logging.INFO)
    # the wait for the SGLang servers says what it waits for from its first progress line
    logging.getLogger("megatron_rl.rollout.sglang_client").setLevel(logging.INFO)
    # so does a rank's wait for its peers (the rendezvous), and its end
    logging.getLogger("megatron_rl.backend.distributed").setLevel(logging.INFO)
    try:
        config = parse_args(argv)
    except ValueError as err:
        return _start_up_error(err)
    quiet_third_party_warnings()
    eager_megatron_fusions()  # before megatron is imported: see megatron_rl.quiet_imports
    defer_megatron_tensorboard()  # tensorboard only with --tensorboard-dir (same module)
    from megatron_rl.train.checkpoint.folders import CheckpointDamaged
    from megatron_rl.train.run import TrainingStopped, resolve_load, run
    from megatron_rl.train.run_lock import RunFolderError
    from megatron_rl.train.task import build_task

    try:
        load = resolve_load(config)  # checked before megatron builds anything
        task = build_task(config.task, config.eval)  # data, held-out sets, reward: before the model
    except ValueError as err:  # UnicodeDecodeError included
        return _start_up_error(err)
    try:
        run(config, task=task, load=load)
    except RunFolderError as err:  # raised by rank 0 before the model is built
        return _start_up_error(err)
    except CheckpointDamaged as err:  # a flipped byte is found only when the shards are read
        return _start_up_error(err)
    except TrainingStopped as err:
        print(f"stopped: {err}", file=sys.stderr)  # noqa: T201
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
