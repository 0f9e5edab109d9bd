"""Shared by the memory plan's tests: Qwen3-30B-A3B's sizes for hand counts, a layout of
parallel sizes, the tiny model in megatron DDP, and the planner command (``megatron-rl plan``,
megatron_rl/cli/plan.py; ``tools/memory_plan.py`` calls the same ``main``)."""

from __future__ import annotations

import importlib
import inspect
from pathlib import Path

from megatron_rl.memory_plan import Layout
from megatron_rl.parallel import ParallelConfig

ROOT = Path(__file__).resolve().parents[2]

# Qwen3-30B-A3B, for the hand counts below
H, V, D, E, F_MOE = 2048, 151936, 128, 128, 768
ATTN = (32 + 2 * 4) * D * H + 32 * D * H  # linear_qkv + linear_proj = 18,874,368
NORMS = 2 * H + 2 * D  # input / pre-MLP RMSNorm + q / k RMSNorm
ROUTER = E * H
EXPERT = 3 * F_MOE * H  # fc1 (gate + up) + fc2 = 4,718,592


def make_layout(world_size: int | None = None, **sizes) -> Layout:
    parallel = ParallelConfig(**sizes)
    if world_size is None:
        return Layout(parallel=parallel)
    return Layout.from_world_size(parallel, world_size)


def tiny_model(name: str, dtype: str, distributed: bool, **overrides):
    """The tiny model in megatron DDP, with the distributed optimizer's buffers if asked (and if
    this checkout's `wrap_for_training` lets the caller choose). Its experts are one parameter
    per expert and projection, as Transformer Engine's grouped experts hold them on the GPUs the
    plan is for (the CPU's grouped experts stack each layer's experts in two tensors)."""
    from megatron_rl.backend.optimizer import wrap_for_training
    from megatron_rl.model import ModelOptions, build_model, preset_config

    config = preset_config(name, **overrides)
    options = ModelOptions(dtype=dtype)
    if hasattr(options, "moe_grouped_gemm"):  # older checkouts (--old-tree) lack the choice
        options.moe_grouped_gemm = False
    model = build_model(config, options, spec="local")
    if "use_distributed_optimizer" in inspect.signature(wrap_for_training).parameters:
        return config, wrap_for_training(model, use_distributed_optimizer=distributed)
    return config, wrap_for_training(model)


def load_tool():
    """The planner command's module (its ``main(argv) -> int``)."""
    return importlib.import_module("megatron_rl.cli.plan")
