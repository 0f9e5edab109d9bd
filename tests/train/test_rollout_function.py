"""The rollout-function contract: the built-in single-turn function is the old rollout bit for
bit, masks and own rewards reach the trainer's batch, and a broken function gets a named error.

The in-process engine on the tiny model with the built-in task (no test double) for the
equivalence; hand-made samples for the checks, which need no engine.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import pytest
import torch

from megatron_rl.data import BuiltinTaskConfig, builtin_task
from megatron_rl.rewards import score_builtin_response
from megatron_rl.rollout import InProcessEngine, RolloutSample
from megatron_rl.train.batch import make_micro_batch
from megatron_rl.train.rollout_function import (
    DEFAULT_ROLLOUT_FUNCTION,
    RolloutFunctionError,
    RolloutOutput,
    RolloutRequest,
    resolve_rollout_function,
)
from megatron_rl.train.rollouts.config import RolloutConfig
from megatron_rl.train.rollouts.phase import (
    rollout_params,
    run_rollout_function,
    score_rollout,
    single_turn_rollout,
)
from megatron_rl.train.task import TaskConfig, load_policy_config

NAME = "tests.fn:rollout"
VOCAB = 16


@pytest.fixture(scope="module")
def task():
    tokenizer, records = builtin_task(BuiltinTaskConfig(seed=0))
    hf_config, _ = load_policy_config(TaskConfig(), tokenizer)
    engine = InProcessEngine.from_hf_config(hf_config, seed=0)
    return engine, tokenizer, records[:3]


def _request(task, n=4, seed=11, return_routes=False, engine=None, **config):
    default_engine, tokenizer, records = task
    config = RolloutConfig(n_samples_per_prompt=n, max_response_length=3, **config)
    return RolloutRequest(
        records=records,
        n=n,
        engine=default_engine if engine is None else engine,
        params=rollout_params(config, tokenizer, seed),
        return_routes=return_routes,
        tokenizer=tokenizer,
        rollout=config,
    )


@pytest.mark.parametrize("return_routes", [False, True])
def test_the_default_function_is_the_old_single_generate_rollout_bit_for_bit(task, return_routes):
    """The flag's default resolves to the single-turn function; through the checked path its
    samples, rewards, advantages and metrics equal one ``engine.generate`` scored as before."""
    engine, tokenizer, records = task
    request = _request(task, return_routes=return_routes)
    fn = resolve_rollout_function(DEFAULT_ROLLOUT_FUNCTION)
    assert fn is single_turn_rollout
    new = run_rollout_function(fn, NAME, request, score_builtin_response, vocab_size=VOCAB)
    generated = engine.generate(
        [list(r.prompt_ids) for r in records],
        request.params,
        n=4,
        return_routed_experts=return_routes,
    )
    old = score_rollout(
        generated, records, tokenizer, score_builtin_response, request.rollout, engine=engine
    )
    assert new.metrics == old.metrics
    for a, b in zip(new.samples, old.samples, strict=True):
        assert torch.equal(a.response_ids, b.response_ids)
        assert torch.equal(a.rollout_logprobs, b.rollout_logprobs)
        assert (a.reward, a.advantage, a.in_loss) == (b.reward, b.advantage, b.in_loss)
        assert a.response_mask is None and b.response_mask is None
        if return_routes:
            assert torch.equal(a.routes.data, b.routes.data)


def _sample(i: int, n: int, prompt, response=(5, 2), logprobs=None) -> RolloutSample:
    logprobs = [-0.5] * len(response) if logprobs is None else logprobs
    return RolloutSample(
        prompt_index=i // n,
        sample_index=i % n,
        prompt_ids_P=torch.tensor(prompt, dtype=torch.int64),
        response_ids_R=torch.tensor(response, dtype=torch.int64),
        logprobs_R=torch.tensor(logprobs, dtype=torch.float32),
        finish_reason="stop",
        weight_version=0,
    )


def _outputs(request, **override):
    """One valid `RolloutOutput` per sample; ``override`` replaces fields of sample 3."""
    outputs = []
    for i in range(len(request.records) * request.n):
        prompt = list(request.records[i // request.n].prompt_ids)
        out = RolloutOutput(sample=_sample(i, request.n, prompt), loss_mask_R=None, reward=None)
        outputs.append(out)
    bad = outputs[3]
    for key, value in override.items():
        if key in ("loss_mask_R", "reward"):
            setattr(bad, key, value)
        else:
            bad.sample = dataclasses.replace(bad.sample, **{key: value})
    return outputs


def _run(task, fn):
    request = _request(task)
    return run_rollout_function(fn, NAME, request, score_builtin_response, vocab_size=VOCAB)


def test_own_rewards_and_loss_masks_reach_the_trainer_batch(task):
    """A sample with its own reward is not rescored; a masked token leaves the loss mask and
    its log-prob is not kept (0), the others' rewards come from the run's reward function."""

    def fn(request):
        outputs = _outputs(request)
        outputs[0].reward = 0.25
        outputs[0].loss_mask_R = torch.tensor([False, True])
        outputs[0].sample.logprobs_R = torch.tensor([-7.0, -0.5])
        return outputs

    result = _run(task, fn)
    first = result.samples[0]
    assert first.reward == 0.25
    assert first.response_mask.tolist() == [False, True]
    assert first.rollout_logprobs.tolist() == [0.0, -0.5]
    _, tokenizer, records = task
    expected = score_builtin_response(tokenizer.decode([5, 2]), records[0].answer)
    assert [s.reward for s in result.samples[1:4]] == [expected] * 3
    batch = make_micro_batch(result.samples[:2], pad_id=0)
    p = first.prompt_ids.numel()
    assert batch.loss_mask_BT[0, p - 1 : p + 1].tolist() == [False, True]
    assert batch.loss_mask_BT[1, p - 1 : p + 1].tolist() == [True, True]


def _raises(request):
    raise KeyError("tool server down")


@pytest.mark.parametrize(
    ("fn", "message"),
    [
        (_raises, r"rollout function tests.fn:rollout raised KeyError: 'tool server down'"),
        (lambda r: _outputs(r)[:-1], r"returned 11 samples for 3 prompts x 4 samples = 12"),
        (lambda r: None, r"returned a NoneType, not a list"),
        (
            lambda r: _outputs(r, loss_mask_R=torch.ones(3, dtype=torch.bool)),
            r"sample 3: loss_mask_R has 3 entries, longer than the 2 response tokens",
        ),
        (
            lambda r: _outputs(r, logprobs_R=torch.tensor([-0.1, float("nan")])),
            r"sample 3: logprobs_R\[1\] = nan",
        ),
        (
            lambda r: _outputs(r, logprobs_R=torch.tensor([-0.1])),
            r"sample 3: logprobs_R has shape \(1,\), expected \(2,\)",
        ),
        (
            lambda r: _outputs(r, response_ids_R=torch.tensor([5, VOCAB])),
            r"sample 3: response_ids_R\[1\] = 16 is outside the vocabulary \[0, 16\)",
        ),
        (
            lambda r: _outputs(r, prompt_ids_P=torch.tensor([1, 7, 4])),
            r"sample 3: prompt_ids_P is not the prompt of its record",
        ),
        (
            lambda r: _outputs(r, weight_versions=((0, 0, 1),)),
            r"sample 3: weight_versions \[\(0, 0, 1\)\] do not cover the 2 response tokens",
        ),
        (
            lambda r: _outputs(r, reward=float("inf")),
            r"sample 3: reward inf is not a finite number",
        ),
    ],
)
def test_a_broken_rollout_function_gets_an_error_naming_function_sample_and_field(
    task, fn, message
):
    with pytest.raises(RolloutFunctionError, match=message) as caught:
        _run(task, fn)
    assert NAME in str(caught.value)


def test_r3_requires_routes_over_every_recomputed_position(task):
    request = _request(task, return_routes=True)
    with pytest.raises(RolloutFunctionError, match=r"sample 0: routes cover None positions"):
        run_rollout_function(_outputs, NAME, request, score_builtin_response, vocab_size=VOCAB)


@pytest.mark.parametrize(
    ("name", "message"),
    [
        ("no_such_module_xyz:fn", "cannot import module 'no_such_module_xyz'"),
        ("megatron_rl.train.rollouts.phase:nothing", "has no attribute 'nothing'"),
        ("megatron_rl.train.rollouts.phase", "write it as 'package.module:function'"),
        (
            "megatron_rl.train.rollouts.phase:run_rollout",
            r"cannot be called as run_rollout\(request\)",
        ),
    ],
)
def test_a_bad_rollout_function_name_is_refused_when_the_config_is_built(name, message):
    with pytest.raises(ValueError, match=rf"--rollout-function '{name}'.*{message}"):
        RolloutConfig(rollout_function=name)


@pytest.mark.parametrize(
    "schedule",
    [dict(rollout_schedule="partial"), dict(rollout_schedule="carry-over", carry_over_groups=2)],
)
def test_a_custom_rollout_function_is_refused_with_partial_or_carried_samples(schedule):
    name = "megatron_rl.train.tool_rollout:calculator_rollout"
    with pytest.raises(ValueError, match=r"--rollout-function .* runs whole batches"):
        RolloutConfig(rollout_function=name, **schedule)
    RolloutConfig(rollout_function=name, rollout_schedule="async")  # whole batches: fine


def _docs_example():
    """The ``my_rollouts.py`` block of docs/trainer.md, executed as a module namespace."""
    text = (Path(__file__).resolve().parents[2] / "docs" / "trainer.md").read_text()
    start = text.index("```python\n# my_rollouts.py") + len("```python\n")
    namespace: dict = {}
    exec(compile(text[start : text.index("```", start)], "my_rollouts.py", "exec"), namespace)
    return namespace["two_turns"]


def test_the_documented_two_turn_example_runs_masking_the_feedback(task):
    fn = _docs_example()
    request = _request(task, seed=4)
    result = run_rollout_function(fn, NAME, request, score_builtin_response, vocab_size=VOCAB)
    assert len(result.samples) == 12
    for sample in result.samples:
        mask = sample.response_mask
        feedback = (~mask).nonzero().flatten().tolist()
        assert len(feedback) == 1 and sample.response_ids[feedback[0]] == 4
        assert sample.rollout_logprobs[feedback[0]] == 0.0
        assert bool((sample.rollout_logprobs[mask] < 0).all())


def test_a_response_mask_survives_a_rollout_dump_round_trip(tmp_path, task):
    """``--save-rollouts`` keeps a sample's response mask (`TrainSample.response_mask`), so a
    ``--load-rollouts`` replay trains the same tokens."""
    from megatron_rl.train.rollouts.dump import sample_from_dict, sample_to_dict

    fn = _docs_example()
    sample = run_rollout_function(
        fn, NAME, _request(task), score_builtin_response, vocab_size=VOCAB
    ).samples[0]
    torch.save(sample_to_dict(sample), tmp_path / "s.pt")
    back = sample_from_dict(torch.load(tmp_path / "s.pt", weights_only=True))
    assert torch.equal(back.response_mask, sample.response_mask)
    assert torch.equal(
        make_micro_batch([back], pad_id=0).loss_mask_BT,
        make_micro_batch([sample], pad_id=0).loss_mask_BT,
    )
