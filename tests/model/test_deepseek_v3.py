"""DeepSeek-V3 on megatron-core (local spec, CPU): the converted model computes what transformers'
own `DeepseekV3ForCausalLM` computes, conversion round-trips exactly, and bad input is named.

The parity configs are not the preset's: other sizes, group-limited routing with three groups,
two shared experts, a random score-correction bias (so the bias changes the choice), random norm
weights, a variant without the query LoRA, and one with YaRN rope scaling unlike the release's.
"""

from __future__ import annotations

import json
import logging

import pytest
import torch
from qwen3_moe_testing import fixed_input_ids, hf_reference, megatron_forward
from safetensors.torch import load_file, save_file
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

from megatron_rl.model import build_model, load_hf_config, preset_config, to_transformer_config
from megatron_rl.model.conversion import load_checkpoint, save_checkpoint
from megatron_rl.model.conversion.safetensors_io import CheckpointReader
from megatron_rl.model.conversion.seeded_init import init_from_seed
from megatron_rl.model.options import ModelOptions
from megatron_rl.rollout import InProcessEngine

ATOL = 1e-5

# 4 layers (2 dense), 12 experts in 3 groups, top-4 within the 2 best groups, 2 shared experts
PARITY_CONFIG = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=4,
    first_k_dense_replace=2,
    num_attention_heads=3,
    num_key_value_heads=3,
    q_lora_rank=24,
    kv_lora_rank=20,
    qk_nope_head_dim=8,
    qk_rope_head_dim=4,
    v_head_dim=12,
    n_routed_experts=12,
    num_experts_per_tok=4,
    n_group=3,
    topk_group=2,
    n_shared_experts=2,
    routed_scaling_factor=1.7,
    num_nextn_predict_layers=0,
    max_position_embeddings=64,
    rms_norm_eps=1e-6,
    rope_parameters={"rope_type": "default", "rope_theta": 50_000.0},
    tie_word_embeddings=False,
)
NO_Q_LORA = dict(PARITY_CONFIG, q_lora_rank=None, n_group=1, topk_group=1, num_experts_per_tok=3)
# YaRN unlike the release's (factor 40 over 4,096, betas 32 / 1, mscales 1 / 1): factor 4 over 16
# original positions, betas that put a partial ramp on the 8 rope frequencies (1, .75, .5, then
# .25 of the base), mscale and mscale_all_dim that differ from 1 and from each other (so both the
# cos/sin factor and MLA's softmax scale move), 40 positions
YARN = {
    "rope_type": "yarn",
    "rope_theta": 1000.0,
    "factor": 4.0,
    "original_max_position_embeddings": 16,
    "beta_fast": 2.0,
    "beta_slow": 0.25,
    "mscale": 0.8,
    "mscale_all_dim": 0.6,
}
YARN_CONFIG = dict(qk_rope_head_dim=16, rope_parameters=YARN)
YARN_SEQ_LEN = 40


def hidden_config(**overrides) -> DeepseekV3Config:
    config = DeepseekV3Config(**{**PARITY_CONFIG, **overrides})
    config._attn_implementation = "eager"
    return config


