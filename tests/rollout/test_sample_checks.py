"""`RolloutSample.check` and `check_samples`, the engine's contract on each sample it returns."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.types import RolloutSample, check_samples


def _sample(index: int, logprobs: list[float], finish_reason: str = "stop") -> RolloutSample:
    return RolloutSample(
        prompt_index=0,
        sample_index=index,
        prompt_ids_P=torch.tensor([1, 2]),
        response_ids_R=torch.arange(len(logprobs)),
        logprobs_R=torch.tensor(logprobs),
        finish_reason=finish_reason,
        weight_version=0,
    )


@pytest.mark.parametrize(
    ("logprobs", "message"),
    [
        ([-0.1, float("nan")], r"sample 2\): non-finite logprob nan at response token 1"),
        ([-0.1, float("-inf")], r"sample 2\): non-finite logprob -inf at response token 1"),
        ([-0.1, 0.5], r"sample 2\): positive logprob 0.5"),
    ],
)
def test_a_bad_logprob_in_a_batch_is_named_with_its_sample(logprobs, message):
    samples = [_sample(0, [-1.0, -2.0]), _sample(1, [-0.5]), _sample(2, logprobs)]
    with pytest.raises(RuntimeError, match=message):
        check_samples(samples)
    with pytest.raises(RuntimeError, match=message):
        samples[2].check()


def test_a_batch_of_valid_samples_passes_and_structure_is_still_checked_per_sample():
    check_samples([_sample(0, [-1.0, 0.0]), _sample(1, [-0.5])])
    check_samples([])
    with pytest.raises(RuntimeError, match=r"sample 1\): finish_reason 'done'"):
        check_samples([_sample(0, [-1.0]), _sample(1, [-0.5], finish_reason="done")])
    short = _sample(1, [-0.5, -0.1])
    short.logprobs_R = torch.tensor([-0.5])
    with pytest.raises(RuntimeError, match=r"sample 1\): 1 logprobs for 2 response tokens"):
        check_samples([_sample(0, [-1.0]), short])
