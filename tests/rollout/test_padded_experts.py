"""Padded batched-matmul experts: the same outputs as transformers' grouped matmul."""

from __future__ import annotations

import pytest
import torch
from rollout_testing import PROMPTS, make_engine
from transformers.integrations.moe import grouped_mm_experts_forward
from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeExperts

from megatron_rl.model import preset_config
from megatron_rl.rollout import InProcessEngineConfig, SamplingParams
from megatron_rl.rollout.padded_experts import PADDED_BMM, padded_bmm_experts_forward


def _experts(preset: str, dtype: torch.dtype) -> Qwen3MoeExperts:
    experts = Qwen3MoeExperts(preset_config(preset))
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for weight in (experts.gate_up_proj, experts.down_proj):
            weight.copy_(torch.randn(weight.shape, generator=generator) * 0.1)
    return experts.to(dtype)


def _skewed_routing(num_tokens: int, num_experts: int, top_k: int, seed: int):
    """[T, K] choices where expert 0 gets no token, expert 1 exactly one (T > 1), the rest
    skewed; [T, K] softmax weights."""
    generator = torch.Generator().manual_seed(seed)
    popularity = torch.rand(num_experts, generator=generator) ** 4 + 1e-3
    popularity[:2] = 0.0
    index_TK = torch.stack(
        [torch.multinomial(popularity, top_k, generator=generator) for _ in range(num_tokens)]
    )
    if num_tokens > 1:
        index_TK[0, 0] = 1
    weights_TK = torch.rand(num_tokens, top_k, generator=generator).softmax(-1)
    return index_TK, weights_TK


def _both(experts, hidden_TH, index_TK, weights_TK):
    with torch.no_grad():
        want = grouped_mm_experts_forward(experts, hidden_TH, index_TK, weights_TK)
        got = padded_bmm_experts_forward(experts, hidden_TH, index_TK, weights_TK)
    return want, got


@pytest.fixture(params=[1, 2], ids=["1thread", "2threads"])
def threads(request):
    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.mark.parametrize("preset", ["tiny", "tiny-mismatch"])
@pytest.mark.parametrize(
    "num_tokens", [1, 3, 64, pytest.param(300, marks=pytest.mark.slow)]
)  # 300 tokens: the full suite (over 2.5 s in the fast lane)
def test_padded_bmm_equals_grouped_mm_in_bf16_to_one_rounding(preset, num_tokens, threads):
    """Equal but for bf16 roundings: the two products are other kernels, and on an Intel Xeon
    (AVX-512 + AMX) the same inputs were, from one run of the module to the next, now and then
    rounded otherwise (3 of 540 comparisons at 2 threads, and at 1 thread; then ~11% of the
    elements one bf16 step apart, all within 0.24 x 2^-8 of the output's largest element).
    Bound: 2^-8 of the largest element (a wrong expert or weight moves whole rows by far more)."""
    experts = _experts(preset, torch.bfloat16)
    top_k = preset_config(preset).num_experts_per_tok
    for seed in range(3):
        index_TK, weights_TK = _skewed_routing(num_tokens, experts.num_experts, top_k, seed)
        counts = torch.bincount(index_TK.reshape(-1), minlength=experts.num_experts)
        assert counts[0] == 0 and (num_tokens == 1 or counts[1] == 1)
        hidden_TH = torch.randn(num_tokens, experts.hidden_dim).bfloat16()
        want, got = _both(experts, hidden_TH, index_TK, weights_TK.bfloat16())
        assert got.dtype == want.dtype and got.shape == want.shape
        diff = (got.float() - want.float()).abs()
        assert float(diff.max()) <= 2**-8 * float(want.float().abs().max()), float(diff.max())


@pytest.mark.slow
def test_padded_bmm_is_within_rounding_of_grouped_mm_in_fp32():
    # Not bitwise in fp32: MKL picks its kernel by the row count (on AVX2: 1, 2-3, 4+ rows) and
    # splits rows by thread count, so a [count, H] product and the padded [C, H] one can round
    # the same row differently.
    experts = _experts("tiny-mismatch", torch.float32)
    for seed in range(3):
        index_TK, weights_TK = _skewed_routing(200, experts.num_experts, 8, seed)
        hidden_TH = torch.randn(200, experts.hidden_dim)
        want, got = _both(experts, hidden_TH, index_TK, weights_TK)
        torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.slow
def test_bf16_engine_draws_the_same_samples_and_routes_with_padded_bmm():
    params = SamplingParams(max_new_tokens=6, seed=3)
    samples = {}
    for experts in ("grouped_mm", PADDED_BMM):
        engine = make_engine(dtype="bfloat16", experts_implementation=experts)
        assert engine.model.config._experts_implementation == experts
        samples[experts] = engine.generate(PROMPTS, params, n=3, return_routed_experts=True)
    for old, new in zip(samples["grouped_mm"], samples[PADDED_BMM], strict=True):
        assert torch.equal(old.response_ids_R, new.response_ids_R)
        assert torch.equal(old.logprobs_R, new.logprobs_R)
        assert torch.equal(old.routes.data, new.routes.data)


def test_unknown_experts_implementation_names_the_field_and_the_choices():
    with pytest.raises(ValueError, match=r"experts_implementation=.*padded_bmm"):
        InProcessEngineConfig(experts_implementation="bmm")
