"""`run_rollout`: n samples per prompt, rewards, group advantages and `TrainSample`s.

Runs the real in-process engine on the tiny model with the built-in task (no test double).
"""

from __future__ import annotations

import pytest
import torch

from megatron_rl.data import BuiltinTaskConfig, builtin_task
from megatron_rl.rewards import score_builtin_response
from megatron_rl.rollout import InProcessEngine, SamplingParams
from megatron_rl.train.advantages import group_advantages
from megatron_rl.train.rollouts.phase import RolloutConfig, run_rollout, score_rollout
from megatron_rl.train.task import TaskConfig, load_policy_config


@pytest.fixture(scope="module")
def task():
    tokenizer, records = builtin_task(BuiltinTaskConfig(seed=0))
    hf_config, _ = load_policy_config(TaskConfig(), tokenizer)
    engine = InProcessEngine.from_hf_config(hf_config, seed=0)
    return engine, tokenizer, records[:3]


def _rollout(task, seed=11, return_routes=False, **config):
    engine, tokenizer, records = task
    config = RolloutConfig(n_samples_per_prompt=4, max_response_length=3, **config)
    return run_rollout(
        engine,
        records,
        tokenizer,
        score_builtin_response,
        config,
        seed=seed,
        return_routes=return_routes,
    )


def test_samples_are_prompt_major_with_rewards_and_group_advantages(task):
    _, tokenizer, records = task
    result = _rollout(task)
    assert len(result.samples) == 3 * 4
    rewards = torch.tensor([s.reward for s in result.samples])
    for i, sample in enumerate(result.samples):
        record = records[i // 4]
        assert sample.prompt_ids.tolist() == list(record.prompt_ids)
        assert 1 <= sample.response_ids.numel() <= 3
        assert sample.rollout_logprobs.shape == sample.response_ids.shape
        assert bool((sample.rollout_logprobs <= 0).all())
        text = tokenizer.decode(sample.response_ids.tolist())
        assert sample.reward == score_builtin_response(text, record.answer)
        assert sample.in_loss and sample.routes is None
    expected, _ = group_advantages(rewards, 4, "grpo")
    torch.testing.assert_close(torch.tensor([s.advantage for s in result.samples]), expected)
    assert result.metrics["reward/mean"] == pytest.approx(float(rewards.mean()))
    assert result.metrics["accuracy"] == pytest.approx(float((rewards > 0.5).float().mean()))
    assert result.metrics["rollout/weight_version"] == 0.0


def test_the_same_seed_gives_the_same_rollout_and_another_seed_another(task):
    def responses(seed):
        return [s.response_ids.tolist() for s in _rollout(task, seed=seed).samples]

    assert responses(5) == responses(5)
    assert responses(5) != responses(6)


def test_filtered_zero_variance_groups_leave_the_loss():
    """A constant reward makes every group zero-variance: filtered out, advantages 0."""
    tokenizer, records = builtin_task(BuiltinTaskConfig(seed=0))
    hf_config, _ = load_policy_config(TaskConfig(), tokenizer)
    engine = InProcessEngine.from_hf_config(hf_config, seed=0)
    config = RolloutConfig(
        n_samples_per_prompt=2, max_response_length=2, filter_zero_variance_groups=True
    )
    result = run_rollout(
        engine, records[:2], tokenizer, lambda r, a: 1.0, config, seed=0, return_routes=False
    )
    assert not any(s.in_loss for s in result.samples)
    assert all(s.advantage == 0.0 for s in result.samples)
    assert result.metrics["rollout/zero_variance_group_frac"] == 1.0


def test_routes_come_back_for_r3(task):
    result = _rollout(task, return_routes=True)
    for sample in result.samples:
        assert sample.routes is not None
        assert sample.routes.num_tokens == sample.length - 1  # the last token is never fed back


def test_sampling_supports_reach_the_train_samples_and_a_missing_one_is_refused(task):
    result = _rollout(task, top_k=4, logprobs_on_sampling_support=True)
    for sample in result.samples:
        assert sample.support_RK.shape[0] == sample.response_ids.numel()
        assert sample.support_RK.shape[1] <= 4
    engine, tokenizer, records = task
    config = RolloutConfig(
        n_samples_per_prompt=2, max_response_length=2, top_k=4, logprobs_on_sampling_support=True
    )
    plain = engine.generate(
        [list(r.prompt_ids) for r in records[:1]],
        SamplingParams(max_new_tokens=2, top_k=4, seed=1),
        n=2,
    )
    with pytest.raises(ValueError, match=r"sample \(prompt 0, sample 0\) has no support_RK"):
        score_rollout(plain, records[:1], tokenizer, score_builtin_response, config, engine=engine)
    with pytest.raises(ValueError, match="set a finite --top-k"):
        RolloutConfig(logprobs_on_sampling_support=True)


def test_bad_rollout_settings_name_the_field():
    with pytest.raises(ValueError, match="advantage_estimator"):
        RolloutConfig(advantage_estimator="ppo")
    with pytest.raises(ValueError, match=r"=0: .*\(RolloutConfig.n_samples_per_prompt\)"):
        RolloutConfig(n_samples_per_prompt=0)


def test_partial_masks_keep_only_masks_with_untrained_tokens():
    """One reduction over every mask: a mask with a False token is kept (a copy), an all-True
    one or a missing one becomes None (every token trained)."""
    from megatron_rl.train.rollouts.phase import _partial_masks

    given = [
        torch.tensor([True, True]),
        None,
        torch.tensor([True, False, True]),
        torch.tensor([True]),
        torch.tensor([False]),
    ]
    out = _partial_masks(given)
    assert [m is None for m in out] == [True, True, False, True, False]
    assert torch.equal(out[2], given[2]) and out[2].data_ptr() != given[2].data_ptr()
    assert torch.equal(out[4], given[4])
    assert _partial_masks([None, None]) == [None, None]
