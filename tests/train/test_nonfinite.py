"""The trainer's one non-finite policy: count consecutive bad updates, stop at the limit."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.train.nonfinite import NonFiniteGuard


def test_consecutive_bad_updates_exhaust_the_guard_and_a_good_one_resets_it():
    guard = NonFiniteGuard(max_consecutive=2)
    guard.record(False, "step 0 update 0")
    assert guard.consecutive == 1 and not guard.exhausted
    guard.record(True, "step 0 update 1")
    assert guard.consecutive == 0
    guard.record(False, "step 1 update 0")
    guard.record(False, "step 1 update 1")
    assert guard.exhausted
    assert "2 consecutive updates" in guard.stop_message(step=2)


def test_only_values_inside_the_mask_count():
    values = torch.tensor([[0.0, float("nan")], [float("inf"), -1.0]])
    assert NonFiniteGuard.finite(values, torch.tensor([[True, False], [False, True]]))
    assert not NonFiniteGuard.finite(values, torch.tensor([[True, True], [False, False]]))


def test_state_round_trips_and_a_zero_limit_is_refused():
    guard = NonFiniteGuard(3)
    guard.record(False, "x")
    other = NonFiniteGuard(3)
    other.load_state_dict(guard.state_dict())
    assert other.consecutive == 1
    with pytest.raises(ValueError, match="max_consecutive=0"):
        NonFiniteGuard(0)
