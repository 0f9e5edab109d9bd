"""The one non-finite policy of the trainer: skip a bad update, stop after too many in a row.

An update is *bad* when any rank saw a non-finite log-prob inside the loss mask or a non-finite
gradient norm; every rank then skips it (gradients zeroed, parameters untouched). After
``max_consecutive`` bad updates in a row the guard is `exhausted`: the trainer applies no further
update in that step, finishes the step, and the run loop saves the last good state and stops.
A good update resets the count. The count is checked after every update, not once per step.
"""

from __future__ import annotations

import logging

import torch

logger = logging.getLogger(__name__)


class NonFiniteGuard:
    """Counts consecutive skipped updates; ``consecutive`` and ``exhausted`` are public."""

    def __init__(self, max_consecutive: int) -> None:
        if max_consecutive < 1:
            raise ValueError(f"max_consecutive={max_consecutive}: must be >= 1")
        self.max_consecutive = max_consecutive
        self.consecutive = 0

    @property
    def exhausted(self) -> bool:
        """Whether the run must stop (``max_consecutive`` bad updates in a row)."""
        return self.consecutive >= self.max_consecutive

    @staticmethod
    def finite(values: torch.Tensor, mask: torch.Tensor) -> bool:
        """Whether every value inside ``mask`` is finite (this rank only; no collective)."""
        return bool(torch.isfinite(values.detach()[mask]).all())

    def record(self, good: bool, where: str) -> None:
        """Count one update's outcome (the same on every rank); warn on a skip."""
        if good:
            self.consecutive = 0
            return
        self.consecutive += 1
        logger.warning(
            "%s: non-finite log-probs or gradient norm; update skipped (%d in a row, the run "
            "stops at %d)",
            where,
            self.consecutive,
            self.max_consecutive,
        )

    def stop_message(self, step: int) -> str:
        return (
            f"{self.consecutive} consecutive updates had non-finite log-probs or gradients; "
            f"stopped at step {step} and saved the last good state (lower --lr, check the data, "
            "or raise --max-bad-steps)"
        )

    def state_dict(self) -> dict:
        return {"consecutive": self.consecutive}

    def load_state_dict(self, state: dict) -> None:
        self.consecutive = int(state["consecutive"])
