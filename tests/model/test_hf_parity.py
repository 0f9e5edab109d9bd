"""The converted megatron model computes what the HF Qwen3-MoE reference computes."""

from __future__ import annotations

import pytest
import torch
from qwen3_moe_testing import (
    fixed_input_ids,
    hf_reference,
    hf_routes_for_rank,
    make_hf_checkpoint,
    megatron_forward,
    tiny_config,
)

from megatron_rl.model import build_model
from megatron_rl.model.conversion import load_checkpoint

ATOL = 1e-5


@pytest.mark.parametrize(
    "overrides",
    [{}, {"mlp_only_layers": [0], "tie_word_embeddings": True, "norm_topk_prob": False}],
)
def test_ws1_logits_and_routing_match_hf(ws1, tmp_path, overrides):
    config = tiny_config(**overrides)
    hf_model = make_hf_checkpoint(str(tmp_path / "hf"), config)
    input_ids = fixed_input_ids(config.vocab_size)
    reference = hf_reference(hf_model, input_ids)

    model = build_model(config)
    load_checkpoint(model, tmp_path / "hf", config)
    model.eval()
    result = megatron_forward(model, input_ids)

    diff = (result["logits"] - reference["logits"]).abs().max().item()
    print(f"ws1 max |logits diff| {diff:.3e}")
    assert diff < ATOL, f"max |logits diff| {diff:.3e}"
    expected_routes = hf_routes_for_rank(reference["routes"], 0, 1)
    assert (
        len(result["routes"])
        == len(expected_routes)
        == sum(1 for i in range(config.num_hidden_layers) if i not in config.mlp_only_layers)
    )
    for layer, (got, want) in enumerate(zip(result["routes"], expected_routes, strict=True)):
        assert torch.equal(got, want), f"routing differs in MoE layer {layer}"