def make_deepseek_checkpoint(folder, config: DeepseekV3Config, seed: int) -> DeepseekV3ForCausalLM:
    """A random HF model saved with ``save_pretrained``: routers N(0, 0.5) (HF's are zeros), the
    score-correction bias U(-0.2, 0.2) (HF's is zero) and norm weights 1 + N(0, 0.1)."""
    torch.manual_seed(seed)
    model = DeepseekV3ForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("mlp.gate.weight"):
                tensor.normal_(0.0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.uniform_(-0.2, 0.2)
            elif name.endswith("norm.weight"):
                tensor.copy_(1.0 + 0.1 * torch.randn_like(tensor))
    model.save_pretrained(folder)
    return model


def _tensors(folder) -> dict[str, torch.Tensor]:
    with CheckpointReader(folder) as reader:
        return {name: reader.get(name) for name in reader.names()}


@pytest.mark.parametrize(("overrides", "seed"), [({}, 3), (NO_Q_LORA, 11)])
def test_ws1_logits_and_routing_match_transformers(ws1, tmp_path, overrides, seed):
    config = hidden_config(**overrides)
    hf_model = make_deepseek_checkpoint(tmp_path / "hf", config, seed)
    input_ids = fixed_input_ids(config.vocab_size, seed=seed + 1)
    reference = hf_reference(hf_model, input_ids)

    model = build_model(config)
    load_checkpoint(model, tmp_path / "hf", config)
    model.eval()
    result = megatron_forward(model, input_ids)

    diff = (result["logits"] - reference["logits"]).abs().max().item()
    print(f"deepseek_v3 ws1 max |logits diff| {diff:.3e}")
    assert diff <= ATOL, f"max |logits diff| {diff:.3e}"
    assert len(result["routes"]) == len(reference["routes"]) == 2  # the 2 dense layers have none
    for layer, (got, want) in enumerate(zip(result["routes"], reference["routes"], strict=True)):
        batch, seq = input_ids.shape
        want_SB = want.reshape(batch, seq, -1).transpose(0, 1).reshape(batch * seq, -1)
        assert torch.equal(got, want_SB), f"routing differs in MoE layer {layer}"


@pytest.mark.slow
def test_ws1_yarn_logits_match_transformers_and_survive_export_to_the_engine(ws1, tmp_path):
    """YaRN parity with HF's own model (positions past the original 16), where default rope on
    the same weights is far off; the HF export's config.json keeps the YaRN parameters and the
    in-process engine loaded from it computes the same logits."""
    config = hidden_config(**YARN_CONFIG)
    hf_model = make_deepseek_checkpoint(tmp_path / "hf", config, seed=13)
    input_ids = fixed_input_ids(config.vocab_size, seed=14, seq_len=YARN_SEQ_LEN)
    reference = hf_reference(hf_model, input_ids)
    default_rope = hidden_config(**YARN_CONFIG | {"rope_parameters": {"rope_theta": 1000.0}})
    unscaled = DeepseekV3ForCausalLM(default_rope).eval()
    unscaled.load_state_dict(hf_model.state_dict())
    unscaled_diff = (hf_reference(unscaled, input_ids)["logits"] - reference["logits"]).abs()

    tc = to_transformer_config(config, ModelOptions(), use_te=False)
    assert (tc.rope_type, tc.rotary_scaling_factor, tc.original_max_position_embeddings) == (
        "yarn",
        4.0,
        16,
    )
    model = build_model(config)
    load_checkpoint(model, tmp_path / "hf", config)
    model.eval()
    result = megatron_forward(model, input_ids)
    diff = (result["logits"] - reference["logits"]).abs().max().item()
    print(f"deepseek_v3 yarn max |logits diff| {diff:.3e}, default rope {unscaled_diff.max():.3e}")
    assert diff <= ATOL, f"max |logits diff| {diff:.3e}"
    assert unscaled_diff.max().item() > 100 * ATOL  # the scaling matters at this length

    save_checkpoint(model, config, tmp_path / "export", fmt="hf")
    assert load_hf_config(tmp_path / "export").rope_parameters == config.rope_parameters
    engine = InProcessEngine.from_pretrained(tmp_path / "export")
    assert engine.model.config.rope_parameters == config.rope_parameters
    with torch.no_grad():
        engine_logits = engine.model(input_ids=input_ids).logits
    assert (engine_logits - reference["logits"]).abs().max().item() <= ATOL


@pytest.mark.parametrize(
    ("rope", "match"),
    [
        ({"rope_type": "longrope"}, "rope_type'\\]='longrope' is not supported for deepseek_v3"),
        ({"factor": None}, "'factor'\\] is missing"),
        ({"attention_factor": 1.1}, "'attention_factor'\\]=1.1 is not supported"),
        ({"mscale": None}, "'mscale'\\]=None with mscale_all_dim=0.6"),
        ({"truncate": False}, "'truncate'\\]=False is not supported"),
    ],
)
def test_yarn_that_megatron_computes_otherwise_is_refused_by_field(ws1, rope, match):
    config = hidden_config(**YARN_CONFIG)
    config.rope_parameters = {**YARN, **rope}
    with pytest.raises(ValueError, match=match):
        build_model(config)


def test_yarn_mscale_without_mscale_all_dim_is_hf_s_attention_factor(ws1):
    """HF ignores mscale when mscale_all_dim is 0 or absent (attention factor m(s, 1)); megatron
    takes the ratio m(s, mscale) / m(s, mscale_all_dim), which is m(s, 1) with mscale 1."""
    config = hidden_config(**YARN_CONFIG)
    config.rope_parameters = {**YARN, "mscale_all_dim": 0.0}
    tc = to_transformer_config(config, ModelOptions(), use_te=False)
    assert (tc.mscale, tc.mscale_all_dim) == (1.0, 0.0)


def test_deepseek_v3_preset_uses_the_release_yarn(ws1):
    tc = to_transformer_config(preset_config("deepseek-v3"), ModelOptions(), use_te=False)
    release = (tc.rope_type, tc.rotary_scaling_factor, tc.original_max_position_embeddings)
    assert release == ("yarn", 40.0, 4096)
    assert (tc.beta_fast, tc.beta_slow, tc.mscale, tc.mscale_all_dim) == (32.0, 1.0, 1.0, 1.0)


def test_hf_to_megatron_to_hf_round_trip_is_bit_exact(ws1, tmp_path):
    config = hidden_config()
    make_deepseek_checkpoint(tmp_path / "hf", config, seed=5)
    model = build_model(config)
    load_checkpoint(model, tmp_path / "hf", config)
    save_checkpoint(model, config, tmp_path / "meg", fmt="megatron")
    fresh = build_model(config)
    load_checkpoint(fresh, tmp_path / "meg", config)  # format detected from the names
    save_checkpoint(fresh, config, tmp_path / "hf2", fmt="hf")

    original, back = _tensors(tmp_path / "hf"), _tensors(tmp_path / "hf2")
    assert sorted(original) == sorted(back)
    assert any(name.endswith("e_score_correction_bias") for name in original)
    for name, tensor in original.items():
        assert back[name].dtype == tensor.dtype, name
        assert torch.equal(tensor, back[name]), name
    reloaded = load_hf_config(tmp_path / "hf2")
    assert isinstance(reloaded, DeepseekV3Config)
    assert reloaded.to_dict() == config.to_dict()
    with open(tmp_path / "hf2" / "config.json", encoding="utf-8") as handle:
        assert json.load(handle)["architectures"] == ["DeepseekV3ForCausalLM"]


def test_mtp_layer_tensors_are_skipped_with_a_warning(ws1, tmp_path, caplog):
    config = hidden_config(num_nextn_predict_layers=1)
    make_deepseek_checkpoint(tmp_path / "hf", config, seed=7)
    path = tmp_path / "hf" / "model.safetensors"
    tensors = load_file(path)
    mtp = f"model.layers.{config.num_hidden_layers}."  # the MTP module after the last layer
    tensors[mtp + "eh_proj.weight"] = torch.randn(config.hidden_size, 2 * config.hidden_size)
    tensors[mtp + "enorm.weight"] = torch.ones(config.hidden_size)
    save_file(tensors, path, metadata={"format": "pt"})

    model = build_model(config)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.model.conversion.load"):
        load_checkpoint(model, tmp_path / "hf", config)
    assert "skipping 2 tensors" in caplog.text and "multi-token-prediction" in caplog.text
    save_checkpoint(model, config, tmp_path / "hf2", fmt="hf")
    back = _tensors(tmp_path / "hf2")
    assert not any(name.startswith(mtp) for name in back)
    assert all(torch.equal(back[name], tensors[name]) for name in back)


def test_unsupported_model_type_lists_the_supported_families(ws1, tmp_path):
    folder = tmp_path / "llama"
    folder.mkdir()
    (folder / "config.json").write_text(json.dumps({"model_type": "llama", "hidden_size": 8}))
    with pytest.raises(ValueError, match="model_type='llama'") as error:
        build_model(folder)
    assert "qwen3_moe" in str(error.value) and "deepseek_v3" in str(error.value)


def test_tiny_deepseek_preset_builds_mla_with_group_limited_sigmoid_router(ws1):
    config = preset_config("tiny-deepseek")
    tc = to_transformer_config(config, ModelOptions(), use_te=False)
    assert tc.multi_latent_attention and (tc.q_lora_rank, tc.kv_lora_rank) == (32, 16)
    assert tc.moe_layer_freq == [0, 1, 1]
    assert (tc.moe_router_score_function, tc.moe_router_enable_expert_bias) == ("sigmoid", True)
    assert (tc.moe_router_num_groups, tc.moe_router_group_topk) == (2, 1)
    assert tc.moe_router_topk_scaling_factor == 2.5
    assert tc.moe_shared_expert_intermediate_size == 32
    model = build_model(config)
    names = set(model.state_dict())
    assert "decoder.layers.1.mlp.router.expert_bias" in names
    assert "decoder.layers.0.mlp.router.weight" not in names  # first_k_dense_replace=1
    init_from_seed(model, config, seed=0)  # the trainer's layout-independent initial weights
    layer = model.decoder.layers[1]
    assert torch.equal(layer.mlp.router.expert_bias, torch.zeros(8))
    assert torch.equal(layer.self_attention.q_layernorm.weight, torch.ones(32))
    assert layer.self_attention.linear_kv_up_proj.weight.std().item() > 0


def test_group_limits_megatron_cannot_match_are_refused(ws1):
    config = hidden_config(num_experts_per_tok=3)  # HF scores groups by their best 2, not 3 / 2
    with pytest.raises(ValueError, match="num_experts_per_tok=3 must be 2 \\* topk_group=2"):
        to_transformer_config(config, ModelOptions(), use_te=False)


def test_norm_eps_other_than_the_latent_norms_is_refused(ws1):
    config = hidden_config(rms_norm_eps=1e-5)  # HF's q_a/kv_a_layernorm keep eps 1e-6
    with pytest.raises(ValueError, match="rms_norm_eps=1e-05 is not supported"):
        to_transformer_config(config, ModelOptions(), use_te=False)
