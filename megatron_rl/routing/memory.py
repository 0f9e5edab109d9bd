"""Exact memory accounting of routing-replay state, for the whole batch and per rank.

The state is one top-k expert set per (token, MoE layer): ``codec.nbytes(tokens, layers)`` bytes
(EPIC, Sec. 10.5: ``M = N T L_MoE K b`` for plain index dtypes). Under a parallel layout each rank
keeps only what its own Megatron forward consumes:

* data parallelism splits the responses (``ceil(N / dp)`` on the fullest rank);
* context parallelism splits each sequence's tokens (``ceil(T / cp)``);
* sequence parallelism splits the remaining tokens again across the tensor-parallel ranks
  (``ceil(. / tp)``); without it every TP rank routes all of its tokens;
* pipeline parallelism splits the MoE layers (``ceil(L / pp)``);
* expert parallelism does not change it: a token's route is held by the rank that holds the token.
"""

from __future__ import annotations

from megatron_rl.parallel import ParallelConfig
from megatron_rl.routing.codec import RoutingCodec


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def local_counts(
    parallel: ParallelConfig,
    data_parallel: int,
    num_responses: int,
    tokens_per_response: int,
    num_moe_layers: int,
) -> tuple[int, int]:
    """(tokens, MoE layers) of routing state on the fullest rank."""
    if not (isinstance(data_parallel, int) and data_parallel >= 1):
        raise ValueError(f"data_parallel must be a positive int, got {data_parallel!r}")
    tokens = _ceil_div(num_responses, data_parallel) * _ceil_div(
        tokens_per_response, parallel.context_parallel
    )
    if parallel.sequence_parallel:
        tokens = _ceil_div(tokens, parallel.tensor_parallel)
    return tokens, _ceil_div(num_moe_layers, parallel.pipeline_parallel)


def routing_state_bytes(
    codec: RoutingCodec,
    num_responses: int,
    tokens_per_response: int,
    num_moe_layers: int,
    parallel: ParallelConfig | None = None,
    data_parallel: int = 1,
) -> int:
    """Bytes of routing state for the whole batch (``parallel=None``) or on the fullest rank."""
    if parallel is None:
        return codec.nbytes(num_responses * tokens_per_response, num_moe_layers)
    tokens, layers = local_counts(
        parallel, data_parallel, num_responses, tokens_per_response, num_moe_layers
    )
    return codec.nbytes(tokens, layers)
