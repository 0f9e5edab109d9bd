"""Carry-over of unfinished groups (``--carry-over-groups M``): the long tail never stalls a step.

Kimi k1.5's partial rollouts (Kimi Team 2025, sec. 2.6.2), with a fixed batch: each rollout
generates in rounds of at most ``--carry-over-round-tokens C`` new tokens per sample, over a pool
of ``B + M`` groups (``B = --rollout-batch-size`` on this data-parallel rank's share): the groups
carried from the last rollout and the ``B`` drawn for this one (``B + M`` at the first rollout).
After each round, once ``B`` groups have finished (every sample stopped, or reached
``--max-response-length``), the batch is the ``B`` finished groups drawn earliest and the other
``M`` groups, finished or not, are carried to the next rollout, where their unfinished samples
go on from where they stopped (prompt plus response so far, up to ``C`` more tokens a round)
under the weights of that rollout. So a step waits for the ``B`` quickest of ``B + M`` groups,
never for the longest response, and the pool keeps ``M`` groups in flight (the cap).

None lost, none duplicated: every drawn group is trained exactly once, the oldest first (a
finished group waits at most ``ceil(M / B)`` steps; an unfinished one at most ``ceil(L / C)``
rounds more, ``L`` the length limit), so a sample's newest token is at most ``K + ceil(M / B)``
versions behind the trainer (``K`` the rollouts generated ahead, 0 when synchronous). The
``M`` groups still carried at the run's last step are not trained. Checkpoints store the
carried groups (tokens, the engine's log-probs, per-token versions, R3 routes) as of the last
trained step (`state_dict`), so a resume goes on with the same groups; the continuation then
runs under the restored weights.

A sample continued over rounds records per-segment versions (``weight_versions``: the version of
each round's tokens) and its behaviour log-probs are the engine's, token by token (the trainer
requires ``--behavior-logprobs rollout`` or a rollout correction, as for ``--partial-rollout``;
``--mask-stale-tokens`` masks tokens more than ``--max-staleness`` versions old). R3: each
round's routes are kept for the positions that round fed first; the continuation's prefill
routes the earlier tokens again, and those rows are dropped, so every token keeps the route the
engine produced when it first fed it. Determinism: round ``r`` of rollout ``i`` samples with seed
``seed(i) + r``; rows of one round are the unfinished samples in pool order, one engine call per
distinct token budget.

Metrics: ``carry_over/carried_groups`` (after the rollout), ``carry_over/unfinished_samples``
(carried with tokens still to come), ``carry_over/rounds``, ``carry_over/taken_from_earlier``
(groups of the batch drawn before this rollout), ``carry_over/max_age`` (rollouts since the
batch's oldest group was drawn), ``carry_over/spanning_samples`` (samples with tokens of more
than one version).
"""

from __future__ import annotations

import base64
import dataclasses
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import torch

from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.types import RolloutSample, pad_supports


@dataclass(slots=True)
class PartialSample:
    """One sample of a carried group: the response so far, as the engine produced it."""

    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)  # the engine's, one per response token
    spans: list[tuple[int, int, int]] = field(default_factory=list)  # (version, start, end)
    routes: torch.Tensor | None = None  # R3: decoded int64 [P + R - 1, L, K], None otherwise
    finish_reason: str | None = None  # "stop" or "length" once finished; None while running
    # each response token's sampling support ids (--logprobs-on-sampling-support), else None
    supports: list[list[int]] | None = None

    @property
    def finished(self) -> bool:
        return self.finish_reason is not None


@dataclass(slots=True)
class PoolGroup:
    """A drawn prompt's group in the pool: ``prompt`` is its dataset index."""

    prompt: int
    drawn_at: int  # the rollout index that drew it (its age in the metrics)
    samples: list[PartialSample]

    @property
    def finished(self) -> bool:
        return all(s.finished for s in self.samples)


