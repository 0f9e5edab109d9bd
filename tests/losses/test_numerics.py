"""Every loss stays finite (value and gradient) for any finite input: extreme staleness
(sequence log-ratios of 1e4), very negative log-probs, very long sequences."""

from __future__ import annotations

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st
from paper_losses import PAPER_LOSSES

from megatron_rl.losses import available_losses, compute_policy_loss


def _finite_loss_and_grad(name, lp, olp, adv, mask, **kw):
    lp = lp.clone().requires_grad_()
    out = compute_policy_loss(
        name, logprobs=lp, old_logprobs=olp, advantages=adv, loss_mask=mask, **kw
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    assert torch.isfinite(out.loss), (name, out.loss)
    assert torch.isfinite(grad).all(), name
    assert all(torch.isfinite(v) for v in out.metrics.values()), name
    return out, grad


@pytest.mark.parametrize("name", PAPER_LOSSES)
@pytest.mark.parametrize("seq_log_ratio", [1e4, -1e4])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_extreme_sequence_log_ratio_is_finite(name, seq_log_ratio, dtype):
    T = 16
    olp = torch.full((2, T), -30.0, dtype=dtype)
    lp = olp + seq_log_ratio / T
    lp = lp.clamp(max=0.0) if seq_log_ratio < 0 else olp + 29.0  # logprobs stay <= 0
    olp = lp - seq_log_ratio / T
    adv = torch.tensor([1.0, -1.0], dtype=dtype)
    _finite_loss_and_grad(name, lp, olp, adv, torch.ones(2, T, dtype=torch.bool))


@pytest.mark.parametrize("name", PAPER_LOSSES)
def test_long_sequences_are_finite(name):
    T = 32_768
    gen = torch.Generator().manual_seed(0)
    olp = -torch.rand(2, T, generator=gen) * 3
    lp = olp + 0.05 * torch.randn(2, T, generator=gen)  # |log W| ~ 10 over the sequence
    adv = torch.tensor([1.0, -1.0])
    _finite_loss_and_grad(name, lp, olp, adv, torch.ones(2, T, dtype=torch.bool))


finite = st.floats(min_value=-1e4, max_value=1e4, allow_nan=False, width=32)


@settings(max_examples=40, deadline=None)
@given(
    name=st.sampled_from(PAPER_LOSSES),
    data=st.lists(st.tuples(finite, finite, st.booleans()), min_size=1, max_size=24),
    adv=st.tuples(finite, finite),
)
def test_any_finite_input_gives_finite_loss_and_gradient(name, data, adv):
    T = len(data)
    lp = torch.tensor([[min(x, 0.0) for x, _, _ in data]] * 2)
    olp = torch.tensor([[min(y, 0.0) for _, y, _ in data]] * 2)
    mask = torch.tensor([[m for _, _, m in data], [True] * T])
    _finite_loss_and_grad(name, lp, olp, torch.tensor(adv), mask)


@pytest.mark.parametrize("name", available_losses())
def test_zero_length_batches_are_handled_the_same_by_every_loss(name):
    """No response token at all: a named ValueError without global counts, a zero loss with
    them (vespo and topr used to raise IndexError from an argmax over an empty axis)."""
    logprobs = torch.zeros(2, 0, requires_grad=True)
    inputs = dict(
        logprobs=logprobs,
        old_logprobs=logprobs.detach(),
        advantages=torch.ones(2),
        loss_mask=torch.ones(2, 0, dtype=torch.bool),
    )
    with pytest.raises(ValueError, match="loss_mask selects no"):
        compute_policy_loss(name, **inputs)
    out = compute_policy_loss(
        name, global_num_tokens=8, global_num_seqs=2, max_response_length=4, **inputs
    )
    assert float(out.loss) == 0.0
    out.loss.backward()


def test_float16_log_probs_are_refused_with_the_fix():
    """fp16 would overflow: ratios up to e^20 gave inf per-token losses and gradients."""
    logprobs = torch.zeros(1, 3, dtype=torch.float16)
    with pytest.raises(ValueError, match=r"float16.*pass float32"):
        compute_policy_loss(
            "grpo",
            logprobs=logprobs,
            old_logprobs=logprobs - 15,
            advantages=torch.ones(1),
            loss_mask=torch.ones(1, 3, dtype=torch.bool),
        )
