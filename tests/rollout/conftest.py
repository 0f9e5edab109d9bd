"""Fixtures for the rollout tests: loopback SGLang-like servers over a shared tiny engine."""

from __future__ import annotations

import contextlib

import pytest
from rollout_testing import make_engine

from megatron_rl.testing.loopback_server import LoopbackServer


@pytest.fixture(scope="module")
def shared_engine():
    return make_engine()


@pytest.fixture
def servers(shared_engine):
    """``servers(k)`` starts k loopback servers over one engine; all stop after the test."""
    started: list[LoopbackServer] = []

    def start(count: int = 1, engine=None) -> list[LoopbackServer]:
        new = [LoopbackServer(engine or shared_engine).start() for _ in range(count)]
        started.extend(new)
        return new

    yield start
    for server in started:
        with contextlib.suppress(OSError):
            server.stop()