class CarryOver:
    """The rollout pool of one data-parallel rank's generator (see the module docstring).

    ``engine``: a `RolloutEngine`; ``prompt_ids(i)``: dataset record ``i``'s prompt tokens;
    ``codec``: the engine's `RoutingCodec` when routes are returned (R3), else None.
    """

    def __init__(
        self,
        engine,
        *,
        prompt_ids: Callable[[int], Sequence[int]],
        batch_groups: int,
        carry_groups: int,
        group_size: int,
        round_tokens: int,
        max_response_length: int,
        codec=None,
    ) -> None:
        if batch_groups < 1 or carry_groups < 1 or round_tokens < 1:
            raise ValueError(
                f"CarryOver: batch_groups={batch_groups}, carry_groups={carry_groups} and "
                f"round_tokens={round_tokens} must all be >= 1"
            )
        self.engine = engine
        self.prompt_ids = prompt_ids
        self.batch_groups, self.carry_groups = batch_groups, carry_groups
        self.group_size, self.round_tokens = group_size, round_tokens
        self.max_response_length = max_response_length
        self.codec = codec
        self.carried: list[PoolGroup] = []
        # rollout index -> the carried groups after it (checkpoints), as copies: later rounds
        # extend the live samples; serialised only when a checkpoint asks (`state_after`)
        self.after: dict[int, list[PoolGroup]] = {}

    def generate(
        self, prompts: list[int], index: int, params: SamplingParams
    ) -> tuple[list[int], list[RolloutSample], dict[str, float]]:
        """Rollout ``index`` over the carried groups and the newly drawn ``prompts``: the
        batch's prompt indices, its samples (prompt-major, ``group_size`` per prompt, as
        `RolloutEngine.generate` returns them; ``prompt_index`` is the position in the batch)
        and the carry-over metrics."""
        pool = self.carried + [
            PoolGroup(p, index, [PartialSample() for _ in range(self.group_size)]) for p in prompts
        ]
        if len(pool) != self.batch_groups + self.carry_groups:
            raise RuntimeError(
                f"carry-over rollout {index}: {len(self.carried)} carried + {len(prompts)} drawn "
                f"groups, expected {self.batch_groups + self.carry_groups} in the pool"
            )
        rounds = 0
        while rounds == 0 or sum(g.finished for g in pool) < self.batch_groups:
            self._round(pool, dataclasses.replace(params, seed=_round_seed(params.seed, rounds)))
            rounds += 1
        finished = [g for g in pool if g.finished][: self.batch_groups]  # oldest first
        taken = {id(g) for g in finished}
        self.carried = [g for g in pool if id(g) not in taken]
        self.after[index] = [_copy(g) for g in self.carried]
        for old in [i for i in self.after if i < index - 64]:  # a bounded history
            del self.after[old]
        samples = [
            self._sample(g, k, j, s)
            for k, g in enumerate(finished)
            for j, s in enumerate(g.samples)
        ]
        metrics = {
            "carry_over/carried_groups": float(len(self.carried)),
            "carry_over/unfinished_samples": float(
                sum(not s.finished for g in self.carried for s in g.samples)
            ),
            "carry_over/rounds": float(rounds),
            "carry_over/taken_from_earlier": float(sum(g.drawn_at < index for g in finished)),
            "carry_over/max_age": float(max(index - g.drawn_at for g in finished)),
            "carry_over/spanning_samples": float(
                sum(len({v for v, _, _ in s.weight_versions}) > 1 for s in samples)
            ),
        }
        return [g.prompt for g in finished], samples, metrics

    def _round(self, pool: list[PoolGroup], params: SamplingParams) -> None:
        """Up to ``round_tokens`` more tokens for every unfinished sample of ``pool``."""
        by_budget: dict[int, list[tuple[PoolGroup, PartialSample]]] = {}
        for group in pool:
            for sample in group.samples:
                if not sample.finished:
                    left = self.max_response_length - len(sample.response)
                    by_budget.setdefault(min(self.round_tokens, left), []).append((group, sample))
        for budget, rows in sorted(by_budget.items(), reverse=True):
            inputs = [[*self.prompt_ids(g.prompt), *s.response] for g, s in rows]
            out = self.engine.generate(
                inputs,
                dataclasses.replace(params, max_new_tokens=budget),
                n=1,
                return_routed_experts=self.codec is not None,
            )
            for (_, sample), piece in zip(rows, out, strict=True):
                self._extend(sample, piece)

    def _extend(self, sample: PartialSample, piece: RolloutSample) -> None:
        """Append one round's ``piece`` to ``sample``."""
        start = len(sample.response)
        new = piece.response_ids_R.tolist()
        sample.response.extend(new)
        sample.logprobs.extend(piece.logprobs_R.tolist())
        segments = piece.weight_versions or ((piece.weight_version, 0, len(new)),)
        for version, lo, hi in segments:
            last = sample.spans[-1] if sample.spans else None
            if last is not None and last[0] == version and last[2] == start + lo:
                sample.spans[-1] = (version, last[1], start + hi)
            else:
                sample.spans.append((version, start + lo, start + hi))
        if piece.support_RK is not None:
            rows = [row[row >= 0].tolist() for row in piece.support_RK]
            sample.supports = (sample.supports or []) + rows
        if self.codec is not None:
            routes = self.codec.decode(piece.routes)
            if sample.routes is not None:  # keep the rows an earlier round fed first
                routes = torch.cat([sample.routes, routes[sample.routes.shape[0] :]])
            sample.routes = routes
        if piece.finish_reason == "stop" or len(sample.response) >= self.max_response_length:
            sample.finish_reason = (
                piece.finish_reason if piece.finish_reason == "stop" else "length"
            )

    def _sample(self, group: PoolGroup, k: int, j: int, s: PartialSample) -> RolloutSample:
        versions = tuple(s.spans) if len({v for v, _, _ in s.spans}) > 1 else ()
        return RolloutSample(
            prompt_index=k,
            sample_index=j,
            prompt_ids_P=torch.tensor(list(self.prompt_ids(group.prompt)), dtype=torch.int64),
            response_ids_R=torch.tensor(s.response, dtype=torch.int64),
            logprobs_R=torch.tensor(s.logprobs, dtype=torch.float32),
            finish_reason=s.finish_reason,
            weight_version=min(v for v, _, _ in s.spans),
            weight_versions=versions,
            routes=self.codec.encode(s.routes) if s.routes is not None else None,
            support_RK=None
            if s.supports is None
            else pad_supports([torch.tensor(row, dtype=torch.int32) for row in s.supports]),
        )

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self) -> dict:
        """The carried groups as JSON-able data (routes as base64 of their int16/int32 rows)."""
        return _state(self.carried)

    def state_after(self, index: int) -> dict:
        """The state after rollout ``index`` (-1: before the first: empty)."""
        return _state(self.after[index] if index >= 0 else [])

    def load_state_dict(self, state: dict, index: int) -> None:
        """The carried groups of a checkpoint taken after rollout ``index``."""
        groups = [_group_from_state(g) for g in state["groups"]]
        if len(groups) not in (0, self.carry_groups):
            raise ValueError(
                f"the checkpoint carries {len(groups)} groups on this data-parallel rank, but "
                f"--carry-over-groups gives {self.carry_groups} per rank: resume with the "
                "checkpoint's --carry-over-groups and data-parallel size"
            )
        self.carried = groups
        self.after = {index: [_copy(g) for g in groups]}


