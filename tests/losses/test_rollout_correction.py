"""Rollout-correction weights (TIS / MIS / IcePop) and KL estimators: closed forms."""

from __future__ import annotations

import math

import pytest
import torch
from loss_batches import make_batch

from megatron_rl.losses import compute_policy_loss, kl_penalty, rollout_correction

OLD = torch.log(torch.tensor([[1.0, 3.0, 0.25, 0.9], [0.5, 0.5, 0.5, 0.5]]))
ROLLOUT = torch.zeros(2, 4)  # rho = pi_old / mu_rollout = exp(OLD)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 1, 0]], dtype=torch.bool)


def test_token_tis_truncates_the_ratio():
    c = rollout_correction("tis-token", old_logprobs=OLD, rollout_logprobs=ROLLOUT, loss_mask=MASK)
    expected = torch.tensor([[1.0, 2.0, 0.25, 0.9], [0.5, 0.5, 0.5, 0.0]])
    torch.testing.assert_close(c.weights, expected)
    assert torch.equal(c.loss_mask, MASK)
    assert c.metrics["rollout_correction/limited_frac"].item() == pytest.approx(1 / 7)


def test_sequence_tis_uses_the_product_of_ratios():
    c = rollout_correction(
        "tis-seq", old_logprobs=OLD, rollout_logprobs=ROLLOUT, loss_mask=MASK, cap=2.0
    )
    seq0 = min(1.0 * 3.0 * 0.25 * 0.9, 2.0)
    seq1 = 0.5**3  # the masked-out 4th token does not count
    expected = torch.tensor([[seq0] * 4, [seq1] * 3 + [0.0]])
    torch.testing.assert_close(c.weights, expected)


def test_icepop_masks_tokens_outside_the_band():
    c = rollout_correction("icepop", old_logprobs=OLD, rollout_logprobs=ROLLOUT, loss_mask=MASK)
    # band [0.5, 5]: 0.25 is rejected, 0.5 kept
    expected_mask = MASK.clone()
    expected_mask[0, 2] = False
    assert torch.equal(c.loss_mask, expected_mask)
    torch.testing.assert_close(
        c.weights, torch.tensor([[1.0, 3.0, 0.0, 0.9], [0.5, 0.5, 0.5, 0.0]])
    )


def test_sequence_mis_rejects_whole_sequences():
    c = rollout_correction(
        "mis-seq", old_logprobs=OLD, rollout_logprobs=ROLLOUT, loss_mask=MASK, low=0.6, high=5.0
    )
    assert c.loss_mask[0].all() and not c.loss_mask[1].any()  # 0.675 kept, 0.125 rejected


def test_packed_sequence_tis_matches_padded():
    cu = torch.tensor([0, 4, 7])
    packed = rollout_correction(
        "tis-seq",
        old_logprobs=OLD[MASK],
        rollout_logprobs=ROLLOUT[MASK],
        loss_mask=torch.ones(7, dtype=torch.bool),
        cu_seqlens=cu,
    )
    padded = rollout_correction(
        "tis-seq", old_logprobs=OLD, rollout_logprobs=ROLLOUT, loss_mask=MASK
    )
    torch.testing.assert_close(packed.weights, padded.weights[MASK])


def test_correction_weights_multiply_the_per_token_loss():
    b = make_batch(seed=50)
    rollout = b.old_logprobs + 0.2 * torch.randn(b.old_logprobs.shape, dtype=torch.float64)
    c = rollout_correction(
        "icepop", old_logprobs=b.old_logprobs, rollout_logprobs=rollout, loss_mask=b.loss_mask
    )
    plain = compute_policy_loss("grpo", **(b.kwargs() | {"loss_mask": c.loss_mask}))
    weighted = compute_policy_loss(
        "grpo", token_weights=c.weights, **(b.kwargs() | {"loss_mask": c.loss_mask})
    )
    torch.testing.assert_close(weighted.per_token_loss, plain.per_token_loss * c.weights)


def test_unknown_mode_and_bad_band_are_errors():
    with pytest.raises(ValueError, match="mode='tis'"):
        rollout_correction("tis", old_logprobs=OLD, rollout_logprobs=ROLLOUT, loss_mask=MASK)
    with pytest.raises(ValueError, match="low <= 1 <= high"):
        rollout_correction(
            "icepop", old_logprobs=OLD, rollout_logprobs=ROLLOUT, loss_mask=MASK, low=2.0
        )


def test_kl_estimators_closed_forms_and_gradients():
    lp = torch.tensor([[-1.0, -2.0]], dtype=torch.float64, requires_grad=True)
    ref = torch.tensor([[-1.5, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.bool)
    d = ref - lp.detach()
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k1"), -d)
    torch.testing.assert_close(kl_penalty(lp, ref, mask, "k2"), 0.5 * d * d)
    k3 = kl_penalty(lp, ref, mask, "k3")
    torch.testing.assert_close(k3, d.exp() - 1 - d)
    (grad,) = torch.autograd.grad(k3.sum(), lp)
    torch.testing.assert_close(grad, 1 - d.exp())  # d/dlp (e^d - 1 - d), d = ref - lp
    huge = kl_penalty(lp, torch.tensor([[1e4, 0.0]], dtype=torch.float64), mask, "k3")
    assert torch.isfinite(huge).all() and huge[0, 0].item() == pytest.approx(
        math.exp(20) - 1 - (1e4 + 1)
    )
    with pytest.raises(ValueError, match="estimator='k4'"):
        kl_penalty(lp, ref, mask, "k4")
