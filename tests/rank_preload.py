"""Imported by the forkserver of `forked_ranks` before it forks any rank: what every rank of a
multi-rank test imports anyway, with megatron's fusions eager and its tensorboard import deferred
as in the CLI and the test processes (tests/conftest.py)."""

from megatron_rl.quiet_imports import defer_megatron_tensorboard, eager_megatron_fusions

eager_megatron_fusions()
defer_megatron_tensorboard()

import megatron.core  # noqa: E402
import megatron.core.parallel_state  # noqa: E402, F401
import torch  # noqa: E402, F401

import megatron_rl.backend  # noqa: E402
import megatron_rl.model  # noqa: E402
import megatron_rl.train.trainer  # noqa: E402, F401
