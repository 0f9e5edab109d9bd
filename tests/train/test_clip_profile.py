"""The trainer reports a step's position-wise clip profile from its pooled counts (the mean of
micro-batch fractions would weigh a micro-batch with few tokens in a bin like one with many)."""

from __future__ import annotations

import pytest
from trainer_testing import rendezvous, small_config

from megatron_rl.train.trainer import Trainer


def test_the_step_clip_profile_is_the_ratio_of_pooled_counts(tmp_path, monkeypatch):
    # a parity reward gives every group mixed rewards, and a clip range of 1e-6 clips most
    # tokens of the second update (the first moved the weights)
    (tmp_path / "parity_reward.py").write_text(
        "def reward(response, answer):\n    return float(sum(map(ord, response)) % 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = small_config(
        tmp_path,
        loss="grpo",
        clip_low=1e-6,
        clip_high=1e-6,
        micro_batch_size=2,
        reward="parity_reward:reward",
    )
    trainer = Trainer(config, **rendezvous(tmp_path))
    try:
        metrics = trainer.step()
    finally:
        trainer.close()
    fractions = []
    for k in range(10):
        tokens = metrics[f"policy/clip_pos_tokens_{k}"]
        clipped = metrics[f"policy/clip_pos_clipped_{k}"]
        expected = clipped / tokens if tokens else 0.0
        assert metrics[f"policy/clip_frac_pos_{k}"] == pytest.approx(expected, abs=1e-12)
        if tokens:
            fractions.append(expected)
    assert max(fractions) > 0  # the test sees clipping
    mean = sum(fractions) / len(fractions)
    std = (sum((f - mean) ** 2 for f in fractions) / len(fractions)) ** 0.5
    assert metrics["policy/clip_position_cv"] == pytest.approx(std / mean, abs=1e-9)
