"""One run per folder: an exclusive lock on ``--save`` and ``--run-dir`` for the run's life.

Global rank 0 takes the locks before megatron builds anything, so a second run on a folder in use
fails within seconds, naming the holder (host, pid, start time, run dir) and the fix. The lock is
the file ``<folder>/.megatron_rl.lock``, a JSON record of its holder:

- Creation is atomic: the record is written and fsynced under a private name, then hard-linked
  to the lock name (``os.link`` fails if the name exists, also on NFS; ``O_CREAT | O_EXCL``
  where a filesystem has no hard links). A reader never sees half a record.
- Release (normal exit, exception, SIGTERM through the preemption handler) removes the file, if
  it still holds this holder's token.
- A lock whose holder died is stale and the next start takes it over: on the holder's machine
  (same host name, boot id and pid namespace) when its pid is not running, or runs another
  process (``/proc/<pid>/stat`` start time differs: pid reuse), or is a zombie; from another
  machine when its heartbeat is older than the lease. The holder's daemon thread touches the
  file (mtime) every ``heartbeat_s`` seconds; the lease (several beats) covers NFS attribute
  caching and clock skew between hosts, since save folders live on shared filesystems.
- Takeover is race-safe: the starters that judged one record stale serialise on a mutex file
  named after that record's token (created like the lock); the winner checks that the lock
  still is that record, renames it aside (one file to one taker), checks it again and deletes
  it, then creates its own lock; the others wait, retry and find the winner's lock. A fresh
  lock moved aside by mistake is linked back. A mutex left by a taker that died is stale by
  the same rules (a 60 s lease from another host).

Checkpoints (torch, torch_dist, async) are written as before; the lock file only lies beside
them. Standard library only, so the tests load this module in a bare interpreter.
"""

from __future__ import annotations

import contextlib
import json
import logging
import os
import socket
import sys
import threading
import time
import uuid
from collections.abc import Iterator
from datetime import UTC, datetime

logger = logging.getLogger(__name__)

LOCK_FILE = ".megatron_rl.lock"
PROBE_FILE = ".megatron_rl.write-probe"
HEARTBEAT_S = 30.0
"""The holder touches its lock file this often."""
LEASE_S = 300.0
"""A lock from another machine untouched this long is stale (10 beats: NFS caches attributes for
up to 60 s, and host clocks differ)."""
_ATTEMPTS = 50  # create / judge / take over rounds before giving up on contention
_TAKEOVER_WAIT_S = 0.05  # a takeover in progress takes milliseconds
_TAKEOVER_LEASE_S = 60.0  # a takeover mutex from another host older than this was abandoned


class RunFolderError(ValueError):
    """A folder the run needs is in use by another run, not writable, or holds another run's
    metrics; raised at start-up, before anything is built (``python -m megatron_rl.train``
    prints it as one ``error:`` line, exit status 2)."""


def launch_rank(rank: int | None = None) -> int:
    """This process's global rank before torch.distributed starts: ``rank`` when given, else the
    initialised process group's, else ``RANK`` from the environment (torchrun), else 0."""
    if rank is not None:
        return int(rank)
    if "torch.distributed" in sys.modules:
        dist = sys.modules["torch.distributed"]
        if dist.is_available() and dist.is_initialized():
            return dist.get_rank()
    return int(os.environ.get("RANK", 0))


