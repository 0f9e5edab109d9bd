"""Routing replay: routed-expert codecs, memory accounting, token alignment and the R2/R3 driver.

``megatron_rl.routing.replay`` imports megatron-core; the rest is pure torch.
"""

from megatron_rl.routing.alignment import TokenSources, gather_routes, local_token_sources
from megatron_rl.routing.codec import CODECS, RoutingBlob, RoutingCodec
from megatron_rl.routing.memory import local_counts, routing_state_bytes

__all__ = [
    "CODECS",
    "RoutingBlob",
    "RoutingCodec",
    "TokenSources",
    "gather_routes",
    "local_counts",
    "local_token_sources",
    "routing_state_bytes",
]
