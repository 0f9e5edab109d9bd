"""The PEFT export against the real ``peft`` package: the adapters of a megatron policy, loaded by
``PeftModel.from_pretrained`` onto transformers' model of the base checkpoint, give the megatron
policy's logits (the families' parity bound, fp32); PEFT's ``merge_and_unload`` equals the
merged HF export tensor by tensor. Qwen3-MoE, DeepSeek-V3 and GLM-4.5 on configs no other test
uses."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors.torch import load_file

from megatron_rl.lora.apply import add_adapters
from megatron_rl.lora.config import LoRAConfig
from megatron_rl.lora.peft_export import save_peft_adapter
from megatron_rl.model import build_model
from megatron_rl.model.builder import causal_lm_logits
from megatron_rl.model.conversion import save_checkpoint
from megatron_rl.model.conversion.safetensors_io import CheckpointReader
from megatron_rl.model.conversion.seeded_init import init_from_seed
from megatron_rl.model.presets import hf_causal_lm_class, preset_config

peft = pytest.importorskip("peft")

ATOL = 1e-5  # the families' fp32 parity bound (tests/model/test_hf_parity.py)
CONFIGS = {  # family -> (preset, overrides no other test uses)
    "qwen3-moe": ("tiny", dict(num_attention_heads=8, num_key_value_heads=4, head_dim=8)),
    "deepseek-v3": ("tiny-deepseek", dict(num_attention_heads=2)),
    "glm-4.5": ("tiny-glm", dict(num_attention_heads=8, num_key_value_heads=2, head_dim=8)),
}


def _adapted(tmp_path, family: str, targets: str):
    """A seeded megatron model of ``family``, its base exported to ``base/``, adapters with B
    away from 0; its logits on random ids, its PEFT export (``adapter/``) and its merged HF
    export (``merged/``)."""
    preset, overrides = CONFIGS[family]
    hf_config = preset_config(preset, **overrides)
    model = build_model(hf_config)
    init_from_seed(model, hf_config, seed=5)
    save_checkpoint(model, hf_config, tmp_path / "base")
    add_adapters(model, LoRAConfig(lora_rank=4, lora_alpha=8, lora_targets=targets), seed=2)
    gen = torch.Generator().manual_seed(7)
    with torch.no_grad():  # a trained adapter: B away from 0
        for name, param in model.named_parameters():
            if ".lora_B" in name:
                param.copy_(torch.randn(param.shape, generator=gen) * 0.05)
    ids = torch.randint(0, hf_config.vocab_size, (2, 11), generator=gen)
    model.eval()
    with torch.no_grad():
        logits = causal_lm_logits(model, ids)
    save_peft_adapter(model, hf_config, tmp_path / "adapter", base_model=str(tmp_path / "base"))
    save_checkpoint(model, hf_config, tmp_path / "merged")
    config = json.loads((tmp_path / "adapter" / "adapter_config.json").read_text())
    targets = config["target_modules"].replace("\\", "").split("|")
    return hf_config, ids, logits, config, targets


def _hf(hf_config, folder):
    return hf_causal_lm_class(hf_config).from_pretrained(folder, dtype=torch.float32).eval()


@pytest.mark.parametrize("family", CONFIGS)
def test_peft_loads_the_adapters_and_merges_as_the_export_does(ws1, tmp_path, family):
    """Attention targets (every family's q/k/v or MLA up-projections, and o_proj)."""
    hf_config, ids, want, config, targets = _adapted(tmp_path, family, "attention")
    assert config["r"] == 4 and config["lora_alpha"] == 8 and config["peft_type"] == "LORA"
    peft_model = peft.PeftModel.from_pretrained(
        _hf(hf_config, tmp_path / "base"), tmp_path / "adapter"
    )
    adapted = {n for n, _ in peft_model.named_modules() if n.endswith(".lora_A")}
    assert adapted == {f"base_model.model.{t}.lora_A" for t in targets}  # these, no other
    with torch.no_grad():
        got = peft_model.eval()(input_ids=ids).logits
        base = _hf(hf_config, tmp_path / "base")(input_ids=ids).logits
    diff = (got - want).abs().max().item()
    print(f"{family}: max |PEFT - megatron| {diff:.2e}")
    assert diff < ATOL
    assert (want - base).abs().max() > 100 * ATOL  # the adapters change the logits
    # transformers names routed experts its own way; every adapted weight keeps its HF name
    merged = peft_model.merge_and_unload().state_dict()
    compared = set()
    with CheckpointReader(tmp_path / "merged") as reader:
        for name in set(reader.names()) & set(merged):
            torch.testing.assert_close(merged[name], reader.get(name), atol=1e-6, rtol=0)
            compared.add(name.removesuffix(".weight"))
    assert set(targets) <= compared


@pytest.mark.parametrize("family", ["deepseek-v3", "glm-4.5"])
def test_dense_mlp_and_shared_expert_adapters_export_merged_and_in_peft_layout(
    ws1, tmp_path, family
):
    """``all_dense`` adds the dense MLP and the shared experts. peft 0.21 under transformers 5
    cannot load these (its MoE conversion retargets every ``gate_proj``/``up_proj``/``down_proj``
    to the fused routed experts), so the export is checked without it: transformers' model of the
    merged export gives the megatron logits, and every exported pair satisfies PEFT's merge
    ``W_merged = W + (alpha / r) B A`` against the base and merged exports."""
    hf_config, ids, want, config, targets = _adapted(tmp_path, family, "all_dense")
    assert any(t.endswith("shared_experts.gate_proj") for t in targets)
    assert any(t.endswith("mlp.down_proj") and "shared" not in t for t in targets)
    with torch.no_grad():
        got = _hf(hf_config, tmp_path / "merged")(input_ids=ids).logits
    assert (got - want).abs().max() < ATOL
    tensors = load_file(tmp_path / "adapter" / "adapter_model.safetensors")
    scale = config["lora_alpha"] / config["r"]
    with (
        CheckpointReader(tmp_path / "base") as base,
        CheckpointReader(tmp_path / "merged") as merged,
    ):
        for t in targets:
            a = tensors[f"base_model.model.{t}.lora_A.weight"]
            b = tensors[f"base_model.model.{t}.lora_B.weight"]
            w = base.get(f"{t}.weight")
            torch.testing.assert_close(
                w + scale * b @ a, merged.get(f"{t}.weight"), atol=1e-6, rtol=0
            )
