"""`foreach_adam`: torch's foreach AdamW for megatron's Adam on CPU, bitwise its per-tensor loop,
or its fused kernel (the trainer's default) within 1e-7; only for the step (the optimizer's state
dict keeps its own groups)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from checkpoint_tensors import checkpoint_tensors
from megatron.core import tensor_parallel

from megatron_rl.backend.cpu_optimizer import foreach_adam
from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
from megatron_rl.model import ModelOptions, build_model, preset_config

ROOT = Path(__file__).resolve().parents[2]


def _adamw(seed: int) -> tuple[list[torch.nn.Parameter], torch.optim.AdamW]:
    generator = torch.Generator().manual_seed(seed)
    shapes = [(64, 512), (256, 64), (64,), (16,), (8, 64), (3,)]
    params = [torch.nn.Parameter(torch.randn(s, generator=generator)) for s in shapes]
    groups = [
        {"params": params[:2], "weight_decay": 0.1},
        {"params": params[2:], "weight_decay": 0.0},
    ]
    return params, torch.optim.AdamW(groups, lr=1e-2, betas=(0.9, 0.95), eps=1e-8)


def _five_steps(fused: bool):
    """(loop params, loop AdamW, params, AdamW stepped under `foreach_adam`), 5 equal steps."""
    loop_params, loop = _adamw(0)
    params, optimizer = _adamw(0)
    generator = torch.Generator().manual_seed(1)
    for step in range(5):
        for a, b in zip(loop_params, params, strict=True):
            a.grad = torch.randn(a.shape, generator=generator) * 10.0 ** (step - 2)
            b.grad = a.grad.clone()
        loop.step()
        with foreach_adam([optimizer], fused=fused):
            optimizer.step()
    return loop_params, loop, params, optimizer


def test_foreach_adamw_updates_bitwise_like_the_per_tensor_loop():
    loop_params, loop, foreach_params, foreach = _five_steps(fused=False)
    for a, b in zip(loop_params, foreach_params, strict=True):
        assert torch.equal(a, b)
        assert torch.equal(loop.state[a]["exp_avg_sq"], foreach.state[b]["exp_avg_sq"])


def test_fused_adamw_is_within_1e_6_of_the_largest_parameter_but_not_bitwise():
    """What the default (``--cpu-adam fused``) costs in exactness against megatron's loop."""
    loop_params, _, fused_params, fused = _five_steps(fused=True)
    assert all(group["fused"] is None for group in fused.param_groups)
    with torch.no_grad():
        worst = max(
            float((a - b).abs().max() / a.abs().max())
            for a, b in zip(loop_params, fused_params, strict=True)
        )
    assert worst < 1e-6  # measured 6.8e-8 (AVX-512); 0 with torch's AVX2 kernels


def test_foreach_is_set_only_inside_the_block_and_only_where_torch_chooses():
    _, optimizer = _adamw(0)
    optimizer.param_groups[1]["foreach"] = False  # a group's own choice is kept
    seen = []
    with foreach_adam([optimizer, torch.optim.SGD([torch.nn.Parameter(torch.zeros(1))])]):
        seen = [group["foreach"] for group in optimizer.param_groups]
    assert seen == [True, False]
    assert [group["foreach"] for group in optimizer.param_groups] == [None, False]
    with pytest.raises(KeyError), foreach_adam([optimizer]):
        raise KeyError("restored on the way out")
    assert optimizer.param_groups[0]["foreach"] is None


@pytest.mark.parametrize("distributed", [False, True])
def test_the_policy_optimizers_state_dict_keeps_megatrons_groups(ws1, distributed):
    torch.manual_seed(0)
    model = wrap_for_training(
        build_model(preset_config("tiny"), ModelOptions(dtype="bfloat16")),
        use_distributed_optimizer=distributed,
    )
    optimizer = build_optimizer(
        model, OptimizerConfig(lr=1e-3, use_distributed_optimizer=distributed)
    )
    optimizer.zero_grad()
    for buffer in model.buffers + model.expert_parallel_buffers:
        buffer.grad_data.fill_(1e-3)
    assert optimizer.config.cpu_adam == "fused"  # the default
    assert optimizer.step() is not None
    assert all(g["foreach"] is None and g["fused"] is None for g in optimizer.param_groups)
    inner = optimizer.state_dict()
    groups = inner["optimizer"]["param_groups"] if "optimizer" in inner else inner["param_groups"]
    assert groups and all(g["foreach"] is None and g["fused"] is None for g in groups)


