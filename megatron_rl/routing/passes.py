"""The R2/R3 policy of an RL step: what each forward pass does with routes, in one place.

An RL step runs a *behaviour* pass (the old-logprob pass, no gradient) over every micro-batch,
then *update* passes (forward + backward) over the same micro-batches. Per mode:

| mode | behaviour pass                    | update pass                        |
|------|-----------------------------------|------------------------------------|
| off  | routers route freely              | routers route freely               |
| r2   | record this micro-batch's routing | replay the recording (same key)    |
| r3   | replay the rollout engine's routes | replay the rollout engine's routes |

(``record_only``: the same passes, but nothing is replayed; agreement is measured.) The trainer
calls `ReplayPasses.behaviour` and `ReplayPasses.update` around each micro-batch's forward (and
backward) without knowing the mode; `RoutingReplay` underneath drives megatron's ``RouterReplay``.

Pipeline schedules run many micro-batches' forwards and backwards interleaved (1F1B), so a pass
spans the whole schedule instead: `ReplayPasses.schedule` opens it, and megatron's
``forward_step_func`` calls `before_forward` / `after_forward` around each micro-batch's forward
on this stage (its local MoE layers only), naming the model chunk that runs it (interleaved
pipelines run a micro-batch's chunks at different times: each chunk takes or records its own
layers' routes).

A behaviour pass may run several micro-batches as one merged forward
(`megatron_rl.train.merged_pass`): R3 then replays their routes concatenated, and R2's recording
of the merged forward is split into each micro-batch's own (`ReplayPasses.split_recording`).
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Sequence
from contextlib import AbstractContextManager as ContextManager
from dataclasses import dataclass

import torch

from megatron_rl.routing.alignment import local_token_sources
from megatron_rl.routing.codec import RoutingBlob
from megatron_rl.routing.modes import ReplayConfig


@dataclass(frozen=True, kw_only=True, slots=True)
class TokenLayout:
    """How this rank sees a micro-batch's tokens (tensor / sequence parallelism)."""

    tp_size: int = 1
    tp_rank: int = 0
    sequence_parallel: bool = False

    def __post_init__(self) -> None:
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"TokenLayout: tp_rank={self.tp_rank} not in [0, {self.tp_size})")


@dataclass(frozen=True, slots=True)
class RoutedMicroBatch:
    """What routing replay needs of one padded micro-batch ``[b, seq_len]``."""

    lengths: Sequence[int]  # tokens of each row (prompt + response)
    seq_len: int
    routes: Sequence[RoutingBlob | None]  # per row: the rollout engine's routes (R3), or None


