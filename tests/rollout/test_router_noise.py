"""Router noise: the engine picks its top-k from noisy logits, captured as such, reproducibly."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.model.presets import preset_config
from megatron_rl.rollout import InProcessEngine, InProcessEngineConfig
from megatron_rl.rollout.route_capture import RouteCapture, moe_gates
from megatron_rl.rollout.router_noise import RouterNoise

HF = preset_config("tiny-mismatch")
TOKENS = torch.randint(1, HF.vocab_size, (4, 32), generator=torch.Generator().manual_seed(1))


def _engine(noise: float, seed: int = 0) -> InProcessEngine:
    config = InProcessEngineConfig(router_noise=noise, router_noise_seed=seed)
    return InProcessEngine.from_hf_config(HF, config, seed=0)  # same weights for every engine


def _routes_and_outputs(engine: InProcessEngine):
    outputs = []
    hooks = [
        g.register_forward_hook(lambda m, a, o: outputs.append(o)) for g in moe_gates(engine.model)
    ]
    try:
        with torch.no_grad(), RouteCapture(engine.model, TOKENS.shape[0]) as capture:
            engine.model(TOKENS)
    finally:
        for hook in hooks:
            hook.remove()
    return capture.routes_BTLK().sort(dim=-1).values, outputs


def _agreement(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a == b).all(dim=-1).float().mean())


@pytest.mark.slow
def test_noise_flips_a_share_of_choices_that_grows_with_sigma_and_is_seeded():
    clean, _ = _routes_and_outputs(_engine(0.0))
    small, _ = _routes_and_outputs(_engine(0.01))
    large, _ = _routes_and_outputs(_engine(0.3))
    again, _ = _routes_and_outputs(_engine(0.3))
    other, _ = _routes_and_outputs(_engine(0.3, seed=1))
    # at initialisation: ~7% of token-layers change their top-8 set at 0.01, ~95% at 0.3
    assert 0.99 > _agreement(clean, small) > 0.8 > 0.2 > _agreement(clean, large)
    assert torch.equal(large, again)
    assert not torch.equal(large, other)


@pytest.mark.slow
def test_the_router_returns_clean_logits_and_normalised_weights_of_its_noisy_choice():
    _, clean = _routes_and_outputs(_engine(0.0))
    _, noisy = _routes_and_outputs(_engine(0.3))
    # the first layer sees the same input: its returned (aux-loss) logits are the clean ones
    torch.testing.assert_close(noisy[0][0], clean[0][0], rtol=0, atol=0)
    for (logits0, _, _), (_, weights_TK, indices_TK) in zip(clean[:1], noisy[:1], strict=True):
        torch.testing.assert_close(weights_TK.sum(-1), torch.ones(weights_TK.shape[0]))
        probs = logits0.softmax(-1).gather(-1, indices_TK)  # weights of the noisy logits
        assert not torch.equal(probs / probs.sum(-1, keepdim=True), weights_TK)
    for _, weights_TK, _ in noisy:
        torch.testing.assert_close(weights_TK.sum(-1), torch.ones(weights_TK.shape[0]))


def test_no_noise_installs_nothing_and_bad_sigma_names_the_field():
    engine = _engine(0.0)
    assert not any(g._forward_hooks for g in moe_gates(engine.model))
    with pytest.raises(ValueError, match="router_noise"):
        InProcessEngineConfig(router_noise=-0.1)
    with pytest.raises(ValueError, match="sigma"):
        RouterNoise(engine.model, 0.0)