@pytest.mark.parametrize("distributed", [False, True])
def test_the_default_fused_step_stays_within_1e_6_of_the_bitwise_foreach_one(ws1, distributed):
    """Five `PolicyOptimizer` steps on the same gradients: fused (default) against foreach."""
    runs = {}
    for kernel in ("fused", "foreach"):
        torch.manual_seed(0)
        tensor_parallel.model_parallel_cuda_manual_seed(0)  # megatron's init forks this one
        model = wrap_for_training(
            build_model(preset_config("tiny"), ModelOptions(dtype="float32")),
            use_distributed_optimizer=distributed,
        )
        config = OptimizerConfig(lr=1e-2, use_distributed_optimizer=distributed, cpu_adam=kernel)
        optimizer = build_optimizer(model, config)
        generator = torch.Generator().manual_seed(1)
        for _ in range(5):
            optimizer.zero_grad()
            for buffer in model.buffers + model.expert_parallel_buffers:
                buffer.grad_data.copy_(torch.randn(buffer.grad_data.shape, generator=generator))
            assert optimizer.step() is not None
        runs[kernel] = [p.detach().clone() for p in model.parameters()]
    with torch.no_grad():
        worst = max(
            float((a - b).abs().max() / b.abs().max())
            for a, b in zip(runs["fused"], runs["foreach"], strict=True)
        )
    assert worst < 1e-6  # 0 with torch's AVX2 kernels, where fused is bitwise foreach


def test_the_cpu_adam_kernel_is_validated():
    with pytest.raises(ValueError, match="--cpu-adam"):
        OptimizerConfig(cpu_adam="apex")


@pytest.mark.slow
@pytest.mark.hardware_sensitive
def test_the_fused_default_trains_what_foreach_trains_on_the_same_batches(tmp_path):
    """The main job through the real CLI for 2 steps (4 Adam updates) with each kernel, the
    foreach run replaying the fused run's batches (``--load-rollouts``): both steps' grad norm and
    entropy within 1e-5, the loss within 1e-6, every weight within 2% of one Adam step and every
    Adam moment within 1e-3 of its largest element (measured: 1.2e-7 and 5e-9, grad norms 1e-7).

    What differs is the optimizer kernel alone, so the numbers are compared, never what sampling
    makes of them: two runs that differ in the last bits of the weights may sample otherwise
    after a few steps, and where depends on the CPU's kernels (an Intel Xeon parted at step 6 of
    10, an AMD EPYC did not). Even on the same batches the two trajectories part after a few
    steps (measured: grad norm 2e-4 apart at step 4, 6% at step 9, as Adam's m / sqrt(v) and the
    clip's edges amplify last-bit differences), so the comparison stops at step 2."""
    runs = {}
    for kernel, dump in (("fused", "--save-rollouts"), ("foreach", "--load-rollouts")):
        command = [
            sys.executable, "-m", "megatron_rl.train", "--train-iters", "2", "--seed", "1234",
            "--cpu-adam", kernel, dump, str(tmp_path / "rollouts"), "--run-dir",
            str(tmp_path / kernel), "--no-progress", "--torch-threads", "1", "--save",
            str(tmp_path / f"{kernel}-ckpt"), "--ckpt-format", "torch_dist",
        ]  # fmt: skip
        env = {**os.environ, "OMP_NUM_THREADS": "1", "WANDB_MODE": "disabled"}
        result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, env=env)
        assert result.returncode == 0, result.stderr[-3000:]
        rows = [json.loads(line) for line in (tmp_path / kernel / "metrics.jsonl").open()]
        tensors = checkpoint_tensors(
            tmp_path / f"{kernel}-ckpt" / "step_00000002", tmp_path / kernel
        )
        runs[kernel] = (rows, tensors)
    (fused_rows, fused), (foreach_rows, foreach) = runs["fused"], runs["foreach"]
    assert [r["step"] for r in fused_rows] == [r["step"] for r in foreach_rows] == [1, 2]
    for mine, theirs in zip(fused_rows, foreach_rows, strict=True):
        assert mine["reward/mean"] == theirs["reward/mean"]  # the replayed batch
        for key, rel, tol in (
            ("grad_norm", 1e-5, 0),
            ("entropy", 1e-5, 0),
            ("policy/loss", 0, 1e-6),
        ):
            assert mine[key] == pytest.approx(theirs[key], rel=rel, abs=tol), (mine["step"], key)
    assert set(fused) == set(foreach) and any("experts" in k for k in fused)
    lr = 3e-3  # the main job's; one Adam step moves a weight by about this much
    for key, want in foreach.items():
        diff = float((fused[key] - want).abs().max())
        if key.startswith("optimizer."):  # Adam's moments: relative to their largest element
            assert diff <= 1e-3 * float(want.abs().max()), (key, diff)
        else:  # a wrong update moves whole rows by ~lr
            assert diff <= 0.02 * lr, (key, diff)
