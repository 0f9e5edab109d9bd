"""Test-suite wide set-up: the multi-rank helpers of tests/model are importable from every test
directory (``from qwen3_moe_testing import spawn_ranks``), and megatron's fused functions stay
eager and tensorboard unimported in test processes as in the CLI (`megatron_rl.quiet_imports`),
and torch runs one intra-op thread in each test process (`make test` runs two workers on two
cores: torch's default of a thread per core in each would have them wait on each other's
threads, as `--torch-threads 1` keeps the CLI runs under test)."""

from __future__ import annotations

import os
import sys

sys.path.insert(0, os.path.join(os.path.dirname(__file__), "model"))
sys.path.append(os.path.dirname(__file__))  # `from real_sglang import servers`


import pytest
import torch

from megatron_rl.quiet_imports import defer_megatron_tensorboard, eager_megatron_fusions

eager_megatron_fusions()
torch.set_num_threads(1)
defer_megatron_tensorboard()  # as the CLI: tensorboard only where a test writes events


@pytest.fixture
def ws1_seed() -> int:
    """Megatron's seed for `ws1`; a test module overrides this fixture to choose another."""
    return 1234


@pytest.fixture
def ws1(tmp_path, ws1_seed):
    """A world-size-1 gloo group with megatron's parallel state (CPU), torn down afterwards."""
    from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed

    init_distributed(
        ParallelConfig(seed=ws1_seed), init_method=f"file://{tmp_path}/rdzv", device="cpu"
    )
    yield
    destroy_distributed()
