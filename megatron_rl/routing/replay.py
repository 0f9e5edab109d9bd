"""Routing replay (R2 / R3) driven through megatron-core's own ``RouterReplay`` API.

The model is built with ``ModelOptions(routing_replay=True)`` so that every ``TopKRouter`` owns a
``RouterReplay``; this driver only sets its action (RECORD / REPLAY_FORWARD / REPLAY_BACKWARD)
and its target indices, and observes routers with standard forward hooks. Nothing in megatron is
patched.

* **R2** (``mode="r2"``): the old-logprob pass records each micro-batch's routing on this rank
  (``record``), stored encoded with ``RoutingCodec``; every update pass of the step replays it into
  the same micro-batch (``replay(key=...)``).
* **R3** (``mode="r3"``): routes recorded by the rollout engine are aligned to this rank's rows
  (``routes_for_micro_batch``, see ``alignment``) and replayed in the old-logprob pass and the
  updates (``replay(routes=...)``).
* ``record_only=True``: nothing is replayed; the router routes freely and the driver measures how
  often it agrees with the recorded / rollout routes (the train-inference routing mismatch).

Schedules: ``push`` sets one micro-batch's targets right before its forward (call it from a
megatron ``forward_step_func`` for pipeline schedules); after each forward of a model chunk a
forward hook switches that chunk's routers to REPLAY_BACKWARD, so activation recompute in the
backward pass pops the same targets (FIFO, as 1F1B runs backwards in forward order). Under
interleaved pipeline parallelism the model chunks run one micro-batch's forward at different
times, so ``push(..., chunk=c)`` and ``keep_recorded(key, chunk=c)`` act on chunk ``c``'s routers
only, and each chunk counts its own micro-batches (every chunk runs its backwards in its forward
order too). ``end_pass``
checks that every pushed route was consumed exactly once by the forward (and once by the
recompute when a backward ran) and raises ``RuntimeError`` naming the layer and the counts.
The ``record`` / ``replay`` context managers wrap this for one micro-batch.

Storage: only this rank's rows of its own micro-batches and only the MoE layers of its pipeline
stage; ``state_bytes()`` is exact. ``end_step()`` clears everything between RL steps.
"""

from __future__ import annotations

import contextlib
from collections.abc import Hashable, Iterator, Sequence

import torch
from megatron.core.transformer.moe.router import TopKRouter
from megatron.core.transformer.moe.router_replay import RouterReplayAction

from megatron_rl.collectives import sum_over_ranks
from megatron_rl.routing.alignment import TokenSources, gather_routes
from megatron_rl.routing.codec import RoutingBlob, RoutingCodec
from megatron_rl.routing.modes import REPLAY_MODES, ReplayConfig
from megatron_rl.routing.own_routes import own_topk

__all__ = ["PHASES", "REPLAY_MODES", "ReplayConfig", "RoutingReplay"]

PHASES = ("behaviour", "update")


