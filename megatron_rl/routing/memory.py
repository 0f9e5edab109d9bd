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

from dataclasses import dataclass

from megatron_rl.routing.codec import RoutingCodec


def _ceil_div(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True, kw_only=True, slots=True)
class ParallelLayout:
    dp: int = 1
    tp: int = 1
    cp: int = 1
    pp: int = 1
    ep: int = 1
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        for name in ("dp", "tp", "cp", "pp", "ep"):
            value = getattr(self, name)
            if not (isinstance(value, int) and value >= 1):
                raise ValueError(f"{name} must be a positive int, got {value!r}")

    @property
    def world_size(self) -> int:
        return self.dp * self.tp * self.cp * self.pp

    def local_counts(
        self, num_responses: int, tokens_per_response: int, num_moe_layers: int
    ) -> tuple[int, int]:
        """(tokens, MoE layers) of routing state on the fullest rank."""
        tokens = _ceil_div(num_responses, self.dp) * _ceil_div(tokens_per_response, self.cp)
        if self.sequence_parallel:
            tokens = _ceil_div(tokens, self.tp)
        return tokens, _ceil_div(num_moe_layers, self.pp)


def routing_state_bytes(
    codec: RoutingCodec,
    num_responses: int,
    tokens_per_response: int,
    num_moe_layers: int,
    layout: ParallelLayout | None = None,
) -> int:
    """Bytes of routing state for the whole batch (``layout=None``) or on the fullest rank."""
    if layout is None:
        return codec.nbytes(num_responses * tokens_per_response, num_moe_layers)
    tokens, layers = layout.local_counts(num_responses, tokens_per_response, num_moe_layers)
    return codec.nbytes(tokens, layers)