def _copy(group: PoolGroup) -> PoolGroup:
    """A snapshot of ``group`` (routes are replaced by later rounds, never changed in place)."""
    samples = [
        dataclasses.replace(
            s, response=list(s.response), logprobs=list(s.logprobs), spans=list(s.spans)
        )
        for s in group.samples
    ]
    return PoolGroup(group.prompt, group.drawn_at, samples)


def _state(groups: list[PoolGroup]) -> dict:
    return {"groups": [_group_state(g) for g in groups]}


def _round_seed(seed: int | None, round_index: int) -> int | None:
    return None if seed is None else seed + 104_729 * round_index


def _group_state(group: PoolGroup) -> dict:
    return {
        "prompt": group.prompt,
        "drawn_at": group.drawn_at,
        "samples": [
            {
                "response": list(s.response),
                "logprobs": list(s.logprobs),
                "spans": [list(span) for span in s.spans],
                "finish_reason": s.finish_reason,
                "routes": None if s.routes is None else _tensor_state(s.routes),
                "supports": s.supports,
            }
            for s in group.samples
        ],
    }


def _group_from_state(state: dict) -> PoolGroup:
    samples = [
        PartialSample(
            response=[int(t) for t in s["response"]],
            logprobs=[float(x) for x in s["logprobs"]],
            spans=[tuple(int(x) for x in span) for span in s["spans"]],
            routes=None if s["routes"] is None else _tensor_from_state(s["routes"]),
            finish_reason=s["finish_reason"],
            supports=s.get("supports"),
        )
        for s in state["samples"]
    ]
    return PoolGroup(int(state["prompt"]), int(state["drawn_at"]), samples)


def _tensor_state(routes: torch.Tensor) -> dict:
    small = routes.to(
        torch.int16 if (routes.numel() == 0 or int(routes.max()) < 2**15) else torch.int32
    )
    return {
        "dtype": str(small.dtype).removeprefix("torch."),
        "shape": list(small.shape),
        "data": base64.b64encode(small.contiguous().numpy().tobytes()).decode("ascii"),
    }


def _tensor_from_state(state: dict) -> torch.Tensor:
    dtype = getattr(torch, state["dtype"])
    raw = bytearray(base64.b64decode(state["data"]))
    flat = torch.frombuffer(raw, dtype=dtype) if raw else torch.empty(0, dtype=dtype)
    return flat.reshape(state["shape"]).to(torch.int64)
