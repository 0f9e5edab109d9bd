"""How the trainer reads its per-micro-batch loss metrics (`megatron_rl.train.trainer`)."""

from __future__ import annotations

import torch


def test_loss_metrics_are_read_out_as_per_item_floats_would_be():
    """The trainer reads each micro-batch's loss metrics at once per dtype; the values are the
    ones ``float(v)`` gives one by one (float64 and float32 tensors, numbers, 1-element)."""
    from megatron_rl.train.trainer import _as_floats

    values = [
        torch.tensor(0.1, dtype=torch.float64),
        torch.tensor(0.1, dtype=torch.float32),
        3,
        torch.tensor([2.5]),
        torch.tensor(7, dtype=torch.int64),
        torch.tensor(1.0 / 3.0, dtype=torch.float32, requires_grad=True) * 1,
    ]
    assert _as_floats(values) == [float(v) for v in values]
    assert all(type(v) is float for v in _as_floats(values))