def probe_writable(folder: str, flag: str) -> None:
    """Create ``folder`` and write, fsync and remove a probe file in it; a `RunFolderError`
    naming ``flag`` and the OS error when that fails."""
    probe = os.path.join(folder, f"{PROBE_FILE}.{os.getpid()}")
    try:
        os.makedirs(folder, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
        try:
            os.write(fd, b"probe\n")
            os.fsync(fd)
        finally:
            os.close(fd)
        os.unlink(probe)
    except OSError as err:
        raise RunFolderError(
            f"{flag} {folder} is not writable: {err.strerror or err} ({type(err).__name__}"
            f"{', ' + err.filename if err.filename else ''}); pass a folder this user can "
            "create and write, or fix its permissions"
        ) from err


@contextlib.contextmanager
def hold_run_folders(
    *,
    save: str | None,
    run_dir: str,
    heartbeat_s: float = HEARTBEAT_S,
    lease_s: float = LEASE_S,
) -> Iterator[list[FolderLock]]:
    """Probe ``--save`` (when given) and ``--run-dir`` for writing and lock both for the block
    (one lock when they are one folder); released however the block ends."""
    folders = [("--save", save)] if save else []
    folders.append(("--run-dir", run_dir))
    with contextlib.ExitStack() as stack:
        held: dict[str, FolderLock] = {}
        for flag, folder in folders:
            probe_writable(folder, flag)
            real = os.path.realpath(folder)
            if real not in held:
                lock = FolderLock(
                    folder,
                    flag=flag,
                    about={
                        "run_dir": os.path.abspath(run_dir),
                        "save": save and os.path.abspath(save),
                    },
                    heartbeat_s=heartbeat_s,
                    lease_s=lease_s,
                )
                held[real] = stack.enter_context(lock)
        yield list(held.values())


class FolderLock:
    """The exclusive lock on one folder; a context manager (`acquire` / `release`).

    ``flag`` names the folder in errors (``--save``); ``about`` is stored in the record for the
    message a second run gets (the holder's run dir, save folder).
    """

    def __init__(
        self,
        folder: str,
        *,
        flag: str,
        about: dict | None = None,
        heartbeat_s: float = HEARTBEAT_S,
        lease_s: float = LEASE_S,
    ) -> None:
        if not 0 < heartbeat_s < lease_s:
            raise ValueError(f"heartbeat_s={heartbeat_s}, lease_s={lease_s}: need 0 < beat < lease")
        self.folder = folder
        self.flag = flag
        self.path = os.path.join(folder, LOCK_FILE)
        self.heartbeat_s = heartbeat_s
        self.lease_s = lease_s
        self.token = uuid.uuid4().hex
        self.record = {
            **_this_machine(),
            "pid": os.getpid(),
            "pid_start": _process_start(os.getpid()),
            "started_at": datetime.now(UTC).isoformat(timespec="seconds"),
            "command": " ".join(sys.argv)[:500],
            **(about or {}),
            "heartbeat_s": heartbeat_s,
            "lease_s": lease_s,
            "token": self.token,
        }
        self.lost = False  # set by the heartbeat when another process holds the file now
        self._stop = threading.Event()
        self._beat: threading.Thread | None = None

    def __enter__(self) -> FolderLock:
        self.acquire()
        return self

    def __exit__(self, *exc: object) -> None:
        self.release()

    def acquire(self) -> None:
        """Take the lock (creating the folder), taking over a stale one; `RunFolderError`
        naming a live holder."""
        os.makedirs(self.folder, exist_ok=True)
        for _ in range(_ATTEMPTS):
            if self._create(self.path):
                self._beat = threading.Thread(
                    target=self._heartbeat, name=f"lock-heartbeat {self.path}", daemon=True
                )
                self._beat.start()
                return
            record, stat = _read(self.path)
            if stat is None:
                continue  # released meanwhile: try again
            why = self._stale(record, stat)
            if why is None:
                raise RunFolderError(self._held_message(record, stat))
            self._take_over(record, stat, why)
        raise RunFolderError(
            f"{self.flag} {self.folder}: the lock {self.path} stayed contended over {_ATTEMPTS} "
            "tries (several runs starting on one folder?); retry"
        )

    def release(self) -> None:
        """Stop the heartbeat and remove the lock file if it is still this holder's."""
        self._stop.set()
        if self._beat is not None:
            self._beat.join()
            self._beat = None
            if self._is_mine():
                os.unlink(self.path)
            else:
                logger.error("the lock %s is no longer this run's; left in place", self.path)

    # ------------------------------------------------------------------ internals
    def _create(self, path: str) -> bool:
        """Atomically create ``path`` holding this record; False when the name exists."""
        text = json.dumps(self.record, indent=1, sort_keys=True).encode()
        tmp = f"{path}.{self.token}.new"
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
        try:
            os.write(fd, text)
            os.fsync(fd)
        finally:
            os.close(fd)
        try:
            os.link(tmp, path)
            return True
        except FileExistsError:
            # NFS: a retried link whose first try succeeded reports EEXIST; the link count tells
            return os.stat(tmp).st_nlink == 2
        except OSError:  # no hard links here (some FUSE / object-store mounts)
            return _create_exclusive(path, text)
        finally:
            os.unlink(tmp)

    def _stale(
        self, record: dict | None, stat: os.stat_result, lease: float | None = None
    ) -> str | None:
        """Why the lock in ``record`` / ``stat`` is stale, or None when its holder may live."""
        age = time.time() - stat.st_mtime
        if record is None:  # unreadable: being written (O_EXCL path) or damaged
            lease = lease or self.lease_s
            return f"unreadable and untouched for {age:.0f} s" if age > lease else None
        if _same_machine(record):
            pid = record.get("pid")
            if not isinstance(pid, int):
                return "no pid in the record"
            state = _process_state(pid, record.get("pid_start"))
            return None if state == "running" else f"pid {pid} {state} on this host"
        lease = lease or float(record.get("lease_s") or self.lease_s)
        if age > lease:
            return f"no heartbeat for {age:.0f} s (lease {lease:.0f} s)"
        return None

    def _take_over(self, judged: dict | None, judged_stat: os.stat_result, why: str) -> None:
        """Remove the stale lock judged from ``judged`` / ``judged_stat``, and only that one.

        Takers of one stale record serialise on a mutex file named after it: the winner checks
        that the lock is still that record and removes it; the others wait and try again (and
        then find the winner's lock). A mutex left by a taker that died is itself stale.
        """
        key = judged.get("token") if judged else None
        key = key or f"{judged_stat.st_ino}-{judged_stat.st_mtime_ns}"
        mutex = f"{self.path}.takeover-{key}"
        if not self._create(mutex):
            record, stat = _read(mutex)
            if stat is not None and self._stale(record, stat, lease=_TAKEOVER_LEASE_S):
                _remove_exact(mutex, record, stat)  # its taker died mid-takeover
            else:
                time.sleep(_TAKEOVER_WAIT_S)  # another start is taking over: let it finish
            return
        try:
            if _remove_exact(self.path, judged, judged_stat):
                logger.warning("took over the stale lock %s: %s", self.path, why)
        finally:
            os.unlink(mutex)

    def _is_mine(self) -> bool:
        record, _ = _read(self.path)
        return record is not None and record.get("token") == self.token

    def _heartbeat(self) -> None:
        while not self._stop.wait(self.heartbeat_s):
            try:
                if not self._is_mine():
                    self.lost = True
                    logger.error(
                        "the lock %s is no longer this run's (taken over after a stall longer "
                        "than its %.0f s lease?): another run may write %s %s now",
                        self.path,
                        self.lease_s,
                        self.flag,
                        self.folder,
                    )
                    return
                os.utime(self.path)
            except OSError as err:  # a filesystem hiccup: the next beat tries again
                logger.warning("heartbeat of %s failed: %s", self.path, err)

    def _held_message(self, record: dict | None, stat: os.stat_result) -> str:
        age = time.time() - stat.st_mtime
        holder = _describe(record) if record is not None else "an unreadable record"
        lease = float((record or {}).get("lease_s") or self.lease_s)
        return (
            f"{self.flag} {self.folder} is in use by another run: {holder}, heartbeat "
            f"{max(age, 0):.0f} s ago (lock file {self.path}). Wait for that run to end or stop "
            f"it, or pass another {self.flag}. A lock whose holder died is taken over by the "
            f"next start: at once on the holder's host, after {lease:.0f} s without a "
            "heartbeat from another host; delete the lock file only if that run is surely gone"
        )


def _create_exclusive(path: str, text: bytes) -> bool:
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o644)
    except FileExistsError:
        return False
    try:
        os.write(fd, text)
        os.fsync(fd)
    finally:
        os.close(fd)
    return True


