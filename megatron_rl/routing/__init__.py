"""Routing replay: routed-expert codecs, memory accounting, token alignment and the R2/R3 driver.

``modes`` (replay modes and `ReplayConfig`) and ``passes`` (the R2/R3 policy of each pass) import
megatron-core only when a driver is built; ``megatron_rl.routing.replay`` (the driver of megatron's
``RouterReplay``) imports it; the rest is pure torch.
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
