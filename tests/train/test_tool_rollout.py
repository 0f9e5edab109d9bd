"""The calculator task's multi-turn rollout against the real in-process engine (tiny model).

A recording wrapper keeps every ``generate`` call, so each episode's turns can be found again
(a later turn's prompt is the episode so far) and compared with what the rollout returned: the
model's tokens and log-probs are the engine's, the tool's tokens are masked out with log-prob 0,
and with R3 each position's replayed route is the one the engine used when it first fed it.
"""

from __future__ import annotations

import itertools

import pytest
import torch

from megatron_rl.data.calculator_task import (
    END_CALL_ID,
    CalculatorConfig,
    calculator_task,
    tool_answer,
)
from megatron_rl.rewards import score_builtin_response
from megatron_rl.rollout import InProcessEngine
from megatron_rl.train.batch import make_micro_batch
from megatron_rl.train.rollout_function import RolloutRequest
from megatron_rl.train.rollouts.config import RolloutConfig
from megatron_rl.train.rollouts.phase import rollout_params, run_rollout_function
from megatron_rl.train.task import TaskConfig, load_policy_config
from megatron_rl.train.tool_rollout import calculator_rollout

BUDGET = 12
N = 8


class RecordingEngine:
    """The engine, with every ``generate`` call's prompts and samples kept."""

    def __init__(self, engine) -> None:
        self.engine, self.calls = engine, []

    def generate(self, prompts, params, *, n=1, return_routed_experts=False):
        out = self.engine.generate(
            prompts, params, n=n, return_routed_experts=return_routed_experts
        )
        self.calls.append(([list(p) for p in prompts], n, out))
        return out

    def take_aborted(self) -> int:
        return self.engine.take_aborted()


@pytest.fixture(scope="module")
def setup():
    tokenizer, records = calculator_task(CalculatorConfig(seed=0))
    hf_config, _ = load_policy_config(TaskConfig(task="calculator"), tokenizer)
    engine = InProcessEngine.from_hf_config(hf_config, seed=0)
    return engine, tokenizer, records[:4], int(hf_config.vocab_size)


def _rollout(setup, return_routes: bool):
    engine, tokenizer, records, vocab = setup
    recording = RecordingEngine(engine)
    config = RolloutConfig(n_samples_per_prompt=N, max_response_length=BUDGET)
    request = RolloutRequest(
        records=records,
        n=N,
        engine=recording,
        params=rollout_params(config, tokenizer, seed=5),
        return_routes=return_routes,
        tokenizer=tokenizer,
        rollout=config,
    )
    result = run_rollout_function(
        calculator_rollout, "calculator", request, score_builtin_response, vocab_size=vocab
    )
    return result, recording.calls


def _turns(samples, calls) -> list[list]:
    """The engine samples of each episode's turns, in order: call ``k`` (``k >= 1``) holds one
    row per episode still going after ``k`` turns, in episode order; an episode has one turn
    more than the tool answers it continued after (its masked spans followed by a model token).
    """
    counts = []
    for sample in samples:
        mask = [True] * sample.response_ids.numel()
        if sample.response_mask is not None:
            mask = sample.response_mask.tolist()
        counts.append(1 + sum(not a and b for a, b in itertools.pairwise(mask)))
    turns = [[calls[0][2][i]] for i in range(len(samples))]
    for k, (_, n, out) in enumerate(calls[1:], start=1):
        active = [i for i, c in enumerate(counts) if c > k]
        assert n == 1 and len(active) == len(out)
        for i, sample in zip(active, out, strict=True):
            turns[i].append(sample)
    return turns


def test_tool_tokens_are_masked_with_no_behaviour_logprob_and_the_model_tokens_are_the_engines(
    setup,
):
    result, calls = _rollout(setup, return_routes=False)
    assert len(calls) >= 2, "no episode called the tool: the test would prove nothing"
    num_tool_tokens = 0
    turns = _turns(result.samples, calls)
    for index, sample in enumerate(result.samples):
        prompt = sample.prompt_ids.tolist()
        response = sample.response_ids.tolist()
        mask = [True] * len(response) if sample.response_mask is None else sample.response_mask
        mask = [bool(m) for m in mask]
        assert len(response) <= BUDGET
        position = 0
        for turn in turns[index]:
            assert turn.prompt_ids_P.tolist() == prompt + response[:position]
            ids = turn.response_ids_R.tolist()[: BUDGET - position]
            assert response[position : position + len(ids)] == ids
            assert all(mask[position : position + len(ids)])
            torch.testing.assert_close(
                sample.rollout_logprobs[position : position + len(ids)],
                turn.logprobs_R[: len(ids)],
                rtol=0,
                atol=0,
            )
            position += len(ids)
            if position < len(response):  # the tool answered this turn's call
                assert ids[-1] == END_CALL_ID
                answer, _ = tool_answer(ids, prompt)
                assert response[position : position + len(answer)] == answer
                assert not any(mask[position : position + len(answer)])
                assert not sample.rollout_logprobs[position : position + len(answer)].any()
                position += len(answer)
                num_tool_tokens += len(answer)
        assert position == len(response)
    assert num_tool_tokens > 0
    # a tool answer never ends a response: a later turn's prefill routes every tool token
    assert all(s.response_mask is None or bool(s.response_mask[-1]) for s in result.samples)
    batch = make_micro_batch(result.samples, pad_id=0)
    masked = sum(
        int((~s.response_mask).sum()) for s in result.samples if s.response_mask is not None
    )
    total = sum(s.response_ids.numel() for s in result.samples if s.in_loss)
    in_loss_masked = sum(
        int((~s.response_mask).sum())
        for s in result.samples
        if s.in_loss and s.response_mask is not None
    )
    assert masked == num_tool_tokens
    assert batch.num_tokens == total - in_loss_masked


def test_r3_routes_of_each_position_are_those_of_the_turn_that_first_fed_it(setup):
    """Rows ``[c_{k-1}, c_k)`` of a multi-turn sample's routes equal turn ``k``'s own rows: the
    previous turn's last model token and the tool's tokens come from the next turn's prefill,
    and every one of the ``P + R - 1`` positions the trainer recomputes has its route."""
    result, calls = _rollout(setup, return_routes=True)
    multi_turn = 0
    all_turns = _turns(result.samples, calls)
    for index, sample in enumerate(result.samples):
        prompt = sample.prompt_ids.tolist()
        routes = sample.routes
        assert routes.num_tokens == sample.length - 1
        turns = all_turns[index]
        multi_turn += len(turns) > 1
        covered = 0
        for turn in turns:
            fed_input = turn.prompt_ids_P.numel()
            kept = min(turn.response_ids_R.numel(), BUDGET - (fed_input - len(prompt)))
            end = fed_input + kept - 1
            assert torch.equal(routes.data[covered:end], turn.routes.data[covered:end])
            covered = end
        assert covered == routes.num_tokens
    assert multi_turn > 0