class ReplayPasses:
    """Context managers for the behaviour and update passes of one micro-batch (any mode)."""

    def __init__(self, driver=None, *, mode: str = "off", layout: TokenLayout | None = None):
        if (driver is None) != (mode == "off"):
            raise ValueError(f"mode={mode!r} needs a RoutingReplay driver exactly when not 'off'")
        self.driver = driver
        self.mode = mode
        self.layout = layout or TokenLayout()
        self._sample_route_bytes = 0  # R3: bytes of the engine's routes of this step's samples

    def behaviour(self, key: Hashable, batch: RoutedMicroBatch) -> ContextManager[None]:
        """Around the old-logprob forward of micro-batch ``key``: R2 records, R3 replays."""
        if self.mode == "r2":
            return self.driver.record(key)
        return self._replay(key, batch, "behaviour")

    def update(self, key: Hashable, batch: RoutedMicroBatch) -> ContextManager[None]:
        """Around an update's forward *and* backward of micro-batch ``key``: R2/R3 replay."""
        return self._replay(key, batch, "update")

    def can_merge_behaviour(self) -> bool:
        """Whether the behaviour pass may run several micro-batches as one merged forward
        (`megatron_rl.train.merged_pass`). Not under R2 with sequence parallelism over TP > 1:
        a rank then records a slice of the merged ``[S, B]`` sequence axis, which does not hold
        the slice of a narrower micro-batch's own forward that its updates replay."""
        scattered = self.layout.sequence_parallel and self.layout.tp_size > 1
        return not (self.mode == "r2" and scattered)

    def split_recording(
        self, key: Hashable, num_rows: int, parts: Sequence[tuple[Hashable, int, int, int]]
    ) -> None:
        """R2: the recording of the merged forward ``key`` (``num_rows`` rows ``B``, a full
        sequence axis on this rank) becomes one recording per part ``(part_key, first_row,
        rows, width)``: the router rows ``s * B + first_row + b`` for ``s < width``,
        ``b < rows``, in that order (``[s, b]``), i.e. exactly the rows the part's own
        ``[rows, width]`` forward records. A no-op in the other modes."""
        if self.mode != "r2":
            return
        if not self.can_merge_behaviour():
            raise RuntimeError("R2 recordings of merged forwards cannot be split under SP")
        split = []
        for part_key, first_row, rows, width in parts:
            positions = torch.arange(width, dtype=torch.int64)[:, None] * num_rows
            split.append((part_key, (positions + first_row + torch.arange(rows)).reshape(-1)))
        self.driver.split_recorded(key, split)

    def _replay(self, key: Hashable, batch: RoutedMicroBatch, phase: str) -> ContextManager[None]:
        if self.mode == "off":
            return contextlib.nullcontext()
        routes, counted = self._targets(key, batch, phase)
        return self.driver.replay(routes=routes, phase=phase, counted_rows=counted)

    def _targets(self, key: Hashable, batch: RoutedMicroBatch, phase: str):
        """``(routes per local MoE layer, counted rows)`` to replay into micro-batch ``key``:
        R2's recording, or R3's engine routes (whose bytes the behaviour pass counts in
        ``routing/bytes_per_rank``: they are held from the rollout to the step's last update)."""
        counted = self._counted_rows(batch)
        if self.mode == "r2":
            return self.driver.recorded_routes(key), counted
        if phase == "behaviour":
            self._sample_route_bytes += sum(blob.nbytes for blob in batch.routes if blob)
        return self._engine_routes(batch), counted

    def _counted_rows(self, batch: RoutedMicroBatch) -> torch.Tensor:
        """This rank's router rows whose agreement means something: real tokens, and under R3
        not a sample's final token (the engine never routed it; it replays the row before)."""
        sources = self._sources(batch)
        real = sources.sample_R >= 0
        if self.mode != "r3":
            return real
        lengths = torch.as_tensor(list(batch.lengths), dtype=torch.int64)
        last = lengths[sources.sample_R.clamp(min=0)] - 1
        return real & (sources.position_R < last)

    def _sources(self, batch: RoutedMicroBatch):
        return local_token_sources(
            list(batch.lengths),
            seq_len=batch.seq_len,
            tp_size=self.layout.tp_size,
            tp_rank=self.layout.tp_rank,
            sequence_parallel=self.layout.sequence_parallel,
        )

    # ------------------------------------------------------------------ pipeline schedules
    @contextlib.contextmanager
    def schedule(self, phase: str):
        """One pass over every micro-batch of a pipeline schedule; ``phase``: "behaviour" (the
        old-logprob pass) or "update". Yields ``(before_forward, after_forward)``, two functions
        of ``(key, batch, chunk)`` to call around each micro-batch's forward by model chunk
        ``chunk`` of this stage (0 without interleaving)."""
        if phase not in ("behaviour", "update"):
            raise ValueError(f"phase={phase!r}: use 'behaviour' or 'update'")
        if self.mode == "off":
            yield _nothing, _nothing
            return
        records = self.mode == "r2" and phase == "behaviour"
        if not records:
            self.driver.set_phase(phase)
        self.driver.start_pass("record" if records else "replay")
        succeeded = False
        try:
            if records:
                yield _nothing, lambda key, batch, chunk: self.driver.keep_recorded(key, chunk)
            else:
                pending: dict[Hashable, tuple] = {}  # targets until the last chunk took them
                yield (
                    (lambda key, batch, chunk: self._push(key, batch, phase, chunk, pending)),
                    _nothing,
                )
            succeeded = True
        finally:
            self.driver.finish_pass(succeeded)

    def _push(
        self, key: Hashable, batch: RoutedMicroBatch, phase: str, chunk: int, pending: dict
    ) -> None:
        """Micro-batch ``key``'s targets to chunk ``chunk``: computed once per micro-batch (its
        first chunk's forward) and kept until its last chunk's."""
        if key not in pending:
            pending[key] = self._targets(key, batch, phase)
        routes, counted = pending[key]
        if chunk == self.driver.num_chunks - 1:
            del pending[key]
        self.driver.push(routes, counted, chunk=chunk)

    def _engine_routes(self, batch: RoutedMicroBatch) -> list[torch.Tensor]:
        if any(blob is None for blob in batch.routes):
            raise RuntimeError(
                "R3 needs the rollout engine's routes on every sample, and some have none: the "
                "engine was not asked for routes or did not return them"
            )
        sources = self._sources(batch)
        return self.driver.routes_for_micro_batch(batch.routes, batch.lengths, sources)

    def metrics(self) -> dict[str, float]:
        """This step's routing metrics; empty when off. ``routing/bytes_per_rank``: routing
        bytes this rank held for the step in any mode (R2 recordings, R3 sample routes)."""
        if self.driver is None:
            return {}
        out = self.driver.metrics()
        out["routing/bytes_per_rank"] = out["routing/state_bytes"] + self._sample_route_bytes
        return out

    def end_step(self) -> None:
        """Drop this step's recordings and counts."""
        self._sample_route_bytes = 0
        if self.driver is not None:
            self.driver.end_step()

    def close(self) -> None:
        if self.driver is not None:
            self.driver.close()


def _nothing(key: Hashable, batch: RoutedMicroBatch, chunk: int) -> None:
    del key, batch, chunk


def build_replay_passes(
    model,
    config: ReplayConfig,
    *,
    num_experts: int,
    topk: int,
    moe_layer_numbers: Sequence[int],
    layout: TokenLayout,
    pipeline_group=None,
) -> ReplayPasses:
    """The passes for ``config.mode``; builds the megatron driver only when replay is on.
    ``pipeline_group``: with pipeline stages, the group whose stages' metrics are gathered."""
    if config.mode == "off":
        return ReplayPasses(layout=layout)
    from megatron_rl.routing.replay import RoutingReplay  # megatron-core only when needed

    driver = RoutingReplay(
        model,
        config,
        num_experts=num_experts,
        topk=topk,
        moe_layer_numbers=moe_layer_numbers,
        pipeline_group=pipeline_group,
    )
    return ReplayPasses(driver, mode=config.mode, layout=layout)
