"""SIGKILL at every filesystem step of a save (and of pruning and re-saving) loses nothing.

A child process saves steps 1, 2, 3 (keeping 2), re-saves step 3, then saves step 4, and kills
itself with SIGKILL right before its k-th filesystem operation (file write, fsync, rename,
removal); k runs over every operation of that sequence. After each kill the checkpoint root
must load and verify (sha256) at a step no older than the last save that returned, hold no
incomplete step folder that counts as complete, and the next save must clean every leftover.
The children are forked from one process that imported the checkpoint code once (a fresh
interpreter per child took over a minute each on a loaded machine).
"""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

from megatron_rl.train.checkpoint.folders import latest_step
from megatron_rl.train.checkpoint.load import load_training_state
from megatron_rl.train.checkpoint.save import save_training_state

# One process imports the checkpoint code once, then forks one child per kill point (a fresh
# copy of a process that has saved nothing); the child runs the save sequence and SIGKILLs
# itself before its kill_at-th operation (0: never). Per child it prints "<kill_at> saved <step>"
# after each save that returned, and the parent "<kill_at> status <code>" (-9: SIGKILL).
CHILD = textwrap.dedent(
    """
    import importlib, os, pkgutil, shutil, signal, sys, torch
    from megatron_rl.train import checkpoint
    from megatron_rl.train.checkpoint import save as checkpoint_save, shards

    root, first, last = sys.argv[1], int(sys.argv[2]), int(sys.argv[3])
    count = [0]
    kill_at = [0]

    def before(real):
        def op(*args, **kwargs):
            count[0] += 1
            if count[0] == kill_at[0]:
                os.kill(os.getpid(), signal.SIGKILL)
            return real(*args, **kwargs)
        return op

    shards.torch = type("T", (), {"save": staticmethod(before(torch.save))})  # the shard files
    os.replace = before(os.replace)
    shutil.rmtree = before(shutil.rmtree)
    for info in pkgutil.iter_modules(checkpoint.__path__):  # wherever the package binds them
        module = importlib.import_module(f"{checkpoint.__name__}.{info.name}")
        for name in ("fsync_dir", "fsync_file", "atomic_write_text"):
            if hasattr(module, name):
                setattr(module, name, before(getattr(module, name)))

    def save(save_dir, step, seed):
        torch.manual_seed(seed)
        model = torch.nn.Linear(4, 3)
        optimizer = torch.optim.AdamW(model.parameters(), lr=0.1)
        model(torch.randn(2, 4)).sum().backward()
        optimizer.step()
        checkpoint_save.save_training_state(
            save_dir, step, model=model, optimizer=optimizer, rl_state={"step": step}, keep_last=2
        )
        print(kill_at[0], "saved", step, flush=True)

    warm = torch.nn.Linear(4, 3)  # the first AdamW step imports lazily (1.5 s): once, here
    torch.optim.AdamW(warm.parameters(), lr=0.1).step()
    for k in range(first, last + 1):
        pid = os.fork()
        if pid == 0:
            kill_at[0] = k
            for step, seed in ((1, 1), (2, 2), (3, 3), (3, 33), (4, 4)):
                save(os.path.join(root, f"kill_{k}"), step, seed)
            print(k, "ops", count[0], flush=True)
            os._exit(0)
        _, status = os.waitpid(pid, 0)
        print(k, "status", os.waitstatus_to_exitcode(status), flush=True)
    """
)


def _run_children(root, first: int, last: int) -> dict[int, list[list[str]]]:
    """{kill_at: its output lines, split} for kill points ``first..last``."""
    result = subprocess.run(
        [sys.executable, "-c", CHILD, str(root), str(first), str(last)],
        capture_output=True,
        text=True,
        timeout=3600,  # a hang guard only: one import, then forks (seconds on an idle machine)
    )
    assert result.returncode == 0, result.stderr[-3000:]
    lines: dict[int, list[list[str]]] = {}
    for line in result.stdout.splitlines():
        words = line.split()
        if len(words) == 3 and words[0].isdigit():
            lines.setdefault(int(words[0]), []).append(words[1:])
    return lines


def _linear():
    model = torch.nn.Linear(4, 3)
    return model, torch.optim.AdamW(model.parameters(), lr=0.1)


@pytest.mark.slow
def test_sigkill_at_every_filesystem_step_loses_no_committed_checkpoint(tmp_path):
    counted = _run_children(tmp_path / "count", 0, 0)[0]
    assert ["status", "0"] in counted, counted
    total = int(next(value for word, value in counted if word == "ops"))
    children = _run_children(tmp_path, 1, total)
    for kill_at in range(1, total + 1):
        save_dir = tmp_path / f"kill_{kill_at}"
        out = children[kill_at]
        assert ["status", "-9"] in out, (kill_at, out)  # it really died by SIGKILL
        returned = [int(value) for word, value in out if word == "saved"]
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
