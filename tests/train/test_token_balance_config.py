"""--max-tokens-per-gpu and --balance-data: parsing, defaults, and errors that name the fix."""

from __future__ import annotations

import pytest

from megatron_rl.train.config import TrainConfig, parse_args


def test_defaults_keep_fixed_micro_batches_and_no_balancing():
    schedule = TrainConfig().schedule
    assert schedule.max_tokens_per_gpu is None and schedule.token_budget is None
    assert schedule.balance_data is False
    assert TrainConfig.from_flags(max_tokens_per_gpu=0).schedule.token_budget is None  # 0: off


def test_flags_parse():
    schedule = parse_args(["--max-tokens-per-gpu", "16384", "--balance-data"]).schedule
    assert schedule.max_tokens_per_gpu == 16384 and schedule.token_budget == 16384
    assert schedule.balance_data is True
    assert parse_args(["--max-tokens-per-gpu", "0"]).schedule.token_budget is None


@pytest.mark.parametrize("value", [-1, 2.5, "8"])
def test_bad_token_budget_names_the_flag_and_the_fix(value):
    with pytest.raises(ValueError, match=r"--max-tokens-per-gpu=.*integer >= 1.*or 0 to keep"):
        TrainConfig.from_flags(max_tokens_per_gpu=value)


def test_token_budget_lifts_the_micro_batch_divisibility_rules():
    # 64 samples per step are not a multiple of 24-row micro-batches: an error without a budget
    with pytest.raises(ValueError, match="--global-batch-size 64 is not a multiple of"):
        TrainConfig.from_flags(micro_batch_size=24)
    budget = {"max_tokens_per_gpu": 4096}
    assert TrainConfig.from_flags(micro_batch_size=24, **budget).data_parallel_size(4) == 4
    with pytest.raises(ValueError, match="--micro-batch-size x data-parallel size"):
        TrainConfig.from_flags(micro_batch_size=32).data_parallel_size(4)
    assert TrainConfig.from_flags(micro_batch_size=32, **budget).data_parallel_size(4) == 4


def test_token_budget_still_needs_the_global_batch_to_split_over_ranks():
    config = TrainConfig.from_flags(
        global_batch_size=6,
        rollout_batch_size=6,
        n_samples_per_prompt=2,
        micro_batch_size=1,
        max_tokens_per_gpu=512,
    )
    with pytest.raises(ValueError, match=r"--global-batch-size 6 does not split over 4"):
        config.data_parallel_size(4)
