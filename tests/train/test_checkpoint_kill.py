"""SIGKILL at every filesystem step of a save (and of pruning and re-saving) loses nothing.

A child process saves steps 1, 2, 3 (keeping 2), re-saves step 3, then saves step 4, and kills
itself with SIGKILL right before its k-th filesystem operation (file write, fsync, rename,
removal); k runs over every operation of that sequence. After each kill the checkpoint root
must load and verify (sha256) at a step no older than the last save that returned, hold no
incomplete step folder that counts as complete, and the next save must clean every leftover.
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_rl.train.checkpoint import latest_step, load_training_state, save_training_state

CHILD = textwrap.dedent(
    """
    import os, shutil, signal, sys, torch
    from megatron_rl.train import checkpoint

    save_dir, kill_at = sys.argv[1], int(sys.argv[2])
    count = [0]

    def before(real):
        def op(*args, **kwargs):
            count[0] += 1
            if count[0] == kill_at:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return op

    checkpoint.torch = type("T", (), {"save": staticmethod(before(torch.save)),
                                      "load": staticmethod(torch.load),
                                      "is_tensor": staticmethod(torch.is_tensor)})
    checkpoint.os.replace = before(os.replace)
    checkpoint.shutil.rmtree = before(shutil.rmtree)
    checkpoint.fsync_dir = before(checkpoint.fsync_dir)
    checkpoint.fsync_file = before(checkpoint.fsync_file)
    checkpoint.atomic_write_text = before(checkpoint.atomic_write_text)

    def save(step, seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        checkpoint.save_training_state(
            save_dir, step, model=model, optimizer=optimizer, rl_state={"step": step}, keep_last=2
        )
        print("saved", step, flush=True)

    for step, seed in ((1, 1), (2, 2), (3, 3), (3, 33), (4, 4)):
        save(step, seed)
    print("ops", count[0], flush=True)
    """
)


def _run_child(save_dir, kill_at: int) -> tuple[int, list[str]]:
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(save_dir), str(kill_at)],
        capture_output=True,
        text=True,
        timeout=120,
    )
    return result.returncode, result.stdout.split("\n")


def _linear():
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


@pytest.mark.slow
def test_sigkill_at_every_filesystem_step_loses_no_committed_checkpoint(tmp_path):
    code, out = _run_child(tmp_path / "count", kill_at=0)
    assert code == 0, out
    total = int(next(line for line in out if line.startswith("ops")).split()[1])
    for kill_at in range(1, total + 1):
        save_dir = tmp_path / f"kill_{kill_at}"
        code, out = _run_child(save_dir, kill_at)
        assert code == -9, (kill_at, code, out)  # it really died by SIGKILL
        returned = [int(line.split()[1]) for line in out if line.startswith("saved")]
        if not save_dir.exists() or latest_step(str(save_dir)) is None:
            assert not returned, (kill_at, "a committed step was lost")
            continue
        model, optimizer = _linear()
        state = load_training_state(str(save_dir), model=model, optimizer=optimizer)
        assert state["step"] >= (returned[-1] if returned else 0), (kill_at, state)
        model, optimizer = _linear()  # the next save removes every leftover
        save_training_state(
            str(save_dir), 9, model=model, optimizer=optimizer, rl_state={"step": 9}, keep_last=2
        )
        leftovers = [n for n in os.listdir(save_dir) if n.startswith(".tmp")]
        assert not leftovers, (kill_at, leftovers)
        assert all(
            latest_step(str(save_dir)) == 9 or not name.startswith("step_")
            for name in os.listdir(save_dir)
        )
