"""The in-process engine on DeepSeek-V3: the routes it captures are megatron's choices.

transformers' `DeepseekV3ForCausalLM` generates (prefill and KV-cached decoding, left-padded
rows of different lengths) with route capture on; the megatron-core model built from the same
checkpoint then runs each sample's tokens and its routers (sigmoid scores, score-correction
bias, group-limited top-k) must select exactly the captured experts at every position and MoE
layer. The config is not the preset's: 12 experts in 3 groups, top-4 within 2 groups, a random
bias that changes the choice (`make_deepseek_checkpoint`).
"""

from __future__ import annotations

import pytest
import torch
from qwen3_moe_testing import megatron_forward
from test_deepseek_v3 import hidden_config, make_deepseek_checkpoint
from transformers import DeepseekV3ForCausalLM

from megatron_rl.model import build_model, preset_config
from megatron_rl.model.conversion import load_checkpoint
from megatron_rl.rollout import InProcessEngine, InProcessEngineConfig
from megatron_rl.rollout.types import SamplingParams


def test_captured_routes_equal_megatron_router_selections(ws1, tmp_path):
    config = hidden_config()
    make_deepseek_checkpoint(tmp_path / "hf", config, seed=5)
    engine = InProcessEngine.from_pretrained(tmp_path / "hf")
    prompts = [[3, 17, 42, 8, 9, 60], [5, 6]]
    params = SamplingParams(max_new_tokens=5, seed=7)
    samples = engine.generate(prompts, params, n=2, return_routed_experts=True)

    model = build_model(config)
    load_checkpoint(model, tmp_path / "hf", config)
    model.eval()
    topk = config.num_experts_per_tok
    for sample in samples:
        tokens_T = torch.cat([sample.prompt_ids_P, sample.response_ids_R[:-1]])
        captured_TLK = engine.codec.decode(sample.routes).sort(dim=-1).values
        maps = megatron_forward(model, tokens_T[None])["routes"]  # per MoE layer [T, E] bool
        chosen_TLK = torch.stack(
            [m.to(torch.int8).topk(topk, dim=-1).indices.sort(dim=-1).values for m in maps], dim=1
        )
        assert captured_TLK.shape == (len(tokens_T), 2, topk)
        assert torch.equal(captured_TLK, chosen_TLK)


def test_router_noise_on_the_deepseek_router_is_refused_naming_the_flag():
    model = DeepseekV3ForCausalLM(preset_config("tiny-deepseek"))
    with pytest.raises(ValueError, match=r"--rollout-router-noise=0\.1 .* DeepseekV3TopkRouter"):
        InProcessEngine(model, InProcessEngineConfig(router_noise=0.1))
