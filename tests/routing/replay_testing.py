"""Helpers for the routing-replay tests: a tiny megatron model with RouterReplay, route capture."""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.router import TopKRouter

from megatron_rl.model import ModelOptions, build_model, causal_lm_logits, preset_config
from megatron_rl.moe_layers import moe_layer_numbers
from megatron_rl.routing.replay import ReplayConfig, RoutingReplay


def tiny_moe(recompute: bool = False, **overrides):
    config = preset_config("tiny", **overrides)
    config._attn_implementation = "eager"
    model = build_model(config, ModelOptions(routing_replay=True, recompute=recompute))
    return config, model


def make_driver(model, config, **kwargs) -> RoutingReplay:
    return RoutingReplay(
        model,
        ReplayConfig(**kwargs),
        num_experts=config.num_experts,
        topk=config.num_experts_per_tok,
        moe_layer_numbers=moe_layer_numbers(config),
    )


def chosen_experts(model, run) -> tuple[object, list[torch.Tensor]]:
    """Run ``run()`` and return (its result, per MoE layer the sorted chosen experts [rows, K])."""
    captured: list[torch.Tensor] = []

    def hook(module, args, output):
        routing_map = output[1]  # [rows, E] bool
        k = module.topk
        captured.append(routing_map.float().topk(k, dim=-1).indices.sort(dim=-1).values)

    handles = [m.register_forward_hook(hook) for m in model.modules() if isinstance(m, TopKRouter)]
    try:
        result = run()
    finally:
        for handle in handles:
            handle.remove()
    return result, captured


def perturb_routers(model, scale: float = 5.0, seed: int = 0) -> None:
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for module in model.modules():
            if isinstance(module, TopKRouter):
                module.weight.add_(scale * torch.randn(module.weight.shape, generator=gen))


def logits_of(model, tokens_BT):
    return causal_lm_logits(model, tokens_BT)
