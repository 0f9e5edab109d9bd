"""Forward + backward + optimizer step of the megatron model on CPU lowers the loss."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
from megatron_rl.model import build_model, causal_lm_logits, preset_config


@pytest.fixture
def ws1_seed() -> int:
    return 7


def test_adamw_steps_reduce_loss_on_fixed_batch(ws1):
    config = preset_config("tiny")
    model = wrap_for_training(build_model(config))
    optimizer = build_optimizer(model, OptimizerConfig(lr=3e-3, clip_grad=1.0))
    tokens_BT = torch.randint(
        0, config.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0)
    )
    before = [p.detach().clone() for p in model.parameters()]
    losses, norms = [], []
    for _ in range(6):
        optimizer.zero_grad()
        logits_BTV = causal_lm_logits(model, tokens_BT[:, :-1])
        loss = F.cross_entropy(
            logits_BTV.reshape(-1, config.vocab_size), tokens_BT[:, 1:].reshape(-1)
        )
        loss.backward()
        norms.append(optimizer.step())
        losses.append(loss.item())
    print("losses", [round(x, 3) for x in losses])
    assert all(n > 0 and torch.isfinite(torch.tensor(n)) for n in norms)
    assert losses[-1] < losses[0] - 0.5, losses
    changed = [
        not torch.equal(a, b.detach()) for a, b in zip(before, model.parameters(), strict=True)
    ]
    assert all(changed), "some parameters were never updated"
