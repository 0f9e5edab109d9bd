"""bf16 serving with fp32 products: the native bf16 kernels' results but for rare one-ulp
roundings, far inside the bf16 mismatch, on every family the engine serves."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from rollout_testing import random_hf_model, tiny_config
from test_padded_experts import _experts, _skewed_routing
from transformers.integrations.moe import grouped_mm_experts_forward

from megatron_rl.model import preset_config
from megatron_rl.model.presets import hf_causal_lm_class
from megatron_rl.rollout import InProcessEngine, InProcessEngineConfig, SamplingParams
from megatron_rl.rollout.fp32_matmuls import (
    FP32_GROUPED_MM,
    fp32_grouped_mm_experts_forward,
    use_fp32_matmuls,
)


def _assert_within_rounding(got, want, scale) -> float:
    """Equal but for a few elements, each within one bf16 rounding of ``want`` plus an fp32
    summation-order error of the dot product (``scale`` = sum |x_i w_i|: where the sum cancels,
    the kernels' different addition orders show); the differing share."""
    assert got.dtype == want.dtype == torch.bfloat16 and got.shape == want.shape
    allowed = want.float().abs() * 2.0**-7 + scale * 2.0**-16
    assert bool(((got.float() - want.float()).abs() <= allowed).all())
    return float((got != want).float().mean())


def test_a_linear_in_fp32_products_is_the_bf16_kernel_up_to_rare_roundings():
    generator = torch.Generator().manual_seed(0)
    shares = []
    for rows, width, out in [(144, 64, 128), (1152, 64, 256), (37, 64, 16)]:
        x = torch.randn(rows, width, generator=generator).bfloat16()
        linear = torch.nn.Linear(width, out, bias=False).bfloat16()
        want = F.linear(x, linear.weight)
        with torch.no_grad():
            model = torch.nn.Sequential(linear)
            model.set_experts_implementation = lambda name: None  # no experts in this model
            assert use_fp32_matmuls(model) == 1
            got = model(x)
        assert torch.equal(got, F.linear(x.float(), linear.weight.float()).bfloat16())
        scale = F.linear(x.float().abs(), linear.weight.float().abs())
        shares.append(_assert_within_rounding(got, want, scale))
    assert max(shares) < 1e-3, shares


@pytest.mark.parametrize("num_tokens", [1, 64, pytest.param(300, marks=pytest.mark.slow)])
def test_fp32_grouped_experts_are_the_bf16_grouped_kernel_up_to_rare_roundings(
    num_tokens,
):
    experts = _experts("tiny-mismatch", torch.bfloat16)
    top_k = preset_config("tiny-mismatch").num_experts_per_tok
    for seed in range(3):
        index_TK, weights_TK = _skewed_routing(num_tokens, experts.num_experts, top_k, seed)
        hidden_TH = torch.randn(num_tokens, experts.hidden_dim).bfloat16()
        with torch.no_grad():
            args = (experts, hidden_TH, index_TK, weights_TK.bfloat16())
            want = grouped_mm_experts_forward(*args)
            got = fp32_grouped_mm_experts_forward(*args)
        # one-ulp differences inside the experts can carry into the weighted sum: a bound of a
        # few roundings on the output, and most elements equal
        assert torch.allclose(got.float(), want.float(), rtol=2.0**-6, atol=1e-3)
        assert float((got != want).float().mean()) < 0.02


def _engines(preset: str) -> dict[str, InProcessEngine]:
    """fp32, native-bf16 and fp32-products engines of one random model of ``preset``."""
    config = preset_config(preset)
    config._attn_implementation = "eager"
    torch.manual_seed(3)
    weights = hf_causal_lm_class(config)(config).state_dict()
    generator = torch.Generator().manual_seed(3)
    for name, tensor in weights.items():  # routers too (HF's zeros would tie every expert)
        if name.endswith("mlp.gate.weight"):
            tensor.copy_(torch.randn(tensor.shape, generator=generator) * 0.5)
    engines = {}
    for name, dtype, matmul in [
        ("fp32", "float32", "auto"),
        ("native", "bfloat16", "native"),
        ("fp32-products", "bfloat16", "fp32"),
    ]:
        model = hf_causal_lm_class(config)(config).eval()
        model.load_state_dict(weights)
        engines[name] = InProcessEngine(
            model, InProcessEngineConfig(dtype=dtype, bf16_matmul=matmul)
        )
    return engines


@pytest.mark.parametrize(
    "preset",
    ["tiny", pytest.param("tiny-deepseek", marks=pytest.mark.slow), "tiny-glm"],
)
def test_the_engine_with_fp32_products_scores_within_a_tenth_of_the_bf16_mismatch(preset):
    engines = _engines(preset)
    switched = engines["fp32-products"].model
    assert switched.config._experts_implementation == FP32_GROUPED_MM
    assert "forward" in vars(switched.lm_head)  # the instance's own forward: fp32 products
    sequences = [[1, 5, 9, 3, 7, 2, 11, 4], [2, 7, 7, 1, 30, 8, 8, 9, 10, 3]]
    gap_native, gap_products = [], []
    for tokens in sequences:
        exact = engines["fp32"].score(tokens)
        native = engines["native"].score(tokens)
        products = engines["fp32-products"].score(tokens)
        gap_native.append((native - exact).abs().max())
        gap_products.append((products - native).abs().max())
    mismatch, rounding = float(max(gap_native)), float(max(gap_products))
    assert mismatch > 1e-4, mismatch  # bf16 serving is measurably off the fp32 model
    assert rounding <= 0.1 * mismatch, (rounding, mismatch)
    params = SamplingParams(max_new_tokens=6, seed=5)
    drawn = {
        name: [s.response_ids_R.tolist() for s in engines[name].generate([[1, 2, 3]], params, n=4)]
        for name in ("native", "fp32-products")
    }
    assert drawn["native"] == drawn["fp32-products"]


def test_auto_picks_fp32_products_on_the_cpu_and_native_kernels_elsewhere():
    assert InProcessEngineConfig().resolved_bf16_matmul == "fp32"
    assert InProcessEngineConfig(device="cuda").resolved_bf16_matmul == "native"
    padded = InProcessEngineConfig(experts_implementation="padded_bmm")
    assert padded.resolved_bf16_matmul == "native"
    with pytest.raises(ValueError, match="bf16_matmul='fp32' runs the experts itself"):
        InProcessEngineConfig(bf16_matmul="fp32", experts_implementation="padded_bmm")
    with pytest.raises(ValueError, match=r"InProcessEngineConfig.bf16_matmul='fast'"):
        InProcessEngineConfig(bf16_matmul="fast")


def test_a_model_without_bf16_weights_is_refused_by_name():
    with pytest.raises(ValueError, match="no bf16 linear layer"):
        use_fp32_matmuls(random_hf_model(tiny_config()))
