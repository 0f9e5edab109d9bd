"""Per-update diagnostics: ratio quantiles from histograms, every update's grad norm, and the
train/rollout gap by response position."""

from __future__ import annotations

import math

import pytest
import torch
from trainer_testing import rendezvous, small_config

from megatron_rl.train.old_logprob import OldLogprobs
from megatron_rl.train.ratio_quantiles import (
    NUM_BINS,
    log_ratio_counts,
    quantile_metrics,
    quantiles,
)


def test_quantiles_are_within_the_bins_resolution_of_the_exact_ones():
    generator = torch.Generator().manual_seed(0)
    d = torch.randn(100_000, generator=generator, dtype=torch.float64) * 0.3
    d[:50] = 0.0  # ratio exactly 1
    counts = log_ratio_counts(d)
    assert int(counts.sum()) == d.numel() and counts.numel() == NUM_BINS
    qs = (0.001, 0.01, 0.5, 0.99, 0.999)
    exact = torch.quantile(d, torch.tensor(qs, dtype=torch.float64)).tolist()
    for q, got, want in zip(qs, quantiles(counts.tolist(), qs), exact, strict=True):
        assert abs(math.log(got) - want) <= 0.025 * abs(want) + 1e-6, (q, got, want)


def test_a_histogram_of_exact_ones_reports_exactly_one_and_an_empty_one_nan():
    assert quantiles(log_ratio_counts(torch.zeros(7)).tolist()) == [1.0] * 5
    assert all(math.isnan(x) for x in quantiles([0] * NUM_BINS))
    counts = log_ratio_counts(torch.tensor([float("nan"), float("inf"), 1e3, -1e3]))
    assert int(counts.sum()) == 2  # non-finite values are not counted; +-1e3 in the outer bins
    assert quantiles(counts.tolist(), (0.0, 1.0)) == [math.exp(-100.0), math.exp(100.0)]
    assert set(quantile_metrics("pi_mu", counts.tolist())) == {
        f"ratio/pi_mu/q{q}" for q in ("0.001", "0.01", "0.5", "0.99", "0.999")
    }
    with pytest.raises(ValueError, match="quantile 2: must be in"):
        quantiles(counts.tolist(), (2,))


def test_the_gap_by_position_splits_the_tokens_of_each_response_by_their_position():
    class Config:
        class rollout:
            temperature = 1.0

    old = OldLogprobs([], Config, weight_version=0)
    # two rows: response positions 0..39 and 0..19 (the mask's True run), gaps = position
    mask = torch.zeros(2, 50, dtype=torch.bool)
    mask[0, 5:45] = True
    mask[1, 10:30] = True
    positions = (mask.long().cumsum(-1) - 1)[mask]
    old.gaps[(0, 0)] = -positions.double() / 1000
    old.positions[(0, 0)] = positions
    old.entropies[(0, 0)] = torch.zeros(positions.numel())
    metrics = {}
    old.finish(metrics)
    gap = "mismatch/train_rollout_logprob_abs_gap"
    assert metrics[f"{gap}/pos_0_15"] == pytest.approx(7.5e-3)
    assert metrics[f"{gap}/pos_16_31"] == pytest.approx(
        ((16 + 19) / 2 * 4 + (16 + 31) / 2 * 16) / 20 / 1000
    )
    assert metrics[f"{gap}/pos_32_63"] == pytest.approx(35.5e-3)
    assert f"{gap}/pos_64_127" not in metrics  # no token there
    assert metrics[gap] == pytest.approx(float(positions.double().mean()) / 1000)


def test_a_step_reports_every_updates_grad_norm_and_its_ratio_quantiles(tmp_path):
    from megatron_rl.train.trainer import Trainer

    config = small_config(tmp_path, rollout_dtype="bfloat16", lr=1e-2, lr_warmup_iters=0)  # N = 2
    trainer = Trainer(config, **rendezvous(tmp_path))
    norms = []
    real_step = trainer.optimizer.step

    def step():
        norm = real_step()
        norms.append(norm)
        return norm

    trainer.optimizer.step = step
    try:
        metrics = {}
        while len(norms) < 2 or norms[0] == 0.0:  # the first update moved the weights
            norms.clear()
            metrics = trainer.step()
    finally:
        trainer.close()
    assert len(norms) == 2
    assert metrics["grad_norm/max"] == pytest.approx(max(norms))
    assert metrics["grad_norm/mean"] == pytest.approx(sum(norms) / 2)
    assert metrics["grad_norm"] == pytest.approx(norms[-1])  # the last update's, as before
    # the first update's ratio is exactly 1 (its own forward); the second's moved
    assert metrics["ratio/pi_old/q0.01"] <= 1.0 <= metrics["ratio/pi_old/q0.99"]
    assert metrics["ratio/pi_old/q0.001"] < 1.0 or metrics["ratio/pi_old/q0.999"] > 1.0
    # bf16 rollouts: the engine's log-probs differ from the fp32 trainer's
    assert metrics["ratio/pi_mu/q0.001"] < 1.0 < metrics["ratio/pi_mu/q0.999"]
