"""`megatron_rl.threads`: intra-op threads from the cores available and the local processes."""

from __future__ import annotations

import pytest
import torch

from megatron_rl import threads


@pytest.mark.parametrize(
    ("cores", "local", "env", "expected"),
    [
        (2, 1, None, 1),  # this project's machine: one core left to the system and other jobs
        (16, 1, None, 15),
        (16, 8, None, 1),  # 8 local ranks (torchrun on a GPU node)
        (64, 4, None, 15),
        (1, 1, None, 1),
        (16, 8, "3", 3),  # the user's OMP_NUM_THREADS wins
    ],
)
def test_auto_threads_divide_the_cores_over_the_local_processes(
    monkeypatch, cores, local, env, expected
):
    monkeypatch.setattr(threads, "cores_available", lambda: cores)
    if env is None:
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
    else:
        monkeypatch.setenv("OMP_NUM_THREADS", env)
    assert threads.auto_threads(local) == expected


def test_configure_threads_sets_torch_and_an_explicit_count_wins(monkeypatch):
    before = torch.get_num_threads()
    try:
        assert threads.configure_threads(1) == 1 and torch.get_num_threads() == 1
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        assert threads.configure_threads(None) == 2 and torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)
    with pytest.raises(ValueError, match="num_threads=0"):
        threads.configure_threads(0)
    monkeypatch.setenv("OMP_NUM_THREADS", "many")
    with pytest.raises(ValueError, match="OMP_NUM_THREADS='many'"):
        threads.auto_threads(1)
