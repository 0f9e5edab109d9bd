"""The local spec's fused causal attention (`megatron_rl.model.sdpa_attention`) against
megatron-core's own unfused `DotProductAttention` on the same weights."""

from __future__ import annotations

import pytest
import torch
from megatron.core.transformer.dot_product_attention import DotProductAttention

from megatron_rl.model import ModelOptions, build_model, preset_config
from megatron_rl.model.builder import causal_lm_logits
from megatron_rl.model.sdpa_attention import SdpaDotProductAttention


def _attention_modules(model) -> list[torch.nn.Module]:
    return [m for m in model.modules() if isinstance(m, DotProductAttention)]


def _logits_and_grads(model, tokens):
    model.zero_grad(set_to_none=True)
    logits = causal_lm_logits(model, tokens)
    logits.float().square().mean().backward()
    return logits.detach(), [p.grad.clone() for p in model.parameters()]


@pytest.mark.parametrize("preset", ["tiny", "tiny-dense-tied"])
def test_fused_attention_matches_megatrons_unfused_attention_within_float_rounding(ws1, preset):
    """Same weights, same right-padded batch: logits within 1e-6, every gradient within 1e-5 of
    its largest element (grouped-query heads: 4 query heads over 2 key/value groups)."""
    model = build_model(preset_config(preset), ModelOptions(local_attention="sdpa"))
    modules = _attention_modules(model)
    assert modules and all(type(m) is SdpaDotProductAttention for m in modules)
    tokens = torch.randint(0, 500, (6, 11), generator=torch.Generator().manual_seed(3))
    fused, fused_grads = _logits_and_grads(model, tokens)
    for module in modules:  # the same module objects and weights, megatron's forward
        module.__class__ = DotProductAttention
    unfused, unfused_grads = _logits_and_grads(model, tokens)
    assert not torch.equal(fused, unfused)  # a different kernel ran
    torch.testing.assert_close(fused, unfused, rtol=0, atol=1e-6)
    for a, b in zip(fused_grads, unfused_grads, strict=True):
        assert (a - b).abs().max() <= 1e-5 * b.abs().max()


def test_an_explicit_mask_runs_megatrons_forward_unchanged_and_dropout_is_not_fused(ws1):
    """Outside causal self-attention without dropout the module is megatron's, bit for bit."""
    model = build_model(preset_config("tiny"), ModelOptions(local_attention="sdpa"))
    module = _attention_modules(model)[0]
    generator = torch.Generator().manual_seed(0)
    q = torch.randn(7, 2, 4, 16, generator=generator)
    k, v = (torch.randn(7, 2, 2, 16, generator=generator) for _ in range(2))
    mask = torch.rand(2, 1, 7, 7, generator=generator) > 0.6  # True: masked out
    mask[..., 0] = False
    assert module._fusable(q, k, None, None, None)
    assert not module._fusable(q, k, mask, None, None)
    fused_masked = module(q, k, v, mask)
    module.attention_dropout.p = 0.1
    assert not module._fusable(q, k, None, None, None)  # dropout in training
    module.eval()
    assert module._fusable(q, k, None, None, None)  # no dropout in eval
    module.__class__ = DotProductAttention
    assert torch.equal(fused_masked, module(q, k, v, mask))


def test_auto_is_fused_on_the_cpu_and_unfused_keeps_megatrons_module(ws1):
    config = preset_config("tiny")
    auto = build_model(config, ModelOptions())
    assert {type(m) for m in _attention_modules(auto)} == {SdpaDotProductAttention}
    unfused = build_model(config, ModelOptions(local_attention="unfused"))
    assert {type(m) for m in _attention_modules(unfused)} == {DotProductAttention}


def test_an_unknown_attention_choice_is_refused_by_name():
    with pytest.raises(ValueError, match="local_attention"):
        ModelOptions(local_attention="flash")
