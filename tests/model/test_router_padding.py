"""Padded tokens out of the aux-loss-free expert-bias counts (megatron_rl/model/router_padding.py).

The trainer's padding mask reaches megatron's routers through ``GPTModel.forward``; megatron-core
0.16.1's own ``_apply_expert_bias`` cannot take it (the mask broadcasts against the expert axis),
`ExpertBiasPaddingRouter` counts the unpadded tokens' routes only.
"""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_rl.model import build_model, preset_config
from megatron_rl.model.router_padding import ExpertBiasPaddingRouter, padding_mask_BS
from megatron_rl.train.logprobs import forward_logits

LENGTHS = [7, 4, 10]
SEQ = 10


def test_expert_bias_counts_leave_out_padded_tokens(ws1):
    config = preset_config("tiny-deepseek")
    model = build_model(config)
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    assert routers and all(type(r) is ExpertBiasPaddingRouter for r in routers)
    maps = []
    for router in routers:
        router.local_tokens_per_expert.zero_()
        router.register_forward_hook(lambda m, a, out: maps.append(out[1].detach().clone()))
    tokens_BS = torch.randint(0, config.vocab_size, (len(LENGTHS), SEQ))
    mask_BS = padding_mask_BS(model, LENGTHS, SEQ, "cpu")
    assert mask_BS.sum().item() == len(LENGTHS) * SEQ - sum(LENGTHS)

    forward_logits(model, tokens_BS, mask_BS)  # grad enabled: an update forward counts

    valid_N = ~mask_BS.transpose(0, 1).reshape(-1)  # megatron's token order: s * b + b_idx
    for router, routing_map_NE in zip(routers, maps, strict=True):
        want_E = routing_map_NE[valid_N].sum(dim=0)
        assert torch.equal(router.local_tokens_per_expert, want_E.to(torch.float32))
        assert router.local_tokens_per_expert.sum() == sum(LENGTHS) * config.num_experts_per_tok
        assert not torch.equal(want_E, routing_map_NE.sum(dim=0))  # the padding was routed


def test_megatron_0_16_1_expert_bias_count_cannot_take_the_padding_mask(ws1):
    """The upstream gap the workaround bridges: ``routing_map [N, E] & ~padding_mask [N]``. When
    megatron fixes it, this fails: `ExpertBiasPaddingRouter` may then go."""
    model = build_model(preset_config("tiny-deepseek"))
    router = next(m for m in model.modules() if isinstance(m, TopKRouter))
    routing_map_NE = torch.zeros(30, router.config.num_moe_experts, dtype=torch.bool)
    with pytest.raises(RuntimeError, match="must match the size"):
        TopKRouter._apply_expert_bias(router, routing_map_NE, torch.zeros(30, dtype=torch.bool))
