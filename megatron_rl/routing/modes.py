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

from megatron_rl.flags import check_choice, option
from megatron_rl.routing.codec import CODECS

REPLAY_MODES = ("off", "r2", "r3")


@dataclass(frozen=True, kw_only=True, slots=True)
class ReplayConfig:
    """Routing replay: R2 (recorded by the trainer) or R3 (recorded by the rollout engine)."""

    mode: str = option("off", name="routing-replay", choices=REPLAY_MODES, help="off, r2 or r3")
    record_only: bool = option(
        False,
        name="routing-record-only",
        help="record and compare routes (routing/agreement/* metrics) but never replay them",
    )
    dtype: str = option(
        "auto",
        name="routing-dtype",
        choices=CODECS,
        help="codec of stored routes: auto (smallest integer type that holds the expert ids), "
        "uint8, int16, int32 or packed (bit-packed)",
    )
    measure_agreement: bool = True  # one extra router GEMM per MoE layer and forward

    def __post_init__(self) -> None:
        check_choice(self, "mode", REPLAY_MODES)
        check_choice(self, "dtype", CODECS)
        if self.record_only and self.mode == "off":
            raise ValueError("--routing-record-only needs --routing-replay r2 or r3")
