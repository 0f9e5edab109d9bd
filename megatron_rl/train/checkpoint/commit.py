"""Rank 0's commit of a written step folder, and the housekeeping around it.

The commit writes ``rl_state.json`` and ``checkpoint.json`` (every file's size and sha256) into
the staging folder ``.tmp_step_XXXXXXXX``, fsyncs, renames it to ``step_XXXXXXXX`` and only then
rewrites ``latest``: a crash at any point leaves the previous checkpoint intact and ``latest``
naming it; leftover ``.tmp_*`` entries are removed by the next save
(`remove_staging_leftovers`).

* A step this process committed is never rewritten or renamed aside: saving it again only points
  ``latest`` at it. A folder of the same step that this process did not commit is renamed to
  ``step_XXXXXXXX.replaced_<ns>`` (kept) before the new one takes its name.
* Pruning, after each commit, removes only folders of steps older than the step just committed
  and checked by this process (`_prune`): nothing that might be the only copy goes before this
  run has a newer step of its own. Folders are removed by renaming them to ``.tmp_*`` first, so
  an interrupted pruning never leaves a step folder that looks loadable.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

from megatron_rl.atomic_io import atomic_write_text, fsync_dir, fsync_file
from megatron_rl.train.checkpoint.folders import (
    LATEST_FILE,
    META_FILE,
    RL_STATE_FILE,
    SET_ASIDE,
    STEP_FOLDER,
    folder_problem,
    step_dir_name,
    step_folders,
)
from megatron_rl.train.checkpoint.shards import file_record

logger = logging.getLogger(__name__)

_TMP_PREFIXES = (".tmp_", ".tmp-")  # our staging folders; atomic_write_text's temp files
# realpath of a save folder -> the steps this process committed (and checked) there
_COMMITTED_HERE: dict[str, set[int]] = {}


def commit(save_dir, staging, final, step, rl_state_text, meta, keep_last, files) -> None:
    """rl_state + meta into the staging folder, rename it into place, check it, point ``latest``
    at it, then prune what it supersedes (`_prune`).

    A step this process committed already is kept as it is (never renamed aside: a kill between
    two renames would leave ``latest`` naming no folder); only ``latest`` is pointed at it. Any
    other folder of the same step (another run's, or damaged) is renamed aside, not deleted: it
    may be the only copy, and this run's step is not newer than it.
    """
    committed_here = _COMMITTED_HERE.setdefault(os.path.realpath(save_dir), set())
    if step in committed_here and folder_problem(final) is None:
        logger.warning("step %d is already committed in %s; kept, not rewritten", step, final)
        _discard(staging, save_dir)
    else:
        if os.path.exists(final):
            _set_aside(final, save_dir)
        with open(os.path.join(staging, RL_STATE_FILE), "w", encoding="utf-8") as handle:
            handle.write(rl_state_text)
            handle.flush()
            os.fsync(handle.fileno())
        files = dict(files, **file_record(staging, RL_STATE_FILE))
        with open(os.path.join(staging, META_FILE), "w", encoding="utf-8") as handle:
            handle.write(json.dumps(dict(meta, files=files), indent=2))
            handle.flush()
            os.fsync(handle.fileno())
        fsync_dir(staging)
        os.replace(staging, final)
        fsync_dir(save_dir)
        problem = folder_problem(final)  # the records were hashed from the files as written
        if problem is not None:
            raise RuntimeError(f"{final} fails its check right after its commit: {problem}")
    committed_here.add(step)
    latest = os.path.join(save_dir, LATEST_FILE)
    atomic_write_text(latest, f"{step}\n")
    fsync_file(latest)
    fsync_dir(save_dir)
    _prune(save_dir, step, keep_last)


def _discard(folder: str, save_dir: str) -> None:
    """Remove ``folder`` by renaming it to a ``.tmp_`` name first (a kill leaves only a leftover
    the next save removes, never a half-deleted step folder)."""
    doomed = os.path.join(save_dir, f".tmp_discard_{os.path.basename(folder)}_{time.time_ns()}")
    os.replace(folder, doomed)
    fsync_dir(save_dir)
    shutil.rmtree(doomed, ignore_errors=True)


def _set_aside(folder: str, save_dir: str) -> None:
    """Rename a step folder this run is about to replace to ``step_XXXXXXXX.replaced_<ns>``: never
    loaded, removed by `_prune` once this run has committed a newer step."""
    aside = f"{folder}.replaced_{time.time_ns()}"
    logger.warning(
        "%s was not written by this run (%s): renamed to %s, kept until this run has saved a "
        "newer step",
        folder, folder_problem(folder) or "complete", os.path.basename(aside),
    )  # fmt: skip
    os.replace(folder, aside)
    fsync_dir(save_dir)


def _prune(save_dir: str, step: int, keep_last: int) -> None:
    """Remove what ``step``, just committed and checked by this process, supersedes.

    Only folders of steps older than ``step`` are removed, never a newer one, whoever wrote it:
    nothing that may be the only copy goes before this run holds a checked step newer than it.
    Of the older ones, the ``keep_last - 1`` newest complete step folders are kept; older
    complete ones, damaged ones and set-aside ones are removed. Damaged folders go too: a newer
    checked step exists, ``--load`` already stopped on them (or was told to fall back or ignore
    them), and nothing else would ever remove them.
    """
    older: list[tuple[int, str]] = []
    for name in os.listdir(save_dir):
        match = STEP_FOLDER.fullmatch(name) or SET_ASIDE.fullmatch(name)
        if match and int(match[1]) < step:
            older.append((int(match[1]), name))
    complete = sorted(
        s
        for s, name in older
        if name == step_dir_name(s) and folder_problem(os.path.join(save_dir, name)) is None
    )
    keep = {step_dir_name(s) for s in complete[max(0, len(complete) - (keep_last - 1)) :]}
    for _, name in sorted(older):
        if name not in keep:
            _discard(os.path.join(save_dir, name), save_dir)
    newer = [s for s in step_folders(save_dir) if s > step]
    if newer:
        logger.warning("%s holds step folders newer than step %d: %s (kept)", save_dir, step, newer)


def remove_staging_leftovers(save_dir: str) -> None:
    for name in os.listdir(save_dir):
        if name.startswith(_TMP_PREFIXES):
            path = os.path.join(save_dir, name)
            logger.warning("removing %s left by an interrupted save", path)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)
