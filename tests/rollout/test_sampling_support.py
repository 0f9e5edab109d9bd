"""Sampling on the support: the in-process engine's top-k/top-p support and its renormalised
log-probs, against float64 references written from SGLang's rule."""

from __future__ import annotations

import pytest
import torch
from rollout_testing import PROMPTS, make_engine

from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.sampling import filter_top_k_top_p
from megatron_rl.rollout.types import RolloutSample

# a near tie at the support's cut may fall either way between a cached decode and a direct
# forward; positions whose cut is closer than this (in probability) are not compared
CUT_MARGIN = 1e-5


def _reference_support(logits_V: torch.Tensor, top_k: int, top_p: float) -> tuple[set, float]:
    """float64: SGLang's joint rule (rank < top_k and the mass before <= top_p, both on the full
    distribution) -> (the support's ids, the smallest probability gap at its cut)."""
    probs = torch.softmax(logits_V.double(), dim=-1)
    sorted_p, order = torch.sort(probs, descending=True)
    before = torch.cumsum(sorted_p, 0) - sorted_p
    rank = torch.arange(probs.numel())
    keep = (before <= top_p) & ((rank < top_k) if top_k > 0 else True)
    n = int(keep.sum())
    gaps = [abs(float(before[n]) - top_p)] if n < probs.numel() and top_p < 1 else []
    if 0 < top_k < probs.numel() and n == top_k:
        gaps.append(float(sorted_p[n - 1] - sorted_p[n]))
    return set(order[:n].tolist()), min(gaps, default=1.0)


def test_the_filter_is_sglangs_joint_rule_on_the_full_distribution():
    # p = .5 .3 .15 .05; top-k 3 then top-p .7 on the full p keeps 2 tokens (mass before the
    # third is .8 > .7); a top-p on the renormalised top-3 would have kept the same 2, so also
    # check a case where they differ: top-k 2, top-p .55 keeps both (mass before the second .5)
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    kept = lambda k, p: (~torch.isinf(filter_top_k_top_p(logits, k, p))).tolist()[0]  # noqa: E731
    assert kept(3, 0.7) == [True, True, False, False]
    assert kept(2, 0.55) == [True, True, False, False]
    assert kept(-1, 0.45) == [True, False, False, False]
    generator = torch.Generator().manual_seed(0)
    for top_k, top_p in [(4, 1.0), (-1, 0.7), (4, 0.7), (50, 0.9), (1, 0.5)]:
        logits_BV = torch.randn(64, 300, generator=generator) * 3
        out_BV = filter_top_k_top_p(logits_BV, top_k, top_p)
        for row, out in zip(logits_BV, out_BV, strict=True):
            want, gap = _reference_support(row, top_k, top_p)
            if gap > CUT_MARGIN:
                assert set(torch.isfinite(out).nonzero().flatten().tolist()) == want


@pytest.mark.parametrize(
    "params",
    [
        SamplingParams(max_new_tokens=8, seed=3, top_p=0.7, top_k=4, return_sampling_support=True),
        SamplingParams(max_new_tokens=8, seed=4, top_k=4, return_sampling_support=True),
        SamplingParams(
            max_new_tokens=8,
            seed=5,
            temperature=0.8,
            top_p=0.7,
            top_k=100_000,  # above the vocabulary: no top-k cut
            return_sampling_support=True,
        ),
    ],
    ids=["top-p 0.7 top-k 4", "top-k 4", "T 0.8 top-p 0.7"],
)
def test_the_reported_logprob_is_the_log_of_the_renormalised_probability_sampled_with(params):
    engine = make_engine()
    compared = 0
    for sample in engine.generate(PROMPTS, params, n=2):
        prompt, response = sample.prompt_ids_P.tolist(), sample.response_ids_R.tolist()
        with torch.no_grad():
            logits = engine.model(input_ids=torch.tensor([prompt + response])).logits[0]
        scaled_RV = logits[len(prompt) - 1 : -1].double() / params.temperature
        for j, token in enumerate(response):
            support = sample.support_RK[j][sample.support_RK[j] >= 0].tolist()
            assert token in support and len(support) <= params.top_k
            want, gap = _reference_support(scaled_RV[j], params.top_k, params.top_p)
            if gap > CUT_MARGIN:
                assert set(support) == want
                compared += 1
            probs = torch.softmax(scaled_RV[j], dim=-1)
            renormalised = probs[token] / probs[support].sum()
            assert abs(float(sample.logprobs_R[j]) - float(torch.log(renormalised))) < 1e-5
            # descending probability, SGLang's order
            assert probs[support].tolist() == sorted(probs[support].tolist(), reverse=True)
    assert compared > 30
    assert any((s.support_RK >= 0).sum(dim=1).max() > 1 for s in engine.generate(PROMPTS, params))


def test_greedy_support_is_the_argmax_drawn_with_probability_one():
    engine = make_engine()
    params = SamplingParams(max_new_tokens=5, temperature=0, top_k=1, return_sampling_support=True)
    plain = engine.generate(PROMPTS, SamplingParams(max_new_tokens=5, temperature=0))
    for sample, same in zip(engine.generate(PROMPTS, params), plain, strict=True):
        assert sample.response_ids_R.tolist() == same.response_ids_R.tolist()
        assert sample.support_RK.squeeze(1).tolist() == sample.response_ids_R.tolist()
        assert sample.logprobs_R.abs().max() == 0


def test_without_the_option_no_support_and_full_vocabulary_logprobs():
    engine = make_engine()
    sample = engine.generate(PROMPTS[:1], SamplingParams(max_new_tokens=4, seed=1, top_k=4))[0]
    assert sample.support_RK is None


def test_support_needs_a_finite_top_k():
    with pytest.raises(ValueError, match="top_k=-1 with return_sampling_support"):
        SamplingParams(top_p=0.7, return_sampling_support=True)
    with pytest.raises(ValueError, match="1 when temperature is 0"):
        SamplingParams(temperature=0, top_k=4, return_sampling_support=True)


def test_a_token_outside_its_support_is_named():
    sample = RolloutSample(
        prompt_index=0,
        sample_index=1,
        prompt_ids_P=torch.tensor([1, 2]),
        response_ids_R=torch.tensor([7, 9]),
        logprobs_R=torch.tensor([-0.1, -0.2]),
        finish_reason="length",
        weight_version=0,
        support_RK=torch.tensor([[7, 3], [8, -1]], dtype=torch.int32),
    )
    with pytest.raises(RuntimeError, match=r"response token 1 \(id 9\) is not in its sampling"):
        sample.check()
    sample.support_RK = torch.tensor([[7, -1, 3], [9, -1, -1]], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="-1 only after"):
        sample.check()