def _remove_exact(path: str, judged: dict | None, judged_stat: os.stat_result) -> bool:
    """Remove ``path`` if it still is the file judged (same token, or for an unreadable one the
    same inode, mtime and size); True when removed. Checked before and after renaming it aside:
    a different file found there (another start won meanwhile) is linked back, not lost."""
    if not _is_same(*_read(path), judged, judged_stat):
        return False
    aside = f"{path}.aside-{uuid.uuid4().hex}"
    try:
        os.rename(path, aside)
    except FileNotFoundError:
        return False  # gone already
    record, stat = _read(aside)
    same = _is_same(record, stat, judged, judged_stat)
    try:
        if not same:
            os.link(aside, path)  # put the live one back
    except FileExistsError:
        logger.error(
            "%s of %s was moved aside while checking a stale lock and another start took the "
            "name meanwhile; that holder's heartbeat will report the loss",
            path,
            _describe(record or {}),
        )
    finally:
        os.unlink(aside)
    return same


def _is_same(
    record: dict | None, stat: os.stat_result | None, judged: dict | None, judged_stat
) -> bool:
    if stat is None:
        return False
    if judged is not None and record is not None:
        return record.get("token") == judged.get("token")
    identity = (judged_stat.st_ino, judged_stat.st_mtime_ns, judged_stat.st_size)
    return (stat.st_ino, stat.st_mtime_ns, stat.st_size) == identity


