"""Shared helpers for the GLM-4.5 model tests: hidden parity configs and a random HF checkpoint.

The parity configs are not the preset's: other sizes, GQA 6 heads over 2 groups, q/k/v biases,
qk-norm, rope on the first half (and, in the variant, the first quarter) of each head, 2 dense
layers, group-limited routing with three groups, two shared experts, a random score-correction
bias (so the bias changes the choice), random biases and norm weights.
"""

from __future__ import annotations

import torch
from transformers import Glm4MoeConfig, Glm4MoeForCausalLM

ATOL = 1e-5  # fp32; measured 1.0e-7 (PARITY_CONFIG) and 1.2e-7 (QUARTER_ROTARY)

# 5 layers (2 dense), 12 experts in 3 groups, top-4 within the 2 best groups, 2 shared experts
PARITY_CONFIG = dict(
    vocab_size=96,
    hidden_size=48,
    intermediate_size=80,
    moe_intermediate_size=24,
    num_hidden_layers=5,
    first_k_dense_replace=2,
    num_attention_heads=6,
    num_key_value_heads=2,
    head_dim=12,
    attention_bias=True,
    use_qk_norm=True,
    n_routed_experts=12,
    num_experts_per_tok=4,
    n_group=3,
    topk_group=2,
    n_shared_experts=2,
    routed_scaling_factor=1.7,
    norm_topk_prob=True,
    num_nextn_predict_layers=0,
    max_position_embeddings=64,
    rms_norm_eps=1e-5,
    rope_parameters={"rope_type": "default", "rope_theta": 50_000.0, "partial_rotary_factor": 0.5},
    tie_word_embeddings=False,
)
# GLM-4.5-Air's attention (no qk-norm) without biases, a quarter of each head rotated, no groups
QUARTER_ROTARY = dict(
    PARITY_CONFIG,
    head_dim=16,
    attention_bias=False,
    use_qk_norm=False,
    n_group=1,
    topk_group=1,
    num_experts_per_tok=3,
    n_shared_experts=1,
    rope_parameters={"rope_type": "default", "rope_theta": 10_000.0, "partial_rotary_factor": 0.25},
)


def hidden_config(**overrides) -> Glm4MoeConfig:
    config = Glm4MoeConfig(**{**PARITY_CONFIG, **overrides})
    config._attn_implementation = "eager"
    return config


def make_glm_checkpoint(folder, config: Glm4MoeConfig, seed: int) -> Glm4MoeForCausalLM:
    """A random HF model saved with ``save_pretrained``: routers N(0, 0.5) (HF's are zeros), the
    score-correction bias U(-0.2, 0.2) (HF's is zero), q/k/v biases N(0, 0.1) and norm weights
    1 + N(0, 0.1)."""
    torch.manual_seed(seed)
    model = Glm4MoeForCausalLM(config).eval()
    with torch.no_grad():
        for name, tensor in model.state_dict().items():
            if name.endswith("mlp.gate.weight"):
                tensor.normal_(0.0, 0.5)
            elif name.endswith("e_score_correction_bias"):
                tensor.uniform_(-0.2, 0.2)
            elif name.endswith("_proj.bias"):
                tensor.normal_(0.0, 0.1)
            elif name.endswith("norm.weight"):
                tensor.copy_(1.0 + 0.1 * torch.randn_like(tensor))
    model.save_pretrained(folder)
    return model
