"""Packed (THD + cu_seqlens) and padded inputs give identical losses and gradients; bad input
fails with an error naming the tensor; NaN outside the mask never leaks."""

from __future__ import annotations

import pytest
import torch
from loss_batches import SEQUENCE_ADVANTAGE_LOSSES, loss_and_grad, make_batch
from paper_losses import PAPER_LOSSES

from megatron_rl.losses import AGGREGATION_MODES, available_losses, compute_policy_loss


def _pack(b, adv_BT=None):
    """Packed copy of a padded batch: masked tokens back to back, plus cu_seqlens."""
    mask = b.loss_mask
    lengths = torch.tensor(b.lengths)
    cu = torch.cat([torch.zeros(1, dtype=torch.long), lengths.cumsum(0)])
    lp = b.logprobs.detach()[mask].clone().requires_grad_()
    kw = dict(
        logprobs=lp,
        old_logprobs=b.old_logprobs[mask],
        advantages=b.advantages if adv_BT is None else adv_BT[mask],
        loss_mask=torch.ones(int(mask.sum()), dtype=torch.bool),
        cu_seqlens=cu,
    )
    return kw


@pytest.mark.parametrize("name", PAPER_LOSSES)
@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_packed_and_padded_give_identical_loss_and_gradients(name, mode):
    b = make_batch(num_seqs=7, max_len=11, seed=21)
    loss_pad, grad_pad = loss_and_grad(
        name, loss_agg_mode=mode, max_response_length=16, **b.kwargs()
    )
    packed = _pack(b)
    loss_packed, grad_packed = loss_and_grad(
        name, loss_agg_mode=mode, max_response_length=16, **packed
    )
    torch.testing.assert_close(loss_packed, loss_pad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_packed, grad_pad[b.loss_mask], rtol=1e-12, atol=1e-14)


@pytest.mark.parametrize("name", sorted(set(PAPER_LOSSES) - set(SEQUENCE_ADVANTAGE_LOSSES)))
def test_packed_per_token_advantages_match_padded(name):
    b = make_batch(num_seqs=5, max_len=8, seed=22)
    adv_BT = torch.randn(b.loss_mask.shape, dtype=torch.float64)
    loss_pad, grad_pad = loss_and_grad(name, **(b.kwargs() | {"advantages": adv_BT}))
    loss_packed, grad_packed = loss_and_grad(name, **_pack(b, adv_BT))
    torch.testing.assert_close(loss_packed, loss_pad)
    torch.testing.assert_close(grad_packed, grad_pad[b.loss_mask])


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_epic_plain_packed_and_padded_give_identical_loss_and_gradients(mode):
    b = make_batch(num_seqs=7, max_len=11, seed=21)
    kw = dict(loss_agg_mode=mode, max_response_length=16, variant="plain")
    loss_pad, grad_pad = loss_and_grad("epic", **kw, **b.kwargs())
    loss_packed, grad_packed = loss_and_grad("epic", **kw, **_pack(b))
    torch.testing.assert_close(loss_packed, loss_pad, rtol=1e-12, atol=1e-14)
    torch.testing.assert_close(grad_packed, grad_pad[b.loss_mask], rtol=1e-12, atol=1e-14)
    _, grad_dual = loss_and_grad("epic", **(kw | {"variant": "dual"}), **b.kwargs())
    assert not torch.equal(grad_dual, grad_pad), "the batch must tell the variants apart"


def test_epic_plain_packed_per_token_advantages_match_padded():
    b = make_batch(num_seqs=5, max_len=8, seed=22)
    gen = torch.Generator().manual_seed(22)
    adv_BT = torch.randn(b.loss_mask.shape, generator=gen, dtype=torch.float64)
    padded = b.kwargs() | {"advantages": adv_BT}
    loss_pad, grad_pad = loss_and_grad("epic", variant="plain", **padded)
    loss_packed, grad_packed = loss_and_grad("epic", variant="plain", **_pack(b, adv_BT))
    torch.testing.assert_close(loss_packed, loss_pad)
    torch.testing.assert_close(grad_packed, grad_pad[b.loss_mask])
    _, grad_dual = loss_and_grad("epic", variant="dual", **padded)
    assert not torch.equal(grad_dual, grad_pad), "the batch must tell the variants apart"


def test_packed_per_token_loss_is_returned_in_packed_order():
    b = make_batch(seed=23)
    pad = compute_policy_loss("grpo", **b.kwargs()).per_token_loss
    packed = compute_policy_loss("grpo", **_pack(b)).per_token_loss
    torch.testing.assert_close(packed, pad[b.loss_mask])


