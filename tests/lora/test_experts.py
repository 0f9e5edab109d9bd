"""LoRA on the routed experts (per expert and shared by a layer's experts): the adapted model
equals the model whose expert weights are merged (``W + (alpha / r) B A``) in its logits, and the
adapters' gradients are the merged weights' gradients pushed through the factors
(``dB = s dW A^T``, ``dA = s B^T dW``; summed over the experts when shared)."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.lora.apply import add_adapters, merged_state_dict
from megatron_rl.lora.config import LoRAConfig
from megatron_rl.lora.experts import LoRAGroupedExperts
from megatron_rl.model import build_model
from megatron_rl.model.builder import causal_lm_logits
from megatron_rl.model.conversion.seeded_init import init_from_seed
from megatron_rl.model.presets import preset_config

RANK, ALPHA = 4, 8.0


@pytest.mark.parametrize("mode", ["per-expert", "shared"])
def test_equal_the_merged_model_in_logits_and_gradients(ws1, tmp_path, mode):
    hf_config = preset_config("tiny")
    model = build_model(hf_config)
    init_from_seed(model, hf_config, seed=5)
    config = LoRAConfig(
        lora_rank=RANK, lora_alpha=ALPHA, lora_targets="routed_experts", lora_experts=mode
    )
    names = add_adapters(model, config, seed=2)
    assert names == ["decoder.layers.0.mlp.experts", "decoder.layers.1.mlp.experts"]
    gen = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for name, p in model.named_parameters():
            if ".lora_B" in name:
                p.copy_(torch.randn(p.shape, generator=gen) * 0.1)
    merged = build_model(hf_config)
    merged.load_state_dict(merged_state_dict(model), strict=True)
    ids = torch.randint(0, hf_config.vocab_size, (2, 9), generator=gen)
    weights = torch.randn(2, 9, hf_config.vocab_size, generator=gen)
    got, want = causal_lm_logits(model, ids), causal_lm_logits(merged, ids)
    torch.testing.assert_close(got, want, atol=2e-5, rtol=0)
    (got * weights).sum().backward()
    (want * weights).sum().backward()
    s = ALPHA / RANK
    for layer in names:
        adapter: LoRAGroupedExperts = model.get_submodule(layer)
        base = merged.get_submodule(layer)
        for i, grad_w in ((1, base.weight1.grad), (2, base.weight2.grad)):
            a, b = getattr(adapter, f"lora_A{i}").detach(), getattr(adapter, f"lora_B{i}").detach()
            grad_b = s * grad_w @ a.transpose(1, 2)  # [E, out, r] per expert
            grad_a = s * b.transpose(1, 2) @ grad_w  # [E, r, in]
            if mode == "shared":
                grad_b, grad_a = grad_b.sum(0, keepdim=True), grad_a.sum(0, keepdim=True)
            torch.testing.assert_close(
                getattr(adapter, f"lora_B{i}").grad, grad_b, atol=1e-5, rtol=1e-4
            )
            torch.testing.assert_close(
                getattr(adapter, f"lora_A{i}").grad, grad_a, atol=1e-5, rtol=1e-4
            )
            assert adapter.base.weight1.grad is None  # the base stays frozen


def test_bad_expert_settings_are_named(ws1):
    hf_config = preset_config("tiny")
    model = build_model(hf_config)
    with pytest.raises(ValueError, match="--lora-dropout on routed experts"):
        add_adapters(
            model, LoRAConfig(lora_rank=4, lora_dropout=0.1, lora_targets="routed_experts"), seed=1
        )
    with pytest.raises(ValueError, match=r"--lora-rank 3 gives rows of 12 bytes"):
        add_adapters(
            build_model(hf_config), LoRAConfig(lora_rank=3, lora_targets="routed_experts"), seed=1
        )
    assert "mlp.experts" in LoRAConfig(lora_rank=4, lora_targets="all_linear").target_modules()
    assert "mlp.experts" not in LoRAConfig(lora_rank=4, lora_targets="all_dense").target_modules()
