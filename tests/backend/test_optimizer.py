"""megatron-core's optimizer on CPU: the path GPUs run (plain and distributed Adam, fp32 and
bf16), non-finite gradients skipped, and shims that stay inside megatron."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.backend.cpu_optimizer import cuda_type_names
from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
from megatron_rl.model import ModelOptions, build_model, causal_lm_logits, preset_config

LAYOUTS = [
    {"distributed": False, "dtype": "float32"},
    {"distributed": True, "dtype": "float32"},
    {"distributed": True, "dtype": "bfloat16"},
]


def _tiny(distributed: bool, dtype: str):
    torch.manual_seed(0)
    config = preset_config("tiny")
    model = wrap_for_training(
        build_model(config, ModelOptions(dtype=dtype)), use_distributed_optimizer=distributed
    )
    optimizer = build_optimizer(
        model, OptimizerConfig(lr=1e-2, clip_grad=1.0, use_distributed_optimizer=distributed)
    )
    return config, model, optimizer


def _backward(model, vocab_size: int, poison: bool = False) -> None:
    tokens = torch.randint(0, vocab_size, (2, 9), generator=torch.Generator().manual_seed(1))
    logits = causal_lm_logits(model, tokens[:, :-1]).float()
    loss = torch.nn.functional.cross_entropy(logits.reshape(-1, vocab_size), tokens[:, 1:].ravel())
    (loss * float("nan") if poison else loss).backward()


def _params(model) -> dict[str, torch.Tensor]:
    return {n: p.detach().clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x['dtype']}_dist{x['distributed']}")
def test_megatron_optimizer_updates_and_skips_a_nan_gradient(ws1, layout):
    config, model, optimizer = _tiny(**layout)
    inner = optimizer.inner.chained_optimizers[0]
    assert type(inner).__name__ == (
        "DistributedOptimizer"
        if layout["distributed"]
        else "FP32Optimizer"
        if layout["dtype"] == "float32"
        else "Float16OptimizerWithFloat16Params"
    )
    before = _params(model)
    optimizer.zero_grad()
    _backward(model, config.vocab_size, poison=True)
    assert optimizer.step() is None  # megatron alone reports (True, nan) and applies it
    after = _params(model)
    assert all(torch.equal(before[n], after[n]) for n in before)
    assert all(torch.isfinite(p).all() for p in after.values())

    optimizer.zero_grad()
    _backward(model, config.vocab_size)
    grad_norm = optimizer.step()
    assert grad_norm is not None and 0 < grad_norm < float("inf")
    moved = _params(model)
    assert any(not torch.equal(before[n], moved[n]) for n in before)


def test_a_model_wrapped_for_one_optimizer_refuses_the_other(ws1):
    model = wrap_for_training(build_model(preset_config("tiny")), use_distributed_optimizer=False)
    with pytest.raises(ValueError, match="use_distributed_optimizer"):
        build_optimizer(model, OptimizerConfig(use_distributed_optimizer=True))


def test_the_cpu_shims_stay_inside_megatron(ws1):
    real_type = torch.Tensor.type
    with cuda_type_names():
        assert torch.zeros(1).type() == "torch.cuda.FloatTensor"
        assert torch.zeros(1, dtype=torch.bfloat16).type() == "torch.cuda.BFloat16Tensor"
        assert torch.zeros(1).type(torch.float64).dtype == torch.float64  # conversions still work
    assert torch.Tensor.type is real_type
    assert torch.zeros(1).type() == "torch.FloatTensor"
    if not torch.cuda.is_available():
        with pytest.raises((RuntimeError, AssertionError)):
            torch.zeros(1, device="cuda")  # the real torch still refuses CUDA here
    from megatron.core.optimizer import clip_grads

    assert clip_grads.torch.zeros(1, device="cuda").device.type == "cpu"  # megatron's view


def test_bad_optimizer_settings_name_the_field():
    with pytest.raises(ValueError, match="lr=inf"):
        OptimizerConfig(lr=float("inf"))
    with pytest.raises(ValueError, match=r"--clip-grad=nan: .*\(OptimizerConfig.clip_grad\)"):
        OptimizerConfig(clip_grad=float("nan"))


def test_cuda_type_names_hold_under_a_default_device():
    """A torch function mode (e.g. ``set_default_device``) must not rename twice."""
    torch.set_default_device("cpu")
    try:
        with cuda_type_names():
            assert torch.ones(1).type() == "torch.cuda.FloatTensor"
    finally:
        torch.set_default_device(None)


@pytest.mark.slow  # two models per layout
@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: f"{x['dtype']}_dist{x['distributed']}")
def test_adams_state_exists_from_construction_and_the_first_update_equals_lazy_adams(ws1, layout):
    """Zero moments at step 0 from construction (the first --colocate offload holds them); a
    twin whose state is dropped, so that Adam creates it in its first step as torch does, makes
    bitwise the same first update."""
    from megatron.core import tensor_parallel

    tensor_parallel.model_parallel_cuda_manual_seed(0)  # megatron's init forks this generator
    config, model, optimizer = _tiny(**layout)
    tensor_parallel.model_parallel_cuda_manual_seed(0)
    _, twin, twin_optimizer = _tiny(**layout)
    adams = optimizer._torch_optimizers
    params = [p for adam in adams for group in adam.param_groups for p in group["params"]]
    states = [
        adam.state[p] for adam in adams for group in adam.param_groups for p in group["params"]
    ]
    assert len(params) > 0 and all({"exp_avg", "exp_avg_sq", "step"} <= set(s) for s in states)
    assert all(not s["exp_avg"].any() and not s["exp_avg_sq"].any() for s in states)
    assert all(float(s["step"]) == 0 for s in states)
    for adam in twin_optimizer._torch_optimizers:
        adam.state.clear()
    for m, o in ((model, optimizer), (twin, twin_optimizer)):
        o.zero_grad()
        _backward(m, config.vocab_size)
    assert optimizer.step() == twin_optimizer.step()
    ours, theirs = _params(model), _params(twin)
    assert all(torch.equal(ours[n], theirs[n]) for n in ours)
    assert all(float(s["step"]) == 1 for s in states)
