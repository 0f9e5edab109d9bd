"""GLM-4.5 on megatron-core (local spec, CPU, world size 1): the converted model computes what
transformers' own `Glm4MoeForCausalLM` computes on hidden configs (`glm4_moe_testing`),
conversion round-trips exactly, and what megatron cannot compute is refused by name.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from glm4_moe_testing import (
    ATOL,
    PARITY_CONFIG,
    QUARTER_ROTARY,
    hidden_config,
    make_glm_checkpoint,
)
from qwen3_moe_testing import fixed_input_ids, hf_reference, megatron_forward
from safetensors.torch import load_file, save_file
from transformers import Glm4MoeConfig

from megatron_rl.model import build_model, load_hf_config, preset_config, to_transformer_config
from megatron_rl.model.conversion import load_checkpoint, save_checkpoint
from megatron_rl.model.conversion.safetensors_io import CheckpointReader
from megatron_rl.model.conversion.seeded_init import init_from_seed
from megatron_rl.model.options import ModelOptions


def _tensors(folder) -> dict[str, torch.Tensor]:
    with CheckpointReader(folder) as reader:
        return {name: reader.get(name) for name in reader.names()}


@pytest.mark.parametrize(("overrides", "seed"), [({}, 3), (QUARTER_ROTARY, 11)])
def test_ws1_logits_and_routing_match_transformers(ws1, tmp_path, overrides, seed):
    config = hidden_config(**overrides)
    hf_model = make_glm_checkpoint(tmp_path / "hf", config, seed)
    input_ids = fixed_input_ids(config.vocab_size, seed=seed + 1)
    reference = hf_reference(hf_model, input_ids)

    model = build_model(config)
    load_checkpoint(model, tmp_path / "hf", config)
    model.eval()
    result = megatron_forward(model, input_ids)

    diff = (result["logits"] - reference["logits"]).abs().max().item()
    print(f"glm4_moe ws1 max |logits diff| {diff:.3e}")
    assert diff <= ATOL, f"max |logits diff| {diff:.3e}"
    assert len(result["routes"]) == len(reference["routes"]) == 3  # the 2 dense layers have none
    for layer, (got, want) in enumerate(zip(result["routes"], reference["routes"], strict=True)):
        batch, seq = input_ids.shape
        want_SB = want.reshape(batch, seq, -1).transpose(0, 1).reshape(batch * seq, -1)
        assert torch.equal(got, want_SB), f"routing differs in MoE layer {layer}"


def test_full_rotary_is_not_what_hf_computes(ws1, tmp_path):
    """The parity above depends on the partial rotary: rotating whole heads changes the logits."""
    config = hidden_config()
    hf_model = make_glm_checkpoint(tmp_path / "hf", config, seed=3)
    input_ids = fixed_input_ids(config.vocab_size, seed=4)
    reference = hf_reference(hf_model, input_ids)
    full = hidden_config(
        rope_parameters={**PARITY_CONFIG["rope_parameters"], "partial_rotary_factor": 1.0}
    )
    model = build_model(full)
    load_checkpoint(model, tmp_path / "hf", full)
    model.eval()
    diff = (megatron_forward(model, input_ids)["logits"] - reference["logits"]).abs().max().item()
    assert diff > 1e-3, f"max |logits diff| {diff:.3e}"


def test_hf_to_megatron_to_hf_round_trip_is_bit_exact(ws1, tmp_path):
    config = hidden_config()
    make_glm_checkpoint(tmp_path / "hf", config, seed=5)
    model = build_model(config)
    load_checkpoint(model, tmp_path / "hf", config)
    save_checkpoint(model, config, tmp_path / "meg", fmt="megatron")
    fresh = build_model(config)
    load_checkpoint(fresh, tmp_path / "meg", config)  # format detected from the names
    save_checkpoint(fresh, config, tmp_path / "hf2", fmt="hf")

    original, back = _tensors(tmp_path / "hf"), _tensors(tmp_path / "hf2")
    assert sorted(original) == sorted(back)
    for suffix in (
        "e_score_correction_bias",
        "q_proj.bias",
        "k_norm.weight",
        "shared_experts.up_proj.weight",
    ):
        assert any(name.endswith(suffix) for name in original), suffix
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype, name
        assert torch.equal(tensor, back[name]), name
    reloaded = load_hf_config(tmp_path / "hf2")
    assert isinstance(reloaded, Glm4MoeConfig)
    assert reloaded.to_dict() == config.to_dict()
    with open(tmp_path / "hf2" / "config.json", encoding="utf-8") as handle:
        assert json.load(handle)["architectures"] == ["Glm4MoeForCausalLM"]


def test_mtp_layer_tensors_are_skipped_with_a_warning(ws1, tmp_path, caplog):
    config = hidden_config(num_nextn_predict_layers=1)  # GLM-4.5 ships one MTP layer
    make_glm_checkpoint(tmp_path / "hf", config, seed=7)
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    mtp = f"model.layers.{config.num_hidden_layers}."  # the MTP module after the last layer
    tensors[mtp + "eh_proj.weight"] = torch.randn(config.hidden_size, 2 * config.hidden_size)
    tensors[mtp + "shared_head.norm.weight"] = torch.ones(config.hidden_size)
    save_file(tensors, path, metadata={"format": "pt"})

    model = build_model(config)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.model.conversion.load"):
        load_checkpoint(model, tmp_path / "hf", config)
    assert "skipping 2 tensors" in caplog.text and "multi-token-prediction" in caplog.text


def test_tiny_glm_preset_builds_gqa_partial_rotary_and_group_limited_sigmoid_router(ws1):
    config = preset_config("tiny-glm")
    tc = to_transformer_config(config, ModelOptions(), use_te=False)
    assert (tc.num_query_groups, tc.kv_channels, tc.qk_layernorm, tc.add_qkv_bias) == (
        2,
        16,
        True,
        True,
    )
    assert tc.moe_layer_freq == [0, 0, 1, 1]
    assert (tc.moe_router_score_function, tc.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (tc.moe_router_num_groups, tc.moe_router_group_topk, tc.moe_router_topk) == (4, 2, 4)
    assert tc.moe_router_topk_scaling_factor == 2.5
    assert tc.moe_shared_expert_intermediate_size == 32 and not tc.moe_shared_expert_gate
    model = build_model(config)
    assert model.rotary_pos_emb.inv_freq.numel() == 4  # 8 of 16 dims rotated, in pairs
    names = set(model.state_dict())
    assert "decoder.layers.2.mlp.router.expert_bias" in names
    assert "decoder.layers.1.mlp.router.weight" not in names  # first_k_dense_replace=2
    init_from_seed(model, config, seed=0)  # the trainer's layout-independent initial weights
    layer = model.decoder.layers[2]
    assert torch.equal(layer.mlp.router.expert_bias, torch.zeros(16))
    assert torch.equal(layer.self_attention.linear_qkv.bias, torch.zeros(128))
    assert torch.equal(layer.self_attention.k_layernorm.weight, torch.ones(16))
    assert layer.mlp.shared_experts.linear_fc1.weight.std().item() > 0


def test_group_limits_megatron_cannot_match_are_refused(ws1):
    config = hidden_config(num_experts_per_tok=3)  # HF scores groups by their best 2, not 3 / 2
    with pytest.raises(ValueError, match="num_experts_per_tok=3 must be 2 \\* topk_group=2"):
        to_transformer_config(config, ModelOptions(), use_te=False)


def test_unnormalised_top_k_is_refused(ws1):
    config = hidden_config(norm_topk_prob=False)
    with pytest.raises(ValueError, match="norm_topk_prob=False is not supported"):
        to_transformer_config(config, ModelOptions(), use_te=False)
