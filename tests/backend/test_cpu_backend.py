"""The CPU backend redirects megatron-core only, is idempotent, and its RNG tracker forks."""

from __future__ import annotations

import sys

import pytest
import torch

from megatron_rl.backend import (
    ParallelConfig,
    activate_cpu_backend,
    cpu_backend_active,
    cuda_available,
    destroy_distributed,
    init_distributed,
    select_device,
)
from megatron_rl.backend.norm import SequenceParallelTorchNorm


def test_activation_is_idempotent_and_confined_to_megatron():
    assert activate_cpu_backend(force=True) and activate_cpu_backend(force=True)
    assert cpu_backend_active() and not cuda_available()
    layers = sys.modules["megatron.core.tensor_parallel.layers"]
    assert layers.torch.cuda.current_device() == torch.device("cpu")
    with layers.torch.cuda.stream(layers.torch.cuda.Stream()):
        layers.torch.cuda.synchronize()
    # torch itself (and so transformers, the losses, ...) still sees the real torch.cuda.
    assert layers.torch is not torch and sys.modules["torch"] is torch
    assert torch.cuda.Stream.__module__.startswith("torch.cuda")
    if not torch.cuda.is_available():
        with pytest.raises((AssertionError, RuntimeError)):
            torch.cuda.current_device()


def test_rng_tracker_forks_cpu_generator_and_restores_it(tmp_path):
    from megatron.core.tensor_parallel import get_cuda_rng_tracker

    init_distributed(ParallelConfig(seed=3), init_method=f"file://{tmp_path}/rdzv", device="cpu")
    try:
        tracker = get_cuda_rng_tracker()
        outer = torch.get_rng_state()
        with tracker.fork():
            first = torch.rand(4)
        assert torch.equal(torch.get_rng_state(), outer), "fork did not restore the CPU state"
        with tracker.fork():
            second = torch.rand(4)
        assert not torch.equal(first, second), "the tracked stream did not advance"
        with tracker.fork("expert-parallel-rng"):
            expert = torch.rand(4)
        assert not torch.equal(expert, first)
    finally:
        destroy_distributed()


def test_parallel_config_names_bad_fields():
    with pytest.raises(ValueError, match=r"=0: .* \(ParallelConfig.tensor_parallel\)"):
        ParallelConfig(tensor_parallel=0)
    with pytest.raises(ValueError, match="sequence_parallel"):
        ParallelConfig(sequence_parallel=True)
    assert ParallelConfig(tensor_parallel=2).sequence_parallel is True
    with pytest.raises(ValueError, match="not divisible"):
        ParallelConfig(expert_parallel=2).check_world_size(3)


def test_select_device_validates_its_argument():
    with pytest.raises(ValueError, match="choose one of"):
        select_device("tpu")
    assert select_device("cpu") == torch.device("cpu")


def test_sequence_parallel_norm_marks_weights_for_tp_grad_reduction():
    from megatron.core.transformer import TransformerConfig

    config = TransformerConfig(
        num_layers=1,
        hidden_size=8,
        num_attention_heads=2,
        normalization="RMSNorm",
        tensor_model_parallel_size=2,
        sequence_parallel=True,
    )
    norm = SequenceParallelTorchNorm(config, 8, eps=1e-6)
    assert isinstance(norm, torch.nn.RMSNorm) and norm.weight.sequence_parallel is True
    x = torch.randn(3, 8)
    torch.testing.assert_close(norm(x), x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6))