def _describe(record: dict) -> str:
    return (
        f"pid {record.get('pid')} on host {record.get('host')}, started "
        f"{record.get('started_at')}, run dir {record.get('run_dir')}"
    )


def _read(path: str) -> tuple[dict | None, os.stat_result | None]:
    """(record or None when unparsable, stat) of a lock file; (None, None) when it is gone."""
    try:
        with open(path, "rb") as handle:  # opening revalidates NFS's cached attributes
            stat = os.fstat(handle.fileno())
            data = handle.read()
    except FileNotFoundError:
        return None, None
    try:
        record = json.loads(data)
    except ValueError:
        return None, stat
    return (record if isinstance(record, dict) else None), stat


def _this_machine() -> dict:
    """What tells two processes they share a pid space: host name, boot id, pid namespace."""
    boot_id = namespace = None
    with (
        contextlib.suppress(OSError),
        open("/proc/sys/kernel/random/boot_id", encoding="ascii") as handle,
    ):
        boot_id = handle.read().strip()
    with contextlib.suppress(OSError):
        namespace = os.readlink("/proc/self/ns/pid")
    return {"host": socket.gethostname(), "boot_id": boot_id, "pid_namespace": namespace}


def _same_machine(record: dict) -> bool:
    here = _this_machine()
    return all(record.get(key) == value for key, value in here.items())


def _process_start(pid: int) -> int | None:
    """The start time of ``pid`` in clock ticks after boot (``/proc/<pid>/stat`` field 22)."""
    fields = _proc_stat(pid)
    return int(fields[19]) if fields else None


def _proc_stat(pid: int) -> list[str] | None:
    """Fields 3.. of ``/proc/<pid>/stat`` (after the command name), or None off Linux."""
    try:
        with open(f"/proc/{pid}/stat", encoding="ascii", errors="replace") as handle:
            text = handle.read()
    except OSError:
        return None
    return text[text.rfind(")") + 2 :].split()


def _process_state(pid: int, start: object) -> str:
    """``"running"``, or why ``pid`` is not the holder any more."""
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return "is not running"
    except PermissionError:
        pass  # another user's process: alive
    fields = _proc_stat(pid)
    if fields is None:
        return "running"  # no /proc: alive as far as kill() tells
    if fields[0] in ("Z", "X"):
        return "has exited (zombie)"
    if isinstance(start, int) and int(fields[19]) != start:
        return "is another process now (pid reused: start time differs)"
    return "running"
