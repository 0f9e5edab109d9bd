"""The plan's peak timeline against the H200's measured peaks of the GPU smoke's slice, the
optimizer step's phases, and the validation of layouts and options."""

from __future__ import annotations

import json

import pytest
from memory_plan_testing import load_tool, make_layout

from megatron_rl.backend.grad_check import GRAD_CHECK_CHUNK_ELEMENTS
from megatron_rl.memory_plan import (
    GIB,
    PHASE_ADAM,
    PHASE_BACKWARD,
    PHASE_FORWARD,
    PHASE_GRAD_CHECK,
    PHASE_LOGPROBS,
    PlanOptions,
    load_model_config,
    plan_memory,
)

# The H200's steady-state peaks (GiB, torch.cuda.max_memory_allocated of the second update, Adam's
# moments allocated) of the Qwen3-30B-A3B-shaped 2-layer slice that tools/gpu_smoke.py (d) runs:
# one GPU, bf16, local spec, distributed optimizer, no recompute, one sequence of 4,096 / 8,192
# tokens. From the H200 smoke run (docs/cluster-launch.md; torch 2.11 + CUDA 13, megatron-core
# 0.16.1). The plan said
# 43.6 / 59.2 before the attention term and the timeline (issue 22).
H200_SLICE_PEAK_GIB = {4096: 44.6, 8192: 81.4}


def _slice_plan(tokens: int):
    config = load_model_config("qwen3-30b-a3b", num_hidden_layers=2)
    options = PlanOptions(
        params_dtype="bfloat16",
        distributed_optimizer=True,
        recompute="none",
        micro_batch_tokens=tokens,
        reserve_gib=0.0,
        spec="local",
        grad_check_chunk_elements=None,  # the H200 run's trainer checked whole buffers
    )
    return plan_memory(config, make_layout(1), options, gpu_gib=141)


@pytest.mark.parametrize("tokens", sorted(H200_SLICE_PEAK_GIB))
def test_slice_plan_predicts_the_h200_steady_state_peak(tokens):
    measured = H200_SLICE_PEAK_GIB[tokens]
    plan = _slice_plan(tokens)
    predicted = plan.total_bytes / GIB
    assert abs(predicted / measured - 1) < 0.05, (predicted, measured)
    stage = plan.peak
    # the peak is the static terms + one phase; the logits die before the layers' backward
    phases = {phase.name: phase for phase in stage.phases}
    assert "logits" in {term.name for term in phases[PHASE_LOGPROBS].terms}
    assert "logits" not in {term.name for term in phases[PHASE_BACKWARD].terms}
    assert stage.gpu_bytes == sum(t.nbytes for t in stage.static) + stage.peak_phase.nbytes
    assert stage.peak_phase.nbytes == max(phase.nbytes for phase in stage.phases)
    if tokens == 8192:  # the [heads, s, s] matrices decide
        assert stage.peak_phase.name in (PHASE_FORWARD, PHASE_BACKWARD)
    print(tokens, f"plan {predicted:.2f} GiB at {stage.peak_phase.name}; H200 {measured} GiB")


def test_cli_reproduces_the_slice(capsys):
    tool = load_tool()
    argv = ["--model", "qwen3-30b-a3b", "--num-layers", "2", "--spec", "local"]
    argv += ["--recompute", "none", "--reserve-gib", "0", "--gpu-gib", "141"]
    assert tool.main([*argv, "--micro-batch-tokens", "8192", "--json"]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["total_bytes"] == _slice_plan(8192).total_bytes
    assert plan["peak_phase"] == PHASE_BACKWARD and plan["attention"]["spec"] == "local"
    assert tool.main([*argv, "--micro-batch-tokens", "4096"]) == 0
    out = capsys.readouterr().out
    for expected in ("attention (local, unfused)", "<- peak", "FITS in 141 GiB", "needed at"):
        assert expected in out, expected


def test_step_phases_gradient_check_and_adam():
    """The trainer's isfinite over a whole fp32 grad buffer holds |x| and three bool tensors of
    its size (7 B per element); torch's AdamW (local spec) a fp32 sqrt(v) per optimizer element."""
    config = load_model_config("qwen3-30b-a3b")
    layout = make_layout(16, tensor_parallel=2, expert_parallel=8)
    whole = PlanOptions(micro_batch_tokens=4096, grad_check_chunk_elements=None)
    stage = plan_memory(config, layout, whole).stages[0]
    check = {phase.name: phase for phase in stage.phases}[PHASE_GRAD_CHECK]
    assert check.nbytes == 7 * 3_623_878_656  # the expert buffer, the larger of the two
    assert PHASE_ADAM not in {phase.name for phase in stage.phases}  # TE's FusedAdam
    stage = plan_memory(config, layout, PlanOptions(micro_batch_tokens=4096)).stages[0]
    chunk = GRAD_CHECK_CHUNK_ELEMENTS  # the trainer's chunk (backend/grad_check.py)
    assert {phase.name: phase for phase in stage.phases}[PHASE_GRAD_CHECK].nbytes == 7 * chunk
    local = plan_memory(config, layout, PlanOptions(micro_batch_tokens=4096, spec="local"))
    adam = {phase.name: phase for phase in local.stages[0].phases}[PHASE_ADAM]
    elements = 776_943_616 // 8 + 3_623_878_656 // 2  # the shards of the dense and expert buffers
    assert adam.nbytes == 4 * elements


@pytest.mark.parametrize(
    ("sizes", "message"),
    [
        (
            {"tensor_parallel": 3},
            "num_attention_heads=32 is not divisible by tensor parallel size 3",
        ),
        (
            {"tensor_parallel": 8},
            "num_key_value_heads=4 is not divisible by tensor parallel size 8",
        ),
        ({"expert_parallel": 3}, "num_experts=128 is not divisible by expert parallel size 3"),
        ({"pipeline_parallel": 5}, "not divisible by pipeline parallel size 5"),
        ({"expert_parallel": 16}, "not divisible by expert-tensor"),
    ],
)
def test_invalid_layouts_raise(sizes, message):
    config = load_model_config("qwen3-30b-a3b")
    world = 8 * sizes.get("tensor_parallel", 1) * sizes.get("pipeline_parallel", 1)
    with pytest.raises(ValueError, match=message):
        plan_memory(config, make_layout(world, **sizes))


def test_invalid_options_raise():
    with pytest.raises(ValueError, match="routing replay needs"):
        PlanOptions(routing_replay="r2")
    with pytest.raises(ValueError, match="recompute"):
        PlanOptions(recompute="selective")
    with pytest.raises(ValueError, match="world size 12"):
        make_layout(12, tensor_parallel=8)
