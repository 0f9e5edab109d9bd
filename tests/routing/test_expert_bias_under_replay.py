"""What megatron's aux-loss-free bias update sees under routing replay (DeepSeek-V3's router).

megatron-core 0.16.1: ``TopKRouter.routing`` gets its ``routing_map`` from
``topk_routing_with_score_function``, which under ``REPLAY_FORWARD`` / ``REPLAY_BACKWARD`` takes
the replayed indices (``RouterReplay.get_replay_topk``); ``_apply_expert_bias`` then adds that map's
per-expert counts to ``local_tokens_per_expert``, only while grad is enabled, and
``finalize_model_grads`` moves ``expert_bias`` by rate * sign(mean count - count) (all-reduced
over TP x CP x DP). So the update counts the replayed routes, not the router's own choice; the
no-grad old-logprob pass counts nothing. Shared experts have no router and are never replayed.
"""

from __future__ import annotations

import torch
from megatron.core.distributed.finalize_model_grads import _update_router_expert_bias
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplay, RouterReplayAction

from megatron_rl.model import ModelOptions, build_model, preset_config
from megatron_rl.routing.own_routes import own_topk

NUM_TOKENS = 24


def _router_and_model():
    config = preset_config("tiny-deepseek")
    model = build_model(config, ModelOptions(routing_replay=True))
    routers = [m for m in model.modules() if isinstance(m, TopKRouter)]
    return model, routers


def _replayed_forward(router: TopKRouter, hidden_S1H: torch.Tensor, routes_NK: torch.Tensor):
    router.router_replay.set_target_indices(routes_NK)
    router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
    try:
        return router(hidden_S1H)
    finally:
        router.router_replay.clear_router_replay_action()


def test_bias_update_counts_the_replayed_routes_not_the_routers_choice(ws1):
    model, routers = _router_and_model()
    router = routers[0]
    generator = torch.Generator().manual_seed(0)
    hidden_S1H = torch.randn(NUM_TOKENS, 1, router.config.hidden_size, generator=generator)
    with torch.no_grad():
        router.expert_bias.copy_(torch.randn(8, generator=generator) * 0.1)
        own_NK = own_topk(router, router.gating(hidden_S1H).reshape(NUM_TOKENS, -1))
    # replayed routes the router would not choose: experts 0..3 only, skewed to 0
    routes_NK = torch.stack([torch.zeros(NUM_TOKENS), torch.arange(NUM_TOKENS) % 3 + 1], -1)
    routes_NK = routes_NK.long()
    bias_before = router.expert_bias.clone()
    for r in routers:
        r.local_tokens_per_expert.zero_()

    with torch.no_grad():  # the old-logprob pass: nothing is counted
        _replayed_forward(router, hidden_S1H, routes_NK)
    assert router.local_tokens_per_expert.sum() == 0
    _, routing_map_NE = _replayed_forward(router, hidden_S1H, routes_NK)  # an update forward

    replayed_counts = torch.bincount(routes_NK.flatten(), minlength=8).float()
    own_counts = torch.bincount(own_NK.flatten(), minlength=8).float()
    assert torch.equal(routing_map_NE.sum(0).float(), replayed_counts)
    assert torch.equal(router.local_tokens_per_expert.float(), replayed_counts)
    _update_router_expert_bias([model], router.config)  # what finalize_model_grads runs

    rate = router.config.moe_router_bias_update_rate
    want = bias_before + rate * torch.sign(replayed_counts.mean() - replayed_counts)
    from_own = bias_before + rate * torch.sign(own_counts.mean() - own_counts)
    torch.testing.assert_close(router.expert_bias, want, rtol=0, atol=1e-7)
    assert not torch.allclose(router.expert_bias, from_own)  # the test can tell them apart


def test_shared_experts_have_no_router_and_are_never_replayed(ws1):
    model, routers = _router_and_model()
    moe_layers = [m for m in model.modules() if hasattr(m, "shared_experts")]
    assert len(moe_layers) == len(routers) == 2  # layers 2 and 3 (layer 1 is dense)
    for layer in moe_layers:
        assert layer.shared_experts is not None
        shared = list(layer.shared_experts.modules())
        assert not any(isinstance(m, (TopKRouter, RouterReplay)) for m in shared)
        assert not any(hasattr(m, "router_replay") for m in shared)
        # the replayed indices address the routed experts only: n_routed_experts columns
        assert layer.router.config.num_moe_experts == 8