@pytest.mark.parametrize("name", PAPER_LOSSES)
def test_nan_and_inf_outside_the_mask_do_not_leak(name):
    b = make_batch(seed=24)
    clean_loss, clean_grad = loss_and_grad(name, **b.kwargs())
    outside = ~b.loss_mask
    lp = b.logprobs.detach().clone()
    lp[outside] = float("nan")
    old = b.old_logprobs.clone()
    old[outside] = float("inf")
    dirty = b.kwargs() | {"logprobs": lp.requires_grad_(), "old_logprobs": old}
    loss, grad = loss_and_grad(name, **dirty)
    torch.testing.assert_close(loss, clean_loss)
    torch.testing.assert_close(grad, clean_grad)
    assert torch.isfinite(grad).all() and (grad[outside] == 0).all()


@pytest.mark.parametrize("tensor", ["logprobs", "old_logprobs", "advantages"])
def test_non_finite_inside_the_mask_is_an_error_naming_the_tensor(tensor):
    b = make_batch(seed=25)
    kw = b.kwargs()
    bad = kw[tensor].detach().clone()
    bad.view(-1)[0] = float("nan")
    kw[tensor] = bad
    with pytest.raises(ValueError, match=rf"^{tensor} has 1 non-finite"):
        compute_policy_loss("grpo", **kw)


@pytest.mark.parametrize(
    ("field", "value", "match"),
    [
        ("old_logprobs", torch.zeros(6, 8), r"old_logprobs has shape \(6, 8\), expected \(6, 9\)"),
        ("loss_mask", torch.ones(6, 9, 1), "loss_mask has shape"),
        ("advantages", torch.zeros(5), r"advantages has shape \(5,\), expected \[6\]"),
        ("loss_mask", torch.full((6, 9), 2.0), "loss_mask must be bool or hold only 0 and 1"),
    ],
)
def test_mismatched_inputs_name_the_tensor(field, value, match):
    kw = make_batch(seed=26).kwargs() | {field: value}
    with pytest.raises(ValueError, match=match):
        compute_policy_loss("vespo", **kw)


def test_bad_cu_seqlens_is_an_error():
    packed = _pack(make_batch(seed=27))
    packed["cu_seqlens"] = packed["cu_seqlens"] + 1
    with pytest.raises(ValueError, match="cu_seqlens must start at 0"):
        compute_policy_loss("grpo", **packed)


@pytest.mark.parametrize("mode", AGGREGATION_MODES)
def test_all_zero_mask_is_an_error_unless_a_global_denominator_is_given(mode):
    b = make_batch(seed=28)
    kw = b.kwargs() | {"loss_mask": torch.zeros_like(b.loss_mask)}
    with pytest.raises(ValueError, match="loss_mask selects no"):
        compute_policy_loss("grpo", loss_agg_mode=mode, **kw)
    out = compute_policy_loss(
        "grpo", loss_agg_mode=mode, global_num_tokens=10, global_num_seqs=3, **kw
    )
    assert out.loss.item() == 0.0


def test_bf16_inputs_are_computed_in_float32_and_return_bf16_per_token_loss():
    b = make_batch(seed=29, dtype=torch.float32)
    lp = b.logprobs.detach().bfloat16().requires_grad_()
    out = compute_policy_loss("vespo", **(b.kwargs() | {"logprobs": lp}))
    assert out.loss.dtype == torch.float32 and out.per_token_loss.dtype == torch.bfloat16
    out.loss.backward()
    assert lp.grad.dtype == torch.bfloat16 and torch.isfinite(lp.grad.float()).all()


def test_float64_inputs_give_float64_loss_and_metrics_for_every_loss():
    b = make_batch(seed=30)
    for name in available_losses():
        out = compute_policy_loss(name, **b.kwargs())
        assert out.loss.dtype == torch.float64 and out.per_token_loss.dtype == torch.float64
        for key, value in out.metrics.items():
            assert value.dtype == torch.float64, key


def test_every_registered_loss_reports_namespaced_detached_metrics():
    b = make_batch(seed=30)
    for name in available_losses():
        out = compute_policy_loss(name, **b.kwargs())
        assert "policy/seq_ess" in out.metrics and "policy/log_ratio_max" in out.metrics
        for key, value in out.metrics.items():
            assert "/" in key and not value.requires_grad and value.dim() == 0, key
            assert torch.isfinite(value), key
