"""Fixtures for the loss tests."""

from __future__ import annotations

import pytest
from loss_batches import Batch, make_batch


@pytest.fixture
def batch() -> Batch:
    return make_batch()