class RoutingReplay:
    """Drives the ``RouterReplay`` of every MoE layer of this rank's model chunks."""

    def __init__(
        self,
        model: torch.nn.Module | Sequence[torch.nn.Module],
        config: ReplayConfig,
        *,
        num_experts: int,
        topk: int,
        moe_layer_numbers: Sequence[int],
        pipeline_group=None,
    ) -> None:
        chunks = list(model) if isinstance(model, Sequence) else [model]
        self.config = config
        self.codec = RoutingCodec(num_experts, topk, config.dtype)
        self.routers: list[TopKRouter] = []
        self._chunk_of: list[int] = []
        for c, chunk in enumerate(chunks):
            for module in chunk.modules():
                if isinstance(module, TopKRouter):
                    self.routers.append(module)
                    self._chunk_of.append(c)
        if config.mode != "off" and any(r.router_replay is None for r in self.routers):
            raise ValueError(
                "routing replay needs routers with a RouterReplay: build the model with "
                "ModelOptions(routing_replay=True)"
            )
        self.layer_numbers = [int(r.layer_number) for r in self.routers]
        missing = sorted(set(self.layer_numbers) - set(moe_layer_numbers))
        if missing:
            raise ValueError(f"model has MoE layers {missing} not in moe_layer_numbers")
        self.layer_columns = [list(moe_layer_numbers).index(n) for n in self.layer_numbers]
        self.moe_layer_numbers = [int(n) for n in moe_layer_numbers]
        self.pipeline_group = pipeline_group  # stages whose layers the metrics gather
        self._recorded: dict[Hashable, RoutingBlob] = {}
        num_layers = len(self.routers)
        # agreement counts per phase: "behaviour" (old-logprob pass: R3's engine routes vs the
        # trainer at the same weights, the train-inference mismatch) and "update" (after each
        # optimizer step: the policy's own drift from the replayed routes)
        self._agree = {p: torch.zeros(num_layers, dtype=torch.float64) for p in PHASES}
        self._seen = {p: torch.zeros(num_layers, dtype=torch.float64) for p in PHASES}
        self._phase = "update"
        self.num_chunks = len(chunks)
        self._reset_pass()
        self._handles = [
            router.register_forward_pre_hook(self._make_router_hook(j))
            for j, router in enumerate(self.routers)
        ]
        self._chunk_in_forward = [False] * len(chunks)
        for c, chunk in enumerate(chunks):
            self._handles.append(chunk.register_forward_pre_hook(self._make_chunk_hook(c, True)))
            self._handles.append(chunk.register_forward_hook(self._make_chunk_hook(c, False)))

    # ------------------------------------------------------------------ pass primitives
    def _reset_pass(self) -> None:
        num_layers = len(self.routers)
        self._kind: str | None = None
        self._pushed = [0] * self.num_chunks  # micro-batches pushed / recorded, per chunk
        self._forward_calls = [0] * num_layers
        self._recompute_calls = [0] * num_layers
        self._targets: list[torch.Tensor | None] = [None] * num_layers
        self._counted: list[torch.Tensor | None] = [None] * self.num_chunks
        # R2 under interleaving: a micro-batch's recording, chunk by chunk, until all recorded
        self._partial: dict[Hashable, dict[int, torch.Tensor]] = {}

    def start_pass(self, kind: str) -> None:
        """Begin a ``"record"`` or ``"replay"`` pass over one or more micro-batches."""
        if self.config.mode == "off":
            raise RuntimeError("routing replay is off; no pass to start")
        if kind not in ("record", "replay"):
            raise ValueError(f"kind={kind!r}: use 'record' or 'replay'")
        if self._kind is not None:
            raise RuntimeError(f"a {self._kind!r} pass is still open; call end_pass() first")
        self._reset_pass()
        self._kind = kind
        if kind == "record":  # recording never changes the routing, also in record_only mode
            self._set_action(RouterReplayAction.RECORD)

    def _chunk_layers(self, chunk: int | None) -> list[int]:
        """Indices into ``self.routers`` of model chunk ``chunk``'s routers (None: all)."""
        if chunk is not None and not 0 <= chunk < self.num_chunks:
            raise ValueError(f"chunk={chunk}: this rank has {self.num_chunks} model chunk(s)")
        return [j for j, c in enumerate(self._chunk_of) if chunk is None or c == chunk]

    def _chunks(self, chunk: int | None) -> list[int]:
        return list(range(self.num_chunks)) if chunk is None else [chunk]

    def push(
        self,
        routes_per_layer: Sequence[torch.Tensor],
        counted_rows: torch.Tensor | None = None,
        chunk: int | None = None,
    ) -> None:
        """Targets ``[rows, K]`` per local MoE layer for the next micro-batch forward.

        ``counted_rows`` (bool ``[rows]``): the rows whose agreement is measured (real tokens
        with a real route); None counts every row. ``chunk``: only that model chunk's routers
        take their targets (interleaved pipeline: its forward of the micro-batch comes next;
        the other chunks' targets stay those of the micro-batches they run); None: all."""
        if self._kind != "replay":
            raise RuntimeError("push() needs an open replay pass (start_pass('replay'))")
        if len(routes_per_layer) != len(self.routers):
            raise RuntimeError(
                f"got routes for {len(routes_per_layer)} MoE layers, this rank has "
                f"{len(self.routers)} (layers {self.layer_numbers})"
            )
        layers = self._chunk_layers(chunk)
        for j in layers:  # on each router's device: decoded routes arrive on the CPU
            router = self.routers[j]
            target = routes_per_layer[j].to(device=router.weight.device, dtype=torch.int64)
            self._targets[j] = target
            if not self.config.record_only:
                router.router_replay.set_target_indices(target)
                router.router_replay.set_router_replay_action(RouterReplayAction.REPLAY_FORWARD)
        for c in self._chunks(chunk):
            self._counted[c] = counted_rows
            self._pushed[c] += 1

    def pop_recorded(self, chunk: int | None = None) -> torch.Tensor:
        """``[rows, local_layers, K]`` routing of the micro-batch the record pass just ran
        (``chunk``: only that model chunk's layers, its forward just ran); ``[0, 0, K]`` where
        those layers are dense only (they route nothing)."""
        if self._kind != "record":
            raise RuntimeError("pop_recorded() needs an open record pass")
        layers = self._chunk_layers(chunk)
        for c in self._chunks(chunk):
            self._pushed[c] += 1
        if not layers:
            return torch.empty((0, 0, self.codec.topk), dtype=torch.int64)
        recorded = [self.routers[j].router_replay.get_recorded_indices() for j in layers]
        for j, indices in zip(layers, recorded, strict=True):
            if indices is None:
                raise RuntimeError(
                    f"MoE layer {self.layer_numbers[j]} recorded nothing: did the forward run?"
                )
        for j in layers:
            self.routers[j].router_replay.record_indices(None)
        return torch.stack(recorded, dim=1)

    def end_pass(self) -> None:
        """Check that every route was consumed exactly once; clear megatron's replay state."""
        try:
            if self._partial:
                raise RuntimeError(
                    "micro-batches recorded by some model chunks only: "
                    + ", ".join(f"{k!r} by chunks {sorted(v)}" for k, v in self._partial.items())
                )
            for j, number in enumerate(self.layer_numbers):
                pushed = self._pushed[self._chunk_of[j]]
                # activation recompute replays once per micro-batch, or not at all (no backward)
                expected_recompute = pushed if self._recompute_configured() else 0
                forward, recompute = self._forward_calls[j], self._recompute_calls[j]
                if forward != pushed or recompute not in (0, expected_recompute):
                    raise RuntimeError(
                        f"MoE layer {number}: {pushed} micro-batch(es) of routes, consumed "
                        f"{forward} time(s) by forward and {recompute} by backward recompute "
                        f"(expected {pushed} and {expected_recompute})"
                    )
        finally:
            for router in self.routers:
                if router.router_replay is not None:
                    router.router_replay.clear_indices()
                    router.router_replay.clear_router_replay_action()
            self._reset_pass()

    def _recompute_configured(self) -> bool:
        return bool(self.routers) and self.routers[0].config.recompute_granularity is not None

    def _set_action(self, action: RouterReplayAction, chunk: int | None = None) -> None:
        for router, c in zip(self.routers, self._chunk_of, strict=True):
            if chunk is None or c == chunk:
                router.router_replay.set_router_replay_action(action)

    # ------------------------------------------------------------------ hooks
    def _make_chunk_hook(self, chunk: int, entering: bool):
        def hook(module, *args):
            del module, args
            self._chunk_in_forward[chunk] = entering
            replaying = self._kind == "replay" and not self.config.record_only
            if not entering and replaying:
                self._set_action(RouterReplayAction.REPLAY_BACKWARD, chunk)

        return hook

    def _make_router_hook(self, j: int):
        def hook(module: TopKRouter, args) -> None:
            if self._kind is None:
                return
            hidden = args[0]
            rows = hidden.numel() // hidden.shape[-1]
            if not self._chunk_in_forward[self._chunk_of[j]]:  # activation recompute in backward
                self._recompute_calls[j] += 1
                if self._kind == "replay" and not self.config.record_only:
                    pending = module.router_replay.replay_backward_list
                    self._check_rows(j, rows, pending[0] if pending else None, "recompute")
                return
            self._forward_calls[j] += 1
            if self._kind == "replay":
                target = self._targets[j]
                if not self.config.record_only:
                    self._check_rows(j, rows, target, "forward")
                if self.config.measure_agreement:
                    self._count_agreement(j, module, hidden, target)

        return hook

    def _check_rows(self, j: int, rows: int, target: torch.Tensor | None, when: str) -> None:
        if target is None:
            raise RuntimeError(
                f"MoE layer {self.layer_numbers[j]}: {when} needs replayed routes but none are left"
            )
        if target.shape[0] != rows:
            raise RuntimeError(
                f"MoE layer {self.layer_numbers[j]}: the {when} routes {rows} local tokens but "
                f"{target.shape[0]} replay rows were given; the routes do not belong to this "
                "micro-batch / rank"
            )

    @torch.no_grad()
    def _count_agreement(self, j, router, hidden, target) -> None:
        if target.shape[0] * target.shape[1] == 0:
            return
        logits = router.gating(hidden).reshape(-1, router.config.num_moe_experts)
        own = own_topk(router, logits)  # megatron's choice: score function, bias, groups
        if own.shape != target.shape:
            raise RuntimeError(
                f"MoE layer {self.layer_numbers[j]}: router chose {tuple(own.shape)} routes, "
                f"targets are {tuple(target.shape)}"
            )
        same = (own == target.to(own.device).sort(dim=-1).values).all(dim=-1)
        counted = self._counted[self._chunk_of[j]]
        if counted is not None:  # padding rows and rows without a route of their own
            same = same[counted.to(same.device)]
        self._agree[self._phase][j] += same.sum().item()
        self._seen[self._phase][j] += same.numel()

    def keep_recorded(self, key: Hashable, chunk: int | None = None) -> None:
        """Store the routing the record pass just ran (one micro-batch) under ``key`` (R2).

        ``chunk``: only that model chunk's forward ran (interleaved pipeline); the micro-batch's
        recording is stored once every chunk has recorded it, and a chunk recording a key twice
        is an error (a route would be kept for the wrong micro-batch)."""
        if chunk is None or self.num_chunks == 1:
            self._recorded[key] = self.codec.encode(self.pop_recorded(chunk))
            return
        parts = self._partial.setdefault(key, {})
        if chunk in parts or key in self._recorded:
            raise RuntimeError(f"model chunk {chunk} recorded micro-batch {key!r} twice")
        parts[chunk] = self.pop_recorded(chunk)
        if len(parts) < self.num_chunks:
            return
        del self._partial[key]
        held = [parts[c] for c in range(self.num_chunks) if parts[c].shape[1]]
        whole = torch.cat(held, dim=1) if held else parts[0]  # chunk order = self.routers order
        self._recorded[key] = self.codec.encode(whole.contiguous())

    def split_recorded(self, key: Hashable, parts: Sequence[tuple[Hashable, torch.Tensor]]) -> None:
        """Replace the recording under ``key`` by one per ``(part_key, rows)``: its rows
        ``rows`` (int64 ``[n]``, indices into the recording's rows, in the order given). A
        merged forward's recording becomes the recordings its micro-batches' own forwards
        would have kept (see `megatron_rl.train.merged_pass`)."""
        if key not in self._recorded:
            raise RuntimeError(f"no routes were recorded under key {key!r} in this step")
        decoded = self.codec.decode(self._recorded.pop(key))  # [rows, local_layers, K]
        for part_key, rows in parts:
            if part_key in self._recorded:
                raise RuntimeError(f"routes are already recorded under key {part_key!r}")
            part = decoded[rows] if decoded.shape[1] else decoded  # no local MoE layer: empty
            self._recorded[part_key] = self.codec.encode(part.contiguous())

    def recorded_routes(self, key: Hashable) -> list[torch.Tensor]:
        """Per local MoE layer ``[rows, K]``: the routes recorded under ``key`` in this step."""
        if key not in self._recorded:
            raise RuntimeError(f"no routes were recorded under key {key!r} in this step")
        decoded = self.codec.decode(self._recorded[key])
        return [decoded[:, j] for j in range(decoded.shape[1])]

    # ------------------------------------------------------------------ one micro-batch
    @contextlib.contextmanager
    def record(self, key: Hashable) -> Iterator[None]:
        """Record the routing of the forward run inside; store it under ``key`` (R2)."""
        self.start_pass("record")
        succeeded = False
        try:
            yield
            self.keep_recorded(key)
            succeeded = True
        finally:
            self._finish(succeeded)

    @contextlib.contextmanager
    def replay(
        self,
        *,
        key: Hashable | None = None,
        routes: Sequence[torch.Tensor] | None = None,
        phase: str = "update",
        counted_rows: torch.Tensor | None = None,
    ) -> Iterator[None]:
        """Replay (or, record_only, compare with) R2 routes under ``key`` or given ``routes``.

        Run the forward *and* the backward inside the block when activation recompute is on.
        ``phase`` ("behaviour" or "update") is where the agreement counts go; ``counted_rows``
        see `push`.
        """
        if (key is None) == (routes is None):
            raise ValueError("pass exactly one of key (R2) and routes (R3)")
        self.set_phase(phase)
        if routes is None:
            routes = self.recorded_routes(key)
        self.start_pass("replay")
        succeeded = False
        try:
            self.push(routes, counted_rows)
            yield
            succeeded = True
        finally:
            self._finish(succeeded)

    def set_phase(self, phase: str) -> None:
        """Count the agreement of the replay passes that follow under ``phase``."""
        if phase not in PHASES:
            raise ValueError(f"phase={phase!r}: choose one of {PHASES}")
        self._phase = phase

    def finish_pass(self, succeeded: bool) -> None:
        """`end_pass` after a pass that succeeded; after a failed one, clear quietly (the
        failure's own error is the one to see)."""
        self._finish(succeeded)

    def _finish(self, succeeded: bool) -> None:
        if succeeded:
            self.end_pass()
            return
        with contextlib.suppress(RuntimeError):  # the body's own error is the one to see
            self.end_pass()

    # ------------------------------------------------------------------ R3 alignment
    def keep_local_layers(self, blob: RoutingBlob) -> RoutingBlob:
        """Re-encode a sample's routes keeping only this pipeline stage's MoE layers."""
        if blob.num_layers == len(self.routers):
            return blob
        decoded = self._codec_for(blob).decode(blob)
        return self.codec.encode(decoded[:, self.layer_columns].contiguous())

    def routes_for_micro_batch(
        self,
        sample_blobs: Sequence[RoutingBlob],
        lengths: Sequence[int],
        sources: TokenSources,
    ) -> list[torch.Tensor]:
        """Per local MoE layer ``[rows, K]`` targets from rollout-engine routes (R3)."""
        decoded, columns = [], None
        for blob in sample_blobs:
            decoded.append(self._codec_for(blob).decode(blob))
            local = blob.num_layers == len(self.routers)
            blob_columns = list(range(len(self.routers))) if local else self.layer_columns
            if columns not in (None, blob_columns):
                raise ValueError("sample routes mix full-model and stage-local layer sets")
            columns = blob_columns
        return gather_routes(decoded, list(lengths), sources, columns, r3_rows=True)

    def _codec_for(self, blob: RoutingBlob) -> RoutingCodec:
        """The codec a blob was encoded with (an engine may use another dtype than the driver)."""
        if blob.codec == self.codec.codec:
            return self.codec
        return RoutingCodec(self.codec.num_experts, self.codec.topk, blob.codec)

    # ------------------------------------------------------------------ step state
    def state_bytes(self) -> int:
        """Bytes of routing state this driver holds on this rank (R2 recordings)."""
        return sum(blob.nbytes for blob in self._recorded.values())

    def metrics(self) -> dict[str, float]:
        """``routing/state_bytes`` (R2 recordings) and, per phase that compared routes,
        ``routing/agreement/<phase>`` (share of token-layers whose top-k set equals the target)
        with ``routing/agreement/<phase>/layer_<n>`` per MoE layer of the whole model (global
        layer numbers). With pipeline stages the counts are summed over ``pipeline_group``
        (a collective: every stage calls it), so every stage reports every layer."""
        out = {"routing/state_bytes": float(self.state_bytes())}
        total = len(self.moe_layer_numbers)
        counts = torch.zeros(2 * len(PHASES), total, dtype=torch.float64)
        for i, phase in enumerate(PHASES):  # this stage's layers into the model's columns
            counts[2 * i, self.layer_columns] = self._agree[phase]
            counts[2 * i + 1, self.layer_columns] = self._seen[phase]
        if self.pipeline_group is not None:
            summed = sum_over_ranks(counts.flatten().tolist(), self.pipeline_group)
            counts = torch.tensor(summed, dtype=torch.float64).view_as(counts)
        for i, phase in enumerate(PHASES):
            agree, seen = counts[2 * i], counts[2 * i + 1]
            if seen.sum() == 0:
                continue
            out[f"routing/agreement/{phase}"] = float(agree.sum() / seen.sum())
            for j, number in enumerate(self.moe_layer_numbers):
                if seen[j] > 0:
                    out[f"routing/agreement/{phase}/layer_{number}"] = float(agree[j] / seen[j])
        return out

    def end_step(self) -> None:
        """Drop this step's recordings and agreement counts."""
        if self._kind is not None:
            raise RuntimeError(f"end_step() with a {self._kind!r} pass still open")
        self._recorded.clear()
        for phase in PHASES:
            self._agree[phase].zero_()
            self._seen[phase].zero_()

    def close(self) -> None:
        for handle in self._handles:
            handle.remove()
        self._handles.clear()
