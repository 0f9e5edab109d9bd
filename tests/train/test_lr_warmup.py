"""``--lr-warmup-iters``: the learning rate ramps linearly over the first steps, as megatron's."""

from __future__ import annotations

import pytest
import torch
from trainer_testing import rendezvous, small_config

from megatron_rl.backend.optimizer_config import OptimizerConfig, step_lr
from megatron_rl.train.trainer import Trainer


def test_step_lr_ramps_linearly_then_holds():
    config = OptimizerConfig(lr=1e-3, lr_warmup_iters=4)
    assert [step_lr(config, s) for s in range(6)] == pytest.approx(
        [2.5e-4, 5e-4, 7.5e-4, 1e-3, 1e-3, 1e-3]
    )
    assert step_lr(OptimizerConfig(lr=1e-3), 0) == 1e-3


def test_a_negative_warmup_names_the_flag():
    with pytest.raises(ValueError, match="--lr-warmup-iters=-1"):
        OptimizerConfig(lr_warmup_iters=-1)


def test_the_first_update_moves_the_weights_by_the_warmed_up_rate(tmp_path):
    """Adam's first update moves each weight by about its learning rate: a quarter of it at the
    first of four warmup steps."""
    moves = {}
    for warmup in (0, 4):
        config = small_config(tmp_path / f"w{warmup}", lr=1e-2, lr_warmup_iters=warmup)
        trainer = Trainer(config, **rendezvous(tmp_path, f"rdzv{warmup}"))
        try:
            before = [p.detach().clone() for p in trainer.model.parameters()]
            metrics = trainer.step()
            assert trainer.optimizer.param_groups[0]["lr"] == pytest.approx(metrics["lr"])
            after = list(trainer.model.parameters())
            moves[warmup] = max(
                float((a.detach() - b).abs().max()) for a, b in zip(after, before, strict=True)
            )
        finally:
            trainer.close()
        assert metrics["lr"] == pytest.approx(1e-2 if warmup == 0 else 2.5e-3)
    # two updates per step (N = 2): at most 2 lr per weight, and the warmed-up run a quarter
    assert moves[0] == pytest.approx(4 * moves[4], rel=0.05)
    assert torch.isfinite(torch.tensor(list(moves.values()))).all()
