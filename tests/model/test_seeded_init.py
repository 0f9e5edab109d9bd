"""`init_from_seed`: the initial weights are a function of the seed and the HF names alone."""

from __future__ import annotations

import math

import pytest
import torch


def test_each_tensor_has_megatrons_distribution_and_its_own_stream():
    from megatron_rl.model import preset_config
    from megatron_rl.model.conversion.seeded_init import init_std, seeded_hf_tensor

    cfg = preset_config("tiny")
    sigma, layers = cfg.initializer_range, cfg.num_hidden_layers
    assert init_std("model.layers.0.self_attn.q_proj.weight", cfg) == sigma
    assert init_std("model.layers.1.mlp.experts.3.down_proj.weight", cfg) == pytest.approx(
        sigma / math.sqrt(2 * layers)
    )
    assert init_std("model.layers.0.self_attn.o_proj.weight", cfg) == init_std(
        "model.layers.0.mlp.experts.0.down_proj.weight", cfg
    )
    assert torch.equal(seeded_hf_tensor("model.norm.weight", cfg, 3), torch.ones(cfg.hidden_size))
    assert not seeded_hf_tensor("model.layers.0.self_attn.q_proj.bias", cfg, 3).any()
    a = seeded_hf_tensor("model.embed_tokens.weight", cfg, 3)
    assert torch.equal(a, seeded_hf_tensor("model.embed_tokens.weight", cfg, 3))
    assert not torch.equal(a, seeded_hf_tensor("model.embed_tokens.weight", cfg, 4))
    gate = seeded_hf_tensor("model.layers.0.mlp.experts.0.gate_proj.weight", cfg, 3)
    other = seeded_hf_tensor("model.layers.0.mlp.experts.1.gate_proj.weight", cfg, 3)
    assert not torch.equal(gate, other)  # every tensor draws from its own generator


def test_the_model_holds_exactly_the_seeded_hf_tensors(ws1):
    from megatron_rl.model import build_model, preset_config
    from megatron_rl.model.conversion import iter_hf_tensors
    from megatron_rl.model.conversion.seeded_init import init_from_seed, seeded_hf_tensor

    cfg = preset_config("tiny")
    model = build_model(cfg)
    init_from_seed(model, cfg, seed=11)
    exported = dict(iter_hf_tensors(model, cfg))
    assert len(exported) > 20
    for name, tensor in exported.items():
        assert torch.equal(tensor.float(), seeded_hf_tensor(name, cfg, 11)), name
