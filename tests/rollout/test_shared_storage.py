"""The tensor transport's shared-memory buffers survive a slow ``torch_shm_manager``."""

from __future__ import annotations

import pytest
import torch

from megatron_rl.rollout.weight_sync import (
    SHM_ATTEMPTS,
    SHM_MANAGER_TIMEOUT,
    new_shared_storage,
    staging,
)


def _failing(times: int, message: str = SHM_MANAGER_TIMEOUT):
    real = torch.UntypedStorage._new_shared
    calls = []

    def new_shared(nbytes):
        calls.append(nbytes)
        if len(calls) <= times:
            raise RuntimeError(f"{message}\nException raised from recv at socket.h:67")
        return real(nbytes)

    return new_shared, calls


def test_a_manager_timeout_is_retried_and_the_buffer_is_shared(monkeypatch):
    new_shared, calls = _failing(times=SHM_ATTEMPTS - 1)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", staticmethod(new_shared))
    monkeypatch.setattr(staging.time, "sleep", lambda s: None)
    storage = new_shared_storage(64)
    assert storage.nbytes() == 64 and storage.is_shared()
    assert calls == [64] * SHM_ATTEMPTS


def test_the_last_timeout_and_any_other_error_are_raised(monkeypatch):
    monkeypatch.setattr(staging.time, "sleep", lambda s: None)
    new_shared, calls = _failing(times=SHM_ATTEMPTS)
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", staticmethod(new_shared))
    with pytest.raises(RuntimeError, match="timed out"):
        new_shared_storage(64)
    assert len(calls) == SHM_ATTEMPTS
    new_shared, calls = _failing(times=1, message="No space left on device")
    monkeypatch.setattr(torch.UntypedStorage, "_new_shared", staticmethod(new_shared))
    with pytest.raises(RuntimeError, match="No space left"):
        new_shared_storage(64)
    assert len(calls) == 1  # not retried
