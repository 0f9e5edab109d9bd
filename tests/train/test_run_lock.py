"""One run per folder: a second process on a locked folder is refused with the holder named; a
lock left by a dead holder (SIGKILL, zombie, pid reuse, another host's expired lease) is taken
over, once, however many starters race for it."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

import megatron_rl.train.run_lock as run_lock
from megatron_rl.train.run_lock import LOCK_FILE, FolderLock, RunFolderError

# A process that takes the lock of argv[2] (after the file argv[3] appears, when given), says
# "held" or "refused", and keeps the lock until its stdin closes. It loads run_lock.py alone
# (standard library only), so it starts in milliseconds.
HOLDER = textwrap.dedent(
    """
    import importlib.util, os, sys, time
    spec = importlib.util.spec_from_file_location("run_lock", sys.argv[1])
    run_lock = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(run_lock)
    lock = run_lock.FolderLock(sys.argv[2], flag="--save", about={"run_dir": "runs/holder"})
    print("ready", flush=True)
    if len(sys.argv) > 3:
        while not os.path.exists(sys.argv[3]):
            time.sleep(0.001)
    try:
        lock.acquire()
    except run_lock.RunFolderError:
        print("refused", flush=True)
        sys.exit(3)
    print("held", flush=True)
    sys.stdin.read()
    lock.release()
    print("released", flush=True)
    """
)


def start_holder(folder: Path, go: Path | None = None) -> subprocess.Popen:
    argv = [sys.executable, "-c", HOLDER, run_lock.__file__, str(folder)]
    proc = subprocess.Popen(
        [*argv, *([str(go)] if go else [])],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert proc.stdout.readline().strip() == "ready"
    return proc


def held_by(folder: Path) -> dict:
    return json.loads((folder / LOCK_FILE).read_text())


def write_lock(folder: Path, age_s: float = 0.0, **record) -> Path:
    """A lock file holding ``record``, last touched ``age_s`` seconds ago."""
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / LOCK_FILE
    path.write_text(json.dumps({"token": "theirs", "lease_s": 300.0, **record}))
    then = time.time() - age_s
    os.utime(path, (then, then))
    return path


def test_a_second_process_is_refused_naming_the_holder_until_it_releases(tmp_path):
    holder = start_holder(tmp_path)
    try:
        assert holder.stdout.readline().strip() == "held"
        with pytest.raises(RunFolderError) as refused:
            FolderLock(str(tmp_path), flag="--save").acquire()
        message = str(refused.value)
        host = socket.gethostname()
        assert f"--save {tmp_path} is in use by another run: pid {holder.pid} on host {host}" in (
            message
        )
        assert "run dir runs/holder" in message and "pass another --save" in message
    finally:
        holder.stdin.close()
    assert holder.stdout.readline().strip() == "released" and holder.wait() == 0
    assert not (tmp_path / LOCK_FILE).exists()
    with FolderLock(str(tmp_path), flag="--save"):
        assert held_by(tmp_path)["pid"] == os.getpid()
    assert os.listdir(tmp_path) == []  # released: no lock, no temporary file


@pytest.mark.parametrize("reaped", [True, False], ids=["reaped", "zombie"])
def test_a_lock_left_by_a_sigkilled_process_is_taken_over(tmp_path, reaped):
    holder = start_holder(tmp_path)
    assert holder.stdout.readline().strip() == "held"
    holder.kill()
    if reaped:
        holder.wait()
    else:  # not reaped yet: kill(pid, 0) still succeeds, /proc says Z
        while _proc_state(holder.pid) not in ("Z", None):
            time.sleep(0.01)
    assert held_by(tmp_path)["pid"] == holder.pid
    with FolderLock(str(tmp_path), flag="--save"):
        assert held_by(tmp_path)["pid"] == os.getpid()
    holder.wait()
    holder.stdin.close()


def _proc_state(pid: int) -> str | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rfind(")") + 2]


def test_a_reused_pid_is_told_apart_by_its_start_time(tmp_path):
    here = run_lock._this_machine()
    start = run_lock._process_start(os.getpid())
    if start is None:
        pytest.skip("no /proc/<pid>/stat on this system")
    write_lock(tmp_path, **here, pid=os.getpid(), pid_start=start + 1)  # "us", started earlier
    with FolderLock(str(tmp_path), flag="--save"):
        assert held_by(tmp_path)["token"] != "theirs"
    write_lock(tmp_path, **here, pid=os.getpid(), pid_start=start)  # really us: a live holder
    with pytest.raises(RunFolderError, match=f"pid {os.getpid()} on host"):
        FolderLock(str(tmp_path), flag="--save").acquire()


def test_another_hosts_lock_is_taken_over_only_once_its_heartbeat_is_older_than_the_lease(
    tmp_path,
):
    other = {"host": "other-host", "boot_id": "b", "pid_namespace": "p", "pid": 4242}
    write_lock(tmp_path, age_s=10, **other, run_dir="/shared/runs/a")
    holder = r"pid 4242 on host other-host.*run dir /shared/runs/a"
    with pytest.raises(RunFolderError, match=holder):
        FolderLock(str(tmp_path), flag="--save").acquire()
    assert held_by(tmp_path)["token"] == "theirs"
    write_lock(tmp_path, age_s=301, **other)  # lease 300 s
    with FolderLock(str(tmp_path), flag="--save"):
        assert held_by(tmp_path)["pid"] == os.getpid()


def test_an_unreadable_lock_is_held_while_fresh_and_stale_once_old(tmp_path):
    path = tmp_path / LOCK_FILE
    path.write_text("")  # a holder between O_EXCL create and write, or a damaged file
    with pytest.raises(RunFolderError, match="an unreadable record"):
        FolderLock(str(tmp_path), flag="--run-dir").acquire()
    os.utime(path, (time.time() - 1000, time.time() - 1000))
    with FolderLock(str(tmp_path), flag="--run-dir"):
        assert held_by(tmp_path)["pid"] == os.getpid()


def test_the_heartbeat_touches_the_lock_and_release_removes_only_our_own(tmp_path):
    lock = FolderLock(str(tmp_path), flag="--save", heartbeat_s=0.01, lease_s=1.0)
    with lock:
        path = tmp_path / LOCK_FILE
        old = time.time() - 100
        os.utime(path, (old, old))
        while path.stat().st_mtime < old + 50:  # the heartbeat thread touches it again
            time.sleep(0.01)
    assert not path.exists()
    lock = FolderLock(str(tmp_path), flag="--save", heartbeat_s=0.01, lease_s=1.0)
    lock.acquire()
    write_lock(tmp_path, host="other-host", pid=1)  # taken over by someone else meanwhile
    while not lock.lost:  # the heartbeat notices within a beat
        time.sleep(0.01)
    lock.release()
    assert held_by(tmp_path)["token"] == "theirs"  # theirs is left in place


def test_starters_racing_for_one_stale_lock_have_exactly_one_winner(tmp_path):
    write_lock(tmp_path, age_s=1000, host="other-host", pid=1)
    go = tmp_path.parent / f"{tmp_path.name}-go"
    racers = [start_holder(tmp_path, go) for _ in range(4)]
    go.touch()
    try:
        outcomes = sorted(p.stdout.readline().strip() for p in racers)
    finally:
        for proc in racers:
            proc.stdin.close()
    assert outcomes == ["held", "refused", "refused", "refused"]
    assert sorted(p.wait() for p in racers) == [0, 3, 3, 3]
    assert os.listdir(tmp_path) == []  # no lock, no stale or temporary file left


def test_the_cli_refuses_a_save_folder_another_run_holds_in_one_line(tmp_path, capsys):
    from megatron_rl.train.__main__ import main

    save = tmp_path / "ckpt"
    holder = start_holder(save)
    try:
        assert holder.stdout.readline().strip() == "held"
        argv = ["--save", str(save), "--run-dir", str(tmp_path / "run"), "--device", "cpu"]
        assert main([*argv, "--train-iters", "1", "--no-progress"]) == 2
    finally:
        holder.stdin.close()
        holder.wait()
    err = capsys.readouterr().err
    (line,) = [line for line in err.splitlines() if line.startswith("error: ")]
    assert f"error: --save {save} is in use by another run: pid {holder.pid} on host" in line
    assert "Traceback" not in err
    assert not (tmp_path / "run").exists()  # --save is checked first: nothing else touched


def test_a_folder_that_is_both_save_and_run_dir_is_locked_once(tmp_path):
    with run_lock.hold_run_folders(save=str(tmp_path), run_dir=str(tmp_path)) as locks:
        assert len(locks) == 1 and held_by(tmp_path)["save"] == str(tmp_path)
    assert os.listdir(tmp_path) == []
