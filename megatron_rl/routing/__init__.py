"""Routing replay state: codecs for routed-expert indices and their exact memory accounting."""

from megatron_rl.routing.codec import CODECS, RoutingBlob, RoutingCodec
from megatron_rl.routing.memory import ParallelLayout, routing_state_bytes

__all__ = ["CODECS", "ParallelLayout", "RoutingBlob", "RoutingCodec", "routing_state_bytes"]
