"""Nothing that might be the only copy of a checkpoint is deleted before this run has committed a
newer step of its own: a folder of damaged checkpoints stops the run untouched; pruning removes
only steps older than the one this run just committed; a same-step folder of another run is set
aside, not deleted; ``--load-ignore-existing`` starts fresh and keeps what it has not superseded.

"Another run's" folders are written into a scratch root and copied in: this process did not
commit them there.
"""

from __future__ import annotations

import os
import shutil

import pytest
import torch
from train_state_testing import linear_with_adam_state

from megatron_rl.train.checkpoint.folders import folder_problem
from megatron_rl.train.checkpoint.load import load_training_state
from megatron_rl.train.checkpoint.save import save_training_state


def _save_linear(save_dir, step: int, seed: int, keep_last: int = 2) -> None:
    model, optimizer = linear_with_adam_state(seed)
    save_training_state(
        str(save_dir), step, model=model, optimizer=optimizer, rl_state={"step": step},
        keep_last=keep_last,
    )  # fmt: skip


def _another_runs_root(tmp_path, steps, name: str = "ckpt"):
    """A root holding ``steps`` committed by "another run" (written elsewhere, copied in)."""
    scratch = tmp_path / f"{name}_written_elsewhere"
    for step in steps:
        _save_linear(scratch, step, seed=100 + step, keep_last=len(steps))
    shutil.copytree(scratch, tmp_path / name)
    return tmp_path / name


def _files(folder) -> dict[str, bytes]:
    """Every file under ``folder`` (relative path -> content)."""
    found = {}
    for dirpath, _, names in os.walk(folder):
        for name in names:
            path = os.path.join(dirpath, name)
            with open(path, "rb") as handle:
                found[os.path.relpath(path, folder)] = handle.read()
    return found


def test_a_run_on_a_folder_whose_every_checkpoint_is_damaged_stops_and_deletes_nothing(
    tmp_path, capsys
):
    from megatron_rl.train.__main__ import main

    root = _another_runs_root(tmp_path, (1, 2))
    for step_dir in root.glob("step_*"):
        (step_dir / "checkpoint.json").unlink()  # e.g. lost in a copy; the shards are intact
    before = _files(root)
    argv = ["--save", str(root), "--load", str(root), "--save-interval", "1"]
    argv += ["--run-dir", str(tmp_path / "run"), "--device", "cpu", "--model", "tiny"]

    assert main(argv) == 2
    error = capsys.readouterr().err
    assert (
        "step_00000002 (named by latest): checkpoint.json is missing; "
        "step_00000001: checkpoint.json is missing" in error
    ), error
    assert "--load-fallback" in error and "--load-ignore-existing" in error
    assert main([*argv, "--load-fallback"]) == 2  # no older step verifies either
    assert "--load-fallback found no older step that verifies" in capsys.readouterr().err
    assert _files(root) == before


def test_load_ignore_existing_starts_fresh_and_deletes_only_what_its_own_newer_step_supersedes(
    tmp_path,
):
    from trainer_testing import rendezvous, small_config

    from megatron_rl.train.run import run

    root = _another_runs_root(tmp_path, (1, 3))
    for step_dir in root.glob("step_*"):
        (step_dir / "checkpoint.json").unlink()
    step3 = _files(root / "step_00000003")
    config = small_config(
        tmp_path, train_iters=2, save=str(root), load=str(root), save_interval=1,
        load_ignore_existing=True,
    )  # fmt: skip
    run(config, **rendezvous(tmp_path))
    # old step 1 was set aside by this run's step 1 and removed once its step 2 was committed;
    # old step 3 is newer than anything this run saved: kept as it was
    assert sorted(os.listdir(root)) == ["latest", "step_00000001", "step_00000002", "step_00000003"]
    assert (root / "latest").read_text().strip() == "2"
    assert _files(root / "step_00000003") == step3
    assert folder_problem(str(root / "step_00000001")) is None  # this run's own step 1


def test_pruning_never_removes_a_step_folder_newer_than_the_step_this_run_committed(tmp_path):
    root = _another_runs_root(tmp_path, (5, 7))
    os.truncate(root / "step_00000007" / "model_rank00000.pt", 10)  # damaged, maybe the only copy
    newer = {name: _files(root / name) for name in ("step_00000005", "step_00000007")}
    for step in (1, 2, 3):
        _save_linear(root, step, seed=step, keep_last=1)
    assert sorted(os.listdir(root)) == ["latest", "step_00000003", *sorted(newer)]
    assert {name: _files(root / name) for name in newer} == newer


def test_a_same_step_folder_this_run_did_not_write_is_set_aside_until_a_newer_step(tmp_path):
    root = _another_runs_root(tmp_path, (1, 2))
    (root / "step_00000002" / "checkpoint.json").unlink()
    theirs = _files(root / "step_00000002")

    _save_linear(root, 2, seed=20, keep_last=2)
    aside = [name for name in os.listdir(root) if name.startswith("step_00000002.replaced_")]
    assert len(aside) == 1 and _files(root / aside[0]) == theirs
    model, optimizer = linear_with_adam_state(0)
    assert load_training_state(str(root), model=model, optimizer=optimizer) == {"step": 2}
    assert torch.equal(model.weight, linear_with_adam_state(20)[0].weight)  # this run's step 2

    _save_linear(root, 3, seed=30, keep_last=2)  # a newer step of its own: now it goes
    assert sorted(os.listdir(root)) == ["latest", "step_00000002", "step_00000003"]


def test_a_save_killed_between_setting_aside_and_its_rename_loses_nothing(tmp_path, monkeypatch):
    from megatron_rl.train.checkpoint.folders import CheckpointDamaged

    root = _another_runs_root(tmp_path, (1, 2))  # latest names 2, which this run saves again
    theirs = _files(root / "step_00000002")
    real_replace = os.replace

    def killed_at_the_rename(src, dst):
        if os.path.basename(src).startswith(".tmp_step_"):
            raise OSError("killed (simulated)")
        return real_replace(src, dst)

    monkeypatch.setattr(os, "replace", killed_at_the_rename)
    with pytest.raises(OSError, match="simulated"):
        _save_linear(root, 2, seed=20)
    monkeypatch.undo()
    aside = next(name for name in os.listdir(root) if name.startswith("step_00000002.replaced_"))
    assert _files(root / aside) == theirs
    model, optimizer = linear_with_adam_state(0)
    with pytest.raises(CheckpointDamaged, match=rf"folder is missing.*{aside}: set aside"):
        load_training_state(str(root), model=model, optimizer=optimizer)
    assert load_training_state(str(root), model=model, optimizer=optimizer, fallback=True) == {
        "step": 1
    }


def test_load_ignore_existing_needs_load_and_excludes_load_fallback():
    from megatron_rl.train.config import TrainConfig

    with pytest.raises(ValueError, match="--load-ignore-existing=True: needs --load"):
        TrainConfig.from_flags(load_ignore_existing=True)
    with pytest.raises(ValueError, match="--load-ignore-existing and --load-fallback"):
        TrainConfig.from_flags(load="ckpt", load_ignore_existing=True, load_fallback=True)
