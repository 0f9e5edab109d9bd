"""The plan's shape of the DeepSeek-V3 (MLA) and GLM-4.5 presets at full size: parameter totals
against the published sizes, MLA's projections split over TP as each layer spec splits them, and
the MLA KV cache a colocated server holds per token."""

from __future__ import annotations

import pytest
from memory_plan_testing import make_layout

from megatron_rl.memory_plan import Layout, ModelShape, load_model_config, stage_tensors
from megatron_rl.memory_plan.colocate import ServerOptions, kv_bytes_per_token


def _shape(name: str) -> ModelShape:
    return ModelShape.from_hf(load_model_config(name))


def test_deepseek_v3_counts_671b_parameters_and_37b_active():
    """DeepSeek-V3's report: 671B total (the main model; its MTP module adds 14B), 37B active."""
    shape = _shape("deepseek-v3")
    assert shape.mla and shape.num_moe_layers == 58 and shape.head_dim == 192
    assert shape.total_params() == pytest.approx(671e9, rel=1e-3)
    assert shape.total_params(active=True) == pytest.approx(37.5e9, rel=0.02)


def test_glm_4_5_counts_355b_parameters_with_its_mtp_layer_and_32b_active():
    """GLM-4.5's report: 355B total (with one MTP layer, not built here: about one MoE layer
    more), 32B active (without the embedding and output matrices)."""
    shape = _shape("glm-4.5")
    assert not shape.mla and shape.num_moe_layers == 89 and not shape.shared_expert_gate
    one_moe_layer = (
        shape.attention_params() + shape.norm_params() + shape.shared_expert_params()
        + shape.num_experts * (shape.hidden_size + shape.expert_params())
    )  # fmt: skip
    assert shape.total_params() + one_moe_layer == pytest.approx(355e9, rel=0.01)
    embeddings = 2 * shape.vocab_size * shape.hidden_size
    assert shape.total_params(active=True) - embeddings == pytest.approx(32e9, rel=0.01)


@pytest.mark.parametrize(("spec", "down_split"), [("te", 1), ("local", 8)])
def test_mla_down_projections_are_replicated_on_te_and_split_on_the_local_spec(spec, down_split):
    """megatron-core 0.16.1: TE's spec builds the q / kv down projections as ``TELinear``
    (duplicated over TP), the local spec as ``ColumnParallelLinear``; the up projections and
    linear_proj are split by heads either way."""
    shape = _shape("deepseek-v3")
    stages = (7, 8, 8, 8, 8, 8, 8, 6)
    parallel = make_layout(tensor_parallel=8, pipeline_parallel=8, expert_parallel=8).parallel
    layout = Layout.from_world_size(parallel, 64, stages)
    sizes = {
        t.name.split("self_attention.")[1]: t.numel
        for t in stage_tensors(shape, layout, 1, spec=spec)
        if t.name.startswith("decoder.layers.0.self_attention.")
    }
    h, heads = 7168, 128 // 8
    assert sizes == {
        "linear_proj.weight": h * heads * 128,
        "linear_q_down_proj.weight": 1536 * h // down_split,
        "linear_q_up_proj.weight": heads * (128 + 64) * 1536,
        "linear_kv_down_proj.weight": (512 + 64) * h // down_split,
        "linear_kv_up_proj.weight": heads * (128 + 128) * 512,
        "q_layernorm.weight": 1536,
        "kv_layernorm.weight": 512,
    }


def test_a_colocated_mla_server_caches_the_latent_per_token():
    """SGLang's MLA cache: the kv latent and the rope key, every layer, on every GPU of the
    server (not split by TP): 61 x (512 + 64) x 2 bytes in bf16."""
    assert kv_bytes_per_token(_shape("deepseek-v3"), ServerOptions(tp=8)) == 61 * 576 * 2
    glm = _shape("glm-4.5")  # GQA: 8 KV heads over TP 8, K and V
    assert kv_bytes_per_token(glm, ServerOptions(tp=8)) == 92 * 2 * 1 * 128 * 2
