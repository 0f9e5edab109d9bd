"""Imported by the forkserver of `forked_ranks` before it forks any rank: what the ranks of the
multi-rank tests import anyway, so that a forked rank imports next to nothing of its own.

A rank unpickles its test's worker function, which imports the test's module and that module's
helpers (`qwen3_moe_testing` and `glm4_moe_testing` with transformers' model classes, pytest,
the in-process engine, megatron's checkpointing): ~2-3 CPU-s of imports a rank without them.
megatron's fusions stay eager and its tensorboard import deferred as in the CLI and the test
processes (tests/conftest.py).
"""

import importlib

from megatron_rl.quiet_imports import defer_megatron_tensorboard, eager_megatron_fusions

MODULES = (
    "torch",
    "torch.distributed.checkpoint",
    "megatron.core",
    "megatron.core.parallel_state",
    "megatron.core.dist_checkpointing",
    "pytest",
    "megatron_rl.backend",
    "megatron_rl.model",
    "megatron_rl.rollout.inprocess",
    "megatron_rl.train.trainer",
    # the test helpers (tests/model is on the server's path) and the model classes they build
    "qwen3_moe_testing",
    "glm4_moe_testing",
    "transformers.models.deepseek_v3.modeling_deepseek_v3",
)

eager_megatron_fusions()
defer_megatron_tensorboard()
for name in MODULES:
    importlib.import_module(name)
