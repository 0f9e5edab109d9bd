"""Start-up checks of `run` on global rank 0, before megatron builds anything: a fresh run never
empties a run dir's metrics (refused, or kept aside with --overwrite-run-dir), an unwritable
--save is one named error, the locks are let go on an exception, and runs without --run-dir get
folders of their own."""

from __future__ import annotations

import json
import os
import signal
import stat

import pytest
from trainer_testing import rendezvous, small_config

import megatron_rl.train.run as run_module
from megatron_rl.train.run_lock import LOCK_FILE, RunFolderError
from megatron_rl.train.run_logger import DEFAULT_RUN_DIR, METRICS_FILE, RunLoggerConfig

ROWS = "".join(json.dumps({"step": s, "accuracy": s / 10}) + "\n" for s in (1, 2, 3))


class _Built(Exception):
    """Raised where the trainer would be built: the start-up checks have passed."""


@pytest.fixture
def no_trainer(monkeypatch) -> None:
    def build(*args, **kwargs):
        raise _Built

    monkeypatch.setattr(run_module, "Trainer", build)


def _run_dir_with_rows(tmp_path):
    run_dir = tmp_path / "run"
    run_dir.mkdir()
    (run_dir / METRICS_FILE).write_text(ROWS)
    (run_dir / "run_config.json").write_text('{"old": true}')
    return run_dir


def test_a_fresh_run_into_a_run_dir_with_rows_is_refused_and_the_rows_stay(tmp_path, no_trainer):
    run_dir = _run_dir_with_rows(tmp_path)
    with pytest.raises(RunFolderError) as refused:
        run_module.run(small_config(tmp_path), **rendezvous(tmp_path))
    message = str(refused.value)
    assert f"--run-dir {run_dir} already holds an earlier run's metrics (3 rows" in message
    assert "pass another --run-dir, or --overwrite-run-dir" in message
    assert (run_dir / METRICS_FILE).read_text() == ROWS
    assert sorted(os.listdir(run_dir)) == [METRICS_FILE, "run_config.json"]  # lock let go


def test_overwrite_run_dir_keeps_the_old_rows_aside(tmp_path, no_trainer):
    run_dir = _run_dir_with_rows(tmp_path)
    with pytest.raises(_Built):
        run_module.run(small_config(tmp_path, overwrite_run_dir=True), **rendezvous(tmp_path))
    (kept,) = [name for name in os.listdir(run_dir) if name.startswith(METRICS_FILE + ".")]
    assert kept.endswith(".bak") and (run_dir / kept).read_text() == ROWS
    stamp = kept.removeprefix(METRICS_FILE + ".")
    assert (run_dir / f"run_config.json.{stamp}").read_text() == '{"old": true}'
    assert not (run_dir / METRICS_FILE).exists() and not (run_dir / LOCK_FILE).exists()


def test_auto_resume_with_nothing_saved_yet_keeps_the_old_rows_aside(tmp_path, no_trainer):
    """A requeued job that died before its first save (--load is --save, still empty)."""
    run_dir = _run_dir_with_rows(tmp_path)
    save = str(tmp_path / "ckpt")
    with pytest.raises(_Built):
        run_module.run(small_config(tmp_path, save=save, load=save), **rendezvous(tmp_path))
    assert [n for n in os.listdir(run_dir) if n.endswith(".bak") and n.startswith(METRICS_FILE)]
    assert not (run_dir / METRICS_FILE).exists()


def test_the_locks_are_let_go_when_the_run_raises(tmp_path, no_trainer):
    config = small_config(tmp_path, save=str(tmp_path / "ckpt"))
    for _ in range(2):  # the second start finds both folders free again
        with pytest.raises(_Built):
            run_module.run(config, **rendezvous(tmp_path))
        assert not (tmp_path / "ckpt" / LOCK_FILE).exists()
        assert not (tmp_path / "run" / LOCK_FILE).exists()
    assert os.listdir(tmp_path / "ckpt") == []  # nor the write probe


def test_the_locks_are_held_while_the_trainer_builds_and_let_go_after_a_stop(tmp_path, monkeypatch):
    save, run_dir = tmp_path / "ckpt", tmp_path / "run"
    seen: dict = {}

    class StoppedDuringStartUp:
        def __init__(self, config, **kwargs) -> None:
            seen["holders"] = [
                json.loads((f / LOCK_FILE).read_text())["pid"] for f in (save, run_dir)
            ]
            os.kill(os.getpid(), signal.SIGTERM)  # a scheduler's stop: the handler takes it

        def close(self) -> None:
            seen["closed"] = True

    monkeypatch.setattr(run_module, "Trainer", StoppedDuringStartUp)
    assert run_module.run(small_config(tmp_path, save=str(save)), **rendezvous(tmp_path)) == {}
    assert seen == {"holders": [os.getpid(), os.getpid()], "closed": True}
    assert not (save / LOCK_FILE).exists() and not (run_dir / LOCK_FILE).exists()


def test_other_ranks_take_no_lock_and_make_no_check(tmp_path, no_trainer):
    run_dir = _run_dir_with_rows(tmp_path)  # rank 0 would refuse this
    with pytest.raises(_Built):
        run_module.run(small_config(tmp_path), rank=1, world_size=2, init_method="unused")
    assert sorted(os.listdir(run_dir)) == [METRICS_FILE, "run_config.json"]


def test_a_save_folder_that_cannot_be_created_is_one_error_naming_save(tmp_path, no_trainer):
    (tmp_path / "file").write_text("")  # a folder under a regular file: fails for root too
    save = tmp_path / "file" / "ckpt"
    with pytest.raises(RunFolderError, match=f"--save {save} is not writable: Not a directory"):
        run_module.run(small_config(tmp_path, save=str(save)), **rendezvous(tmp_path))
    assert not (tmp_path / "run").exists()  # checked before anything else was touched


@pytest.mark.skipif(os.geteuid() == 0, reason="root writes to read-only folders")
def test_a_read_only_save_folder_is_one_error_naming_save(tmp_path, no_trainer):
    save = tmp_path / "ckpt"
    save.mkdir()
    save.chmod(stat.S_IRUSR | stat.S_IXUSR)
    try:
        with pytest.raises(RunFolderError, match=f"--save {save} is not writable: Permission"):
            run_module.run(small_config(tmp_path, save=str(save)), **rendezvous(tmp_path))
    finally:
        save.chmod(stat.S_IRWXU)


def test_the_cli_reports_an_unwritable_save_in_one_line(tmp_path, capsys):
    from megatron_rl.train.__main__ import main

    (tmp_path / "file").write_text("")
    save = tmp_path / "file" / "ckpt"
    argv = ["--save", str(save), "--run-dir", str(tmp_path / "run"), "--device", "cpu"]
    assert main([*argv, "--train-iters", "1", "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert f"error: --save {save} is not writable: Not a directory" in err
    assert "Traceback" not in err


def test_runs_without_run_dir_get_a_folder_of_their_own():
    assert DEFAULT_RUN_DIR.startswith("runs" + os.sep) and DEFAULT_RUN_DIR.endswith(
        f"-{os.getpid()}"
    )
    assert RunLoggerConfig().run_dir == DEFAULT_RUN_DIR != "runs/latest"
