"""Presets and HF folders (megatron_rl/model/presets.py): the real-size DeepSeek-V3 and GLM-4.5
presets hold the published shapes, and an HF folder of a family the project does not build is
refused by name, listing the families it does build, before anything is written."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from transformers import DeepseekV3Config, Glm4MoeConfig, Qwen3MoeConfig

from megatron_rl.model.presets import load_hf_config, preset_config

ROOT = Path(__file__).resolve().parents[2]
ARCHITECTURE_FIELDS = (
    "vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
    "num_hidden_layers", "first_k_dense_replace", "num_attention_heads", "num_key_value_heads",
    "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim",
    "n_routed_experts", "num_experts_per_tok", "n_group", "topk_group", "n_shared_experts",
    "routed_scaling_factor", "norm_topk_prob", "rms_norm_eps", "tie_word_embeddings",
)  # fmt: skip


def test_deepseek_v3_preset_is_the_published_shape_and_yarn_without_mtp():
    """transformers' DeepseekV3Config defaults are DeepSeek-V3's published config.json values:
    the preset differs only in the multi-token-prediction layer (not built), positions and the
    release's YaRN rope_scaling, which the defaults leave out."""
    preset, published = preset_config("deepseek-v3"), DeepseekV3Config()
    for field in ARCHITECTURE_FIELDS:
        assert getattr(preset, field) == getattr(published, field), field
    assert preset.num_nextn_predict_layers == 0
    assert preset.rope_parameters == {
        "rope_type": "yarn", "rope_theta": 10_000.0, "factor": 40.0,
        "original_max_position_embeddings": 4096, "beta_fast": 32.0, "beta_slow": 1.0,
        "mscale": 1.0, "mscale_all_dim": 1.0,
    }  # fmt: skip
    assert preset.max_position_embeddings == 163840


def test_glm_4_5_preset_holds_the_355b_shape():
    config = preset_config("glm-4.5")
    assert isinstance(config, Glm4MoeConfig)
    shape = (config.num_hidden_layers, config.first_k_dense_replace, config.hidden_size)
    assert shape == (92, 3, 5120)
    heads = (config.num_attention_heads, config.num_key_value_heads, config.head_dim)
    assert heads == (96, 8, 128)
    assert config.rope_parameters["partial_rotary_factor"] == 0.5
    assert (config.n_routed_experts, config.num_experts_per_tok, config.n_group) == (160, 8, 1)
    assert (config.n_shared_experts, config.moe_intermediate_size) == (1, 1536)
    assert (config.intermediate_size, config.vocab_size) == (12288, 151552)
    assert config.use_qk_norm and config.attention_bias


def _folder(tmp_path: Path, **config) -> Path:
    folder = tmp_path / "hf"
    folder.mkdir(parents=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_a_config_without_model_type_is_read_by_its_architectures(tmp_path):
    deepseek = preset_config("tiny-deepseek").to_dict()
    del deepseek["model_type"]
    deepseek["architectures"] = ["DeepseekV3ForCausalLM"]
    assert isinstance(load_hf_config(_folder(tmp_path, **deepseek)), DeepseekV3Config)
    llama = _folder(tmp_path / "llama", architectures=["LlamaForCausalLM"], hidden_size=8)
    with pytest.raises(ValueError, match=r"architectures=\['LlamaForCausalLM'\]") as error:
        load_hf_config(llama)
    for family in ("qwen3_moe", "deepseek_v3", "glm4_moe", "Glm4MoeForCausalLM"):
        assert family in str(error.value)
    bare = _folder(tmp_path / "bare", hidden_size=64)  # neither: read as Qwen3-MoE, as before
    assert isinstance(load_hf_config(bare), Qwen3MoeConfig)


@pytest.mark.slow
def test_the_cli_refuses_an_unsupported_hf_folder_by_name_and_writes_nothing(tmp_path):
    folder = _folder(tmp_path, model_type="mixtral", architectures=["MixtralForCausalLM"])
    run_dir = tmp_path / "run"
    result = subprocess.run(
        [sys.executable, "-m", "megatron_rl.train", "--model", str(folder), "--run-dir",
         str(run_dir), "--train-iters", "1"],
        cwd=ROOT, env={**os.environ, "OMP_NUM_THREADS": "1"}, capture_output=True, text=True,
        timeout=600,
    )  # fmt: skip
    assert result.returncode == 2, result.stderr[-2000:]
    assert "model_type='mixtral' is not supported" in result.stderr
    assert "supported model families: qwen3_moe, deepseek_v3, glm4_moe" in result.stderr
    assert not run_dir.exists()
