"""Routing-replay modes and their validated config; importable without megatron-core.

* ``off``: routers route freely in every pass.
* ``r2``: the trainer's old-logprob (behaviour) pass records each micro-batch's routing; every
  update pass of the step replays it (routing replay recorded in the trainer).
* ``r3``: routes recorded by the rollout engine travel with the samples and are replayed in the
  behaviour pass and in every update pass (routing replay recorded by the rollout engine).

``record_only`` keeps the recording and comparison but never replays: routers route freely and the
driver measures how often they agree with the recorded / rollout routes.
"""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.routing.codec import CODECS

REPLAY_MODES = ("off", "r2", "r3")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayConfig:
    mode: str = "off"
    record_only: bool = False
    dtype: str = "auto"  # routing codec for stored routes
    measure_agreement: bool = True  # one extra router GEMM per MoE layer and forward

    def __post_init__(self) -> None:
        if self.mode not in REPLAY_MODES:
            raise ValueError(f"mode={self.mode!r} is unknown; choose one of {REPLAY_MODES}")
        if self.dtype not in CODECS:
            raise ValueError(f"dtype={self.dtype!r} is unknown; choose one of {CODECS}")
        if self.record_only and self.mode == "off":
            raise ValueError("record_only needs mode='r2' or 'r3' (the routes to compare with)")
