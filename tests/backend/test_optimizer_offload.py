"""``--optimizer-cpu-offload``: the flag reaches megatron-core's optimizer config and builds its
HybridDeviceOptimizer inside the distributed optimizer.

A CPU step cannot run: megatron's hybrid optimizer copies CUDA parameters to host memory and
maps them back, and on CPU there is nothing to map (its first ``step`` fails). These tests check
the mapping and the construction; the update itself needs a GPU. megatron's config also asks
Transformer Engine's version for the precision-aware path it offloads through; TE is not
installed here, so the tests stand in a recent version.
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.backend.optimizer import (
    OptimizerConfig,
    build_optimizer,
    megatron_optimizer_config,
    wrap_for_training,
)
from megatron_rl.model import ModelOptions, build_model, preset_config
from megatron_rl.train.config import parse_args

OFFLOAD = ["--use-distributed-optimizer", "--optimizer-cpu-offload"]


@pytest.fixture
def te_version(monkeypatch):
    import megatron.core.optimizer.optimizer_config as megatron_optimizer_config_module

    monkeypatch.setattr(
        megatron_optimizer_config_module, "is_te_min_version", lambda *_a, **_k: True
    )


def _model(dtype: str = "bfloat16"):
    torch.manual_seed(0)
    return wrap_for_training(
        build_model(preset_config("tiny"), ModelOptions(dtype=dtype)),
        use_distributed_optimizer=True,
    )


def test_the_flags_reach_the_optimizer_config():
    config = parse_args([*OFFLOAD, "--optimizer-offload-fraction", "0.25"]).optimizer
    assert config.cpu_offload and config.offload_fraction == 0.25
    assert config.use_distributed_optimizer
    default = parse_args(OFFLOAD).optimizer
    assert default.cpu_offload and default.offload_fraction == 1.0
    assert not parse_args([]).optimizer.cpu_offload


@pytest.mark.parametrize(
    ("argv", "match"),
    [
        (["--optimizer-cpu-offload"], "needs --use-distributed-optimizer"),
        ([*OFFLOAD, "--optimizer-offload-fraction", "1.5"], "must be in"),
    ],
)
def test_bad_offload_flags_name_the_flag(argv, match):
    with pytest.raises(ValueError, match=match):
        parse_args(argv)
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        OptimizerConfig(cpu_offload=True, use_distributed_optimizer=False)


def test_megatron_builds_its_hybrid_device_optimizer_from_the_flag(ws1, te_version):
    from megatron.core.optimizer import get_megatron_optimizer
    from megatron.core.optimizer.cpu_offloading import HybridDeviceOptimizer

    from megatron_rl.backend.optimizer import PolicyOptimizer

    model = _model()
    ours = parse_args([*OFFLOAD, "--optimizer-offload-fraction", "0.5"]).optimizer
    megatron = megatron_optimizer_config(ours, model.config)
    assert megatron.optimizer_cpu_offload and megatron.optimizer_offload_fraction == 0.5
    assert megatron.use_precision_aware_optimizer and megatron.use_distributed_optimizer
    assert megatron.decoupled_weight_decay  # megatron's offload asserts AdamW mode
    assert (
        megatron.main_params_dtype == torch.float32 and megatron.main_grads_dtype == torch.float32
    )
    with PolicyOptimizer._megatron_calls():
        built = get_megatron_optimizer(megatron, [model])
    inner = built.chained_optimizers[0]
    assert type(inner).__name__ == "DistributedOptimizer"
    assert isinstance(inner.optimizer, HybridDeviceOptimizer)
    assert inner.optimizer.offload_fraction == 0.5

    plain = megatron_optimizer_config(OptimizerConfig(), model.config)
    assert not plain.optimizer_cpu_offload and not plain.use_precision_aware_optimizer
    assert plain.optimizer_offload_fraction == 0.0


def test_offload_on_the_cpu_backend_is_refused_by_name(ws1):
    with pytest.raises(ValueError, match="--optimizer-cpu-offload needs CUDA"):
        build_optimizer(_model("float32"), OptimizerConfig(cpu_offload=True))


def test_a_zero_offload_share_offloads_nothing_and_runs_on_the_cpu_backend(ws1):
    """``--optimizer-cpu-offload --optimizer-offload-fraction 0`` (a launcher that always passes
    the flag, run with ``OPTIMIZER_OFFLOAD_FRACTION=0``) is the plain optimizer: megatron gets
    no offload, and the CPU backend builds it."""
    config = OptimizerConfig(cpu_offload=True, offload_fraction=0.0, use_distributed_optimizer=True)
    assert not config.offloads
    model = _model("float32")
    megatron = megatron_optimizer_config(config, model.config)
    assert not megatron.optimizer_cpu_offload and not megatron.use_precision_aware_optimizer
    assert megatron.optimizer_offload_fraction == 0.0
    build_optimizer(model, OptimizerConfig(cpu_offload=True, offload_fraction=0.0))
