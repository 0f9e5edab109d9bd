"""Fusions that need a kernel are on only where the kernel exists (the ``[gpu]`` extra installs
Transformer Engine, not apex)."""

from __future__ import annotations

import importlib.util

import pytest


@pytest.fixture
def te_flavoured(monkeypatch):
    """`to_transformer_config` with ``use_te=True`` under stand-in world-size-1 parallel sizes.

    Only the config's flags are under test, so Transformer Engine's kernels, which megatron's
    ``TransformerConfig.__post_init__`` looks up for the rope and permute fusions, are stood in
    for by placeholders (TE does not install on CPU); no layer is built."""
    from megatron.core import parallel_state
    from megatron.core.models.common.embeddings import rope_utils
    from megatron.core.transformer.moe import moe_utils

    from megatron_rl.model import config as model_config
    from megatron_rl.model.presets import preset_config

    for name in ("tensor_model", "pipeline_model", "context", "expert_model", "expert_tensor"):
        monkeypatch.setattr(parallel_state, f"get_{name}_parallel_world_size", lambda: 1)
    monkeypatch.setattr(rope_utils, "fused_apply_rotary_pos_emb", object())
    for name in ("permute", "permute_with_probs", "sort_chunks_by_index", "unpermute"):
        monkeypatch.setattr(moe_utils, f"fused_{name}", object(), raising=False)
    monkeypatch.setattr(moe_utils, "fused_sort_chunks_by_index_with_probs", object(), raising=False)
    model_config.grad_accum_fusion_available.cache_clear()
    yield lambda: model_config.to_transformer_config(
        preset_config("tiny"), model_config.ModelOptions(), use_te=True
    )
    model_config.grad_accum_fusion_available.cache_clear()


def test_te_without_apex_turns_gradient_accumulation_fusion_off(te_flavoured):
    """megatron's own ColumnParallelLinear (the output layer, even with TE) raises at
    construction when the fusion is on and apex's kernel is missing."""
    assert importlib.util.find_spec("fused_weight_gradient_mlp_cuda") is None  # no apex here
    config = te_flavoured()
    assert config.gradient_accumulation_fusion is False
    assert config.moe_permute_fusion and config.apply_rope_fusion  # TE's own fusions stay on


def test_te_with_apex_keeps_gradient_accumulation_fusion(te_flavoured, monkeypatch):
    from megatron_rl.model import config as model_config

    real_find_spec = importlib.util.find_spec
    monkeypatch.setattr(
        model_config.importlib.util,
        "find_spec",
        lambda name, *a: (
            object() if name == "fused_weight_gradient_mlp_cuda" else real_find_spec(name, *a)
        ),
    )
    assert te_flavoured().gradient_accumulation_fusion is True
