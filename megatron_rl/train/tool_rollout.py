"""A multi-turn rollout function with a tool: the calculator task's (``--task calculator``).

`calculator_rollout` follows the rollout-function contract
(`megatron_rl.train.rollout_function`). Each sample is an episode of turns:

1. turn 0 generates ``n`` samples per prompt, as the single-turn rollout does, with ``]`` (the
   end of a tool call) as one more stop token;
2. a turn that ends with ``]`` gets the tool's answer appended
   (`megatron_rl.data.calculator_task.tool_answer`) and the episode goes on: the next turn
   generates one continuation of ``prompt + response so far`` (its own sampling seed, derived
   from the run's);
3. an episode ends at ``<eos>``, at the token budget (``max_response_length`` for the whole
   response, tool tokens included: a turn's tokens beyond it are dropped, finish reason
   ``length``; a call whose answer would leave no room for one more model token is not answered,
   the episode ends at its ``]`` with finish reason ``length``), or after `MAX_TURNS` turns (a
   call in the last turn is not answered).

The returned response is every token after the prompt, the model's and the tool's; its loss mask
is False on the tool's tokens, whose log-probs are set to 0 (the policy never sampled them, so
no behaviour log-prob exists). The episode's reward is `episode_reward` (the rollout scores it,
not ``--reward``).

Routes across turns (R3). Each ``generate`` returns routes for every position it fed through
the model: turn ``k``'s blob covers positions ``[0, S_k - 1)`` of its sequence. Positions fed in
an earlier turn were routed there (a prefix-caching server never routes them again; the
in-process engine recomputes them in the later prefill, and those recomputed routes shaped only
the later turns' hidden states). SGLang 0.5.23 still returns rows for the whole sequence: for a
radix-cache hit, the routes it recorded when that KV was computed, equal to the earlier turn's
(``tests/rollout/test_real_sglang_calculator.py``). The spliced routes take each position from
the turn that first fed it: rows ``[c_{k-1}, c_k)`` from turn ``k``, ``c_k`` the positions turn
``k`` covers. So the previous turn's last model token and the tool's tokens (fed first by the
next turn's prefill) get that prefill's routes, and the routes cover all ``P + R - 1`` positions
the trainer recomputes. A tool token is not in the loss, but it is still routed: its hidden
states feed the later tokens, so its routes are replayed like any other. Splicing slices the
encoded rows, which the fixed-width codecs allow; ``--routing-dtype packed`` is refused (a
RuntimeError).
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import torch

from megatron_rl.data.calculator_task import END_CALL_ID, EOS_ID, episode_reward, tool_answer
from megatron_rl.rollout.types import RolloutSample
from megatron_rl.routing import RoutingBlob
from megatron_rl.train.rollout_function import RolloutOutput, RolloutRequest

MAX_TURNS = 4
"""Model turns per episode at most (so up to 3 tool calls answered)."""


@dataclass(slots=True)
class _Episode:
    """One sample being built, turn by turn."""

    prompt: list[int]
    response: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    mask: list[bool] = field(default_factory=list)
    versions: list[int] = field(default_factory=list)  # per response token
    routes: list[tuple[RoutingBlob, int, int]] = field(default_factory=list)  # (blob, start, end)
    covered: int = 0  # positions whose routes are spliced in so far
    finish: str = "stop"
    last_answer: list[int] = field(default_factory=list)  # the last tool answer's tokens
    final_start: int = 0  # where the model's tokens after the last tool answer begin


def calculator_rollout(request: RolloutRequest) -> list[RolloutOutput]:
    """The calculator task's multi-turn rollout (module docstring); ``B * n`` episodes,
    prompt-major, each with its loss mask and reward."""
    params = request.params
    budget = params.max_new_tokens
    turn_params = dataclasses.replace(params, stop_token_ids=(*params.stop_token_ids, END_CALL_ID))
    episodes = [_Episode(list(r.prompt_ids)) for r in request.records for _ in range(request.n)]
    active = list(range(len(episodes)))
    for turn in range(MAX_TURNS):
        if not active:
            break
        if turn == 0:
            prompts, n = [list(r.prompt_ids) for r in request.records], request.n
        else:
            prompts, n = [episodes[i].prompt + episodes[i].response for i in active], 1
        longest = max(budget - len(episodes[i].response) for i in active)
        seed = None if params.seed is None else (params.seed * 7_919 + turn) % (2**31 - 1)
        generated = request.engine.generate(
            prompts,
            dataclasses.replace(turn_params, max_new_tokens=longest, seed=seed),
            n=n,
            return_routed_experts=request.return_routes,
        )
        last_turn = turn == MAX_TURNS - 1
        active = [
            i
            for i, sample in zip(active, generated, strict=True)
            if _take_turn(episodes[i], sample, budget, last_turn)
        ]
    return [_output(e, request, index) for index, e in enumerate(episodes)]


def _take_turn(episode: _Episode, sample: RolloutSample, budget: int, last_turn: bool) -> bool:
    """Append one model turn (cut at the budget) and, after a call, the tool's answer; True when
    the episode goes on."""
    room = budget - len(episode.response)
    ids = sample.response_ids_R.tolist()[:room]
    cut = len(ids) < sample.response_ids_R.numel()
    fed_end = len(episode.prompt) + len(episode.response) + len(ids) - 1
    if sample.routes is not None:
        episode.routes.append((sample.routes, episode.covered, fed_end))
        episode.covered = fed_end
    episode.response += ids
    episode.logprobs += sample.logprobs_R[: len(ids)].tolist()
    episode.mask += [True] * len(ids)
    episode.versions += [sample.weight_version] * len(ids)
    episode.finish = "length" if cut else sample.finish_reason
    if cut or episode.finish != "stop" or ids[-1] != END_CALL_ID or last_turn:
        return False
    answer, _ = tool_answer(ids, episode.prompt)
    if len(episode.response) + len(answer) >= budget:  # no room left for a model token after it
        episode.finish = "length"
        return False
    episode.last_answer = answer
    episode.response += answer
    episode.logprobs += [0.0] * len(answer)
    episode.mask += [False] * len(answer)
    episode.versions += [sample.weight_version] * len(answer)
    episode.final_start = len(episode.response)
    return True


def _output(episode: _Episode, request: RolloutRequest, index: int) -> RolloutOutput:
    record = request.records[index // request.n]
    sample = RolloutSample(
        prompt_index=index // request.n,
        sample_index=index % request.n,
        prompt_ids_P=torch.tensor(episode.prompt, dtype=torch.int64),
        response_ids_R=torch.tensor(episode.response, dtype=torch.int64),
        logprobs_R=torch.tensor(episode.logprobs, dtype=torch.float32),
        finish_reason=episode.finish,
        weight_version=min(episode.versions),
        weight_versions=_segments(episode.versions),
        routes=splice_routes(episode.routes) if episode.routes else None,
    )
    ended = episode.finish == "stop" and episode.response[-1] == EOS_ID
    reward, _ = episode_reward(
        episode.response[episode.final_start :], episode.last_answer, record.answer, ended=ended
    )
    return RolloutOutput(
        sample=sample, loss_mask_R=torch.tensor(episode.mask, dtype=torch.bool), reward=reward
    )


def _segments(versions: list[int]) -> tuple[tuple[int, int, int], ...]:
    """``(version, start, end)`` runs of ``versions``; empty when one version made them all."""
    if len(set(versions)) <= 1:
        return ()
    runs, start = [], 0
    for j in range(1, len(versions) + 1):
        if j == len(versions) or versions[j] != versions[start]:
            runs.append((versions[start], start, j))
            start = j
    return tuple(runs)


def splice_routes(parts: list[tuple[RoutingBlob, int, int]]) -> RoutingBlob:
    """One blob of rows ``[start, end)`` of each part's blob, in order (module docstring)."""
    first = parts[0][0]
    if first.codec == "packed":
        raise RuntimeError(
            "calculator_rollout splices routes across turns by rows, which --routing-dtype "
            "packed does not allow; use --routing-dtype auto (or uint8/int16/int32)"
        )
    data = torch.cat([blob.data[start:end] for blob, start, end in parts])
    return RoutingBlob(
        data=data, codec=first.codec, num_tokens=data.shape[0], num_layers=first.num_layers
    )
