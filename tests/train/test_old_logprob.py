"""The old-logprob pass and the first update's fold (`megatron_rl.train.old_logprob`): the fold
trains as the full pass does, skips the pass's share it replaces, and gives way to the pass
where the update's forward is not the pass's."""

from __future__ import annotations

import types

import pytest
import torch
from trainer_testing import rendezvous, small_config

import megatron_rl.train.old_logprob as old_logprob
from megatron_rl.train.old_logprob import fold_blocker
from megatron_rl.train.trainer import Trainer

# Adam moves a weight by ~lr (3e-3) whatever its gradient's size, so where a gradient is as small
# as the two passes' rounding differences the weights part by a fraction of a step: within 1e-7
# on AVX-512 kernels, more on AVX2 ones (docs/testing.md). 1% of one step; a wrong ratio moves
# whole rows by ~lr.
ADAM_ATOL = 3e-5

FORWARD_ONLY_PASS = old_logprob.forward_only_pass
QUIET = types.SimpleNamespace(hidden_dropout=0.0, attention_dropout=0.0, moe_input_jitter_eps=None)


def _one_step(tmp_path, name: str, monkeypatch, **flags):
    """One step of a fresh trainer: (its weights after it, its metrics, the micro-batches each
    forward-only pass ran)."""
    passes: list[int] = []

    def counting(model, micro_batches, *args, **kwargs):
        passes.append(len(micro_batches))
        return FORWARD_ONLY_PASS(model, micro_batches, *args, **kwargs)

    monkeypatch.setattr(old_logprob, "forward_only_pass", counting)
    config = small_config(tmp_path, run_dir=str(tmp_path / name), **flags)
    trainer = Trainer(config, **rendezvous(tmp_path, name))
    try:
        metrics = trainer.step()
        weights = {k: v.detach().clone() for k, v in trainer.model.module.named_parameters()}
    finally:
        trainer.close()
    return weights, metrics, passes


def test_first_update_fold_trains_as_the_full_pass(tmp_path, monkeypatch):
    """N = 2: the folded step's weights and metrics match the full pass's within float rounding
    (the fold's ratio is exactly 1 where the pass's is 1 +- ~1e-7), and its forward-only pass
    covers mini-batch 1 only."""
    folded, m_fold, p_fold = _one_step(tmp_path, "fold", monkeypatch)
    full, m_full, p_full = _one_step(
        tmp_path, "full", monkeypatch, first_update_old_logprobs="pass"
    )
    assert p_full == [4] and p_fold == [2]  # 2 mini-batches x 2 micro-batches of 4 samples
    for name, weight in full.items():
        torch.testing.assert_close(folded[name], weight, rtol=1e-5, atol=ADAM_ATOL, msg=name)
    for key in ("mismatch/train_rollout_logprob_abs_gap", "mismatch/train_rollout_k3"):
        assert abs(m_fold[key] - m_full[key]) <= 1e-6, key
    assert m_fold["entropy"] == pytest.approx(m_full["entropy"], rel=1e-6)
    assert m_fold["grad_norm"] == pytest.approx(m_full["grad_norm"], rel=1e-5)


def test_on_policy_step_runs_no_forward_only_pass(tmp_path, monkeypatch):
    """N = 1 (one update per rollout): no forward-only pass at all, the update's ratios are
    exactly 1, and the mismatch and entropy metrics are still reported."""
    _, metrics, passes = _one_step(tmp_path, "n1", monkeypatch, global_batch_size=16)
    assert passes == []
    assert metrics["policy/log_ratio_max"] == 0.0 and metrics["policy/log_ratio_min"] == 0.0
    assert metrics["mismatch/train_rollout_logprob_abs_gap"] >= 0.0
    assert metrics["entropy"] > 0.0


def test_rollout_correction_that_only_weights_folds(tmp_path, monkeypatch):
    """tis-token reweights by the ratio without masking: the fold computes it from the update's
    own log-probs and trains as the pass does."""
    folded, _, p_fold = _one_step(tmp_path, "tis_fold", monkeypatch, rollout_correction="tis-token")
    full, _, _ = _one_step(
        tmp_path,
        "tis_full",
        monkeypatch,
        rollout_correction="tis-token",
        first_update_old_logprobs="pass",
    )
    assert p_fold == [2]
    for name, weight in full.items():
        torch.testing.assert_close(folded[name], weight, rtol=1e-5, atol=ADAM_ATOL, msg=name)


@pytest.mark.parametrize(
    ("flags", "model", "reason"),
    [
        ({"first_update_old_logprobs": "pass"}, QUIET, "--first-update-old-logprobs pass"),
        ({"routing_replay": "r2"}, QUIET, "--routing-replay r2"),
        ({"routing_replay": "r3"}, QUIET, "--routing-replay r3"),
        ({"rollout_correction": "mis-token"}, QUIET, "--rollout-correction mis-token masks"),
        ({"rollout_correction": "icepop"}, QUIET, "--rollout-correction icepop masks"),
        ({"rollout_correction": "m2po"}, QUIET, "--rollout-correction m2po masks"),
        ({}, types.SimpleNamespace(hidden_dropout=0.1), "hidden_dropout"),
        ({}, types.SimpleNamespace(attention_dropout=0.1), "attention_dropout"),
        ({}, types.SimpleNamespace(moe_input_jitter_eps=0.01), "moe_input_jitter_eps"),
    ],
)
def test_fold_blocker_names_what_keeps_the_full_pass(tmp_path, flags, model, reason):
    blocker = fold_blocker(small_config(tmp_path, **flags), model)
    assert blocker is not None and reason in blocker


@pytest.mark.parametrize("correction", ["none", "tis-token", "tis-seq", "decoupled"])
def test_fold_blocker_allows_the_quiet_model(tmp_path, correction):
    assert fold_blocker(small_config(tmp_path, rollout_correction=correction), QUIET) is None
