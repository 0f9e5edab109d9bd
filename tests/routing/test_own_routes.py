"""`own_topk` is the choice megatron's router makes, which replay's agreement metric compares.

On DeepSeek-V3's router (sigmoid, score-correction bias, group-limited top-k) a plain top-k of
the logits is another choice: the metric computed that way reported ~0.3-0.4 agreement for
routes that were identical.
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter
from qwen3_moe_testing import fixed_input_ids
from test_deepseek_v3 import hidden_config, make_deepseek_checkpoint

from megatron_rl.model import build_model, causal_lm_logits
from megatron_rl.model.conversion import load_checkpoint
from megatron_rl.routing.own_routes import own_topk


def test_own_topk_equals_the_group_limited_biased_routing_of_a_forward(ws1, tmp_path):
    config = hidden_config()
    make_deepseek_checkpoint(tmp_path / "hf", config, seed=3)
    model = build_model(config)
    load_checkpoint(model, tmp_path / "hf", config)
    model.eval()
    seen = []

    def hook(router, args, output):
        logits_NE = router.gating(args[0]).reshape(-1, router.config.num_moe_experts)
        chosen_NK = output[1].to(torch.int8).topk(router.topk, dim=-1).indices.sort(-1).values
        plain_NK = logits_NE.topk(router.topk, dim=-1).indices.sort(-1).values
        seen.append((own_topk(router, logits_NE), chosen_NK, plain_NK))

    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    handles = [r.register_forward_hook(hook) for r in routers]
    with torch.no_grad():
        causal_lm_logits(model, fixed_input_ids(config.vocab_size, seed=4))
    for handle in handles:
        handle.remove()
    assert len(seen) == 2  # the two MoE layers
    for own, chosen, plain in seen:
        assert torch.equal(own, chosen)
        assert not torch.equal(plain, chosen)  # groups and bias change the choice here
