"""Routing replay state: codecs for routed-expert indices and their exact memory accounting."""

from megatron_rl.routing.codec import CODECS, RoutingBlob, RoutingCodec
from megatron_rl.routing.memory import local_counts, routing_state_bytes

__all__ = ["CODECS", "RoutingBlob", "RoutingCodec", "local_counts", "routing_state_bytes"]
