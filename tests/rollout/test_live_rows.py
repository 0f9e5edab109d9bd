"""Finished rows leave the batch (`megatron_rl.rollout.live_rows`): later decoding steps compute
only the live rows, and no sample's tokens, finish reason, routes or noise change."""

from __future__ import annotations

import collections

import pytest
import torch
from rollout_testing import PROMPTS, make_engine

from megatron_rl.rollout import SamplingParams

BASE = SamplingParams(max_new_tokens=12, seed=5)


def _frequent_tokens(engine, count: int) -> tuple[int, ...]:
    """The ``count`` most frequent tokens of unstopped samples: as stop tokens they end the rows
    at many different steps."""
    samples = engine.generate(PROMPTS, BASE, n=4)
    counter = collections.Counter(t for s in samples for t in s.response_ids_R.tolist())
    return tuple(t for t, _ in counter.most_common(count))


def _generate(dtype: str, drop: bool, stop: tuple[int, ...]):
    engine = make_engine(dtype=dtype, router_noise=0.3, drop_finished_rows=drop)
    sizes: list[int] = []
    engine.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    params = SamplingParams(max_new_tokens=12, seed=5, stop_token_ids=stop)
    return engine.generate(PROMPTS, params, n=4, return_routed_experts=True), sizes


@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
def test_finished_rows_leave_the_batch_and_every_sample_stays_the_same(dtype):
    stop = _frequent_tokens(make_engine(dtype=dtype, router_noise=0.3), 2)
    dropped, sizes = _generate(dtype, True, stop)
    kept, kept_sizes = _generate(dtype, False, stop)
    lengths = [s.response_ids_R.numel() for s in kept]
    assert len(set(lengths)) >= 3, f"pick other stop tokens: lengths {lengths}"
    assert kept_sizes == [12] * len(kept_sizes)
    assert sizes[0] == 12 and sizes == sorted(sizes, reverse=True) and sizes[-1] < 12
    assert sum(sizes) < sum(kept_sizes)
    for a, b in zip(dropped, kept, strict=True):
        assert a.response_ids_R.tolist() == b.response_ids_R.tolist()
        assert a.finish_reason == b.finish_reason
        assert a.routes.data.tolist() == b.routes.data.tolist()
        # BLAS rounds a row by the product's row count: log-probs may move in the last bits
        torch.testing.assert_close(a.logprobs_R, b.logprobs_R, atol=1e-5, rtol=0)


def test_without_seeds_and_with_unstopped_rows_nothing_leaves_early():
    engine = make_engine()
    sizes: list[int] = []
    engine.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: sizes.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    engine.generate(PROMPTS, SamplingParams(max_new_tokens=6), n=2)
    assert sizes == [6] * 6  # every row runs to max_new_tokens: one batch throughout
