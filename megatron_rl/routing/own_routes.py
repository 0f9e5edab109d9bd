"""The experts a megatron-core ``TopKRouter`` would choose by itself, replay or not.

Routing replay measures how often the router's own choice agrees with the replayed routes. The
own choice is megatron's selection, not a plain top-k of the logits: with the sigmoid router of
DeepSeek-V3 it is the top-k of ``sigmoid(z) + expert_bias`` within the ``group_topk`` best of
``num_groups`` groups, which a top-k of ``z`` misses (it ignores the bias and the groups). This
runs megatron's own ``topk_routing_with_score_function`` on the router's settings without its
``RouterReplay``, so the answer is the selection of an unreplayed forward, for every router
megatron builds (softmax or sigmoid, pre-softmax or not, grouped or not).
"""

from __future__ import annotations

import torch
from megatron.core.transformer.moe.moe_utils import topk_routing_with_score_function


@torch.no_grad()
def own_topk(router: torch.nn.Module, logits_NE: torch.Tensor) -> torch.Tensor:
    """int64 ``[N, K]``, ascending per row: the experts ``router`` selects for ``logits_NE``.

    ``logits_NE``: float ``[N, E]``, the router's gating output (``router.gating(hidden)``).
    Token dropping (capacity) is not applied: the choice is the top-k before any drop.
    """
    config = router.config
    if router.routing_type == "sinkhorn":
        raise ValueError("own_topk: a sinkhorn router has no top-k choice to compare")
    _, routing_map_NE = topk_routing_with_score_function(
        logits_NE,
        router.topk,
        use_pre_softmax=config.moe_router_pre_softmax,
        num_groups=config.moe_router_num_groups,
        group_topk=config.moe_router_group_topk,
        scaling_factor=config.moe_router_topk_scaling_factor,
        score_function=router.score_function,
        expert_bias=router.expert_bias,
        fused=False,
        router_replay=None,
    )
    # exactly K selected experts per row: their positions, ascending
    return routing_map_NE.to(torch.int8).topk(router.topk, dim=-1).indices.sort(dim=-1).values
