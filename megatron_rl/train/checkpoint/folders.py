"""What a checkpoint root holds, which step a load takes, and why a step folder cannot be loaded.

The step a load takes is the one ``latest`` names (without a readable ``latest``: the newest
``step_XXXXXXXX`` folder), or the one asked for. One rule for every kind of damage to that step
folder: ``checkpoint.json`` missing, unreadable or without its records, a recorded file missing
or of another size (a truncated shard), a ``torch_dist`` folder without ``.metadata``, and, found
when the step is loaded, a file whose sha256 differs from its record (a flipped byte). Each is a
`CheckpointDamaged` error naming the step folder, the file and what is wrong, listing every step
folder found with its state, and the two ways on: ``--load-fallback`` (``fallback=True``: the
newest older step that verifies) or ``--load-ignore-existing`` (start fresh; the folders stay
until the run has saved a newer step). An older step is never loaded quietly in its place.

A commit writes ``checkpoint.json`` into the staging folder before renaming it to its step
name, so a step folder without one was damaged after its commit, never left by a crash.
"""

from __future__ import annotations

import json
import logging
import os
import re

from megatron_rl.train.checkpoint.torch_dist import FORMAT as DIST_FORMAT

logger = logging.getLogger(__name__)

TORCH_FORMAT = "torch"  # per-rank torch.save files: resumes at the saved layout only
CKPT_FORMATS = (TORCH_FORMAT, DIST_FORMAT)
LATEST_FILE = "latest"
META_FILE = "checkpoint.json"
RL_STATE_FILE = "rl_state.json"
DIST_INDEX_FILE = ".metadata"  # torch.distributed.checkpoint's index of the *.distcp files
STEP_FOLDER = re.compile(r"step_(\d{8})")
SET_ASIDE = re.compile(r"step_(\d{8})\.replaced_\d+")  # a same-step folder a save replaced
WAYS_ON = (
    "to go on, pass --load-fallback (fallback=True: load the newest older step that verifies) "
    "or --load-ignore-existing (start fresh; these folders are kept until the run has saved a "
    "newer step)"
)
_LISTED = 8  # step folders named in an error, newest first


class CheckpointDamaged(ValueError):
    """The checkpoint to load is damaged; the message names it, lists the step folders found and
    says how to go on."""


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def step_folders(root: str) -> list[int]:
    """The steps of ``root``'s ``step_XXXXXXXX`` folders, damaged or not, in increasing order."""
    if not os.path.isdir(root):
        return []
    steps = []
    for name in os.listdir(root):
        match = STEP_FOLDER.fullmatch(name)
        if match and os.path.isdir(os.path.join(root, name)):
            steps.append(int(match[1]))
    return sorted(steps)


def latest_step(root: str) -> int | None:
    """The step ``root/latest`` names; without a readable ``latest``, the newest step folder.

    Says nothing about whether that step loads (`folder_problem`); None when ``root`` holds
    neither.
    """
    named = _read_latest(root)
    if named is not None:
        return named
    steps = step_folders(root)
    return steps[-1] if steps else None


def read_meta(step_dir: str) -> dict | None:
    """``step_dir/checkpoint.json`` as a dict, None when missing or unreadable."""
    try:
        with open(os.path.join(step_dir, META_FILE), encoding="utf-8") as handle:
            meta = json.load(handle)
    except (OSError, ValueError):
        return None
    return meta if isinstance(meta, dict) else None


def folder_problem(step_dir: str) -> str | None:
    """Why ``step_dir`` cannot be loaded, judged without reading the tensors, or None.

    Checks: ``checkpoint.json`` parses and holds a layout and a record (bytes, sha256) per file;
    ``rl_state.json`` (and ``.metadata`` for ``torch_dist``) is among them; every recorded file
    is there with its recorded size. Hashes are checked at load.
    """
    if not os.path.isdir(step_dir):
        return "the folder is missing"
    try:
        with open(os.path.join(step_dir, META_FILE), encoding="utf-8") as handle:
            text = handle.read()
    except FileNotFoundError:
        return f"{META_FILE} is missing"
    except (OSError, UnicodeDecodeError) as exc:
        return f"{META_FILE} cannot be read ({exc})"
    try:
        meta = json.loads(text)
    except ValueError as exc:
        return f"{META_FILE} is not valid JSON ({exc})"
    problem = _meta_problem(meta)
    if problem is not None:
        return f"{META_FILE} {problem}"
    records = meta.get("files", {})
    for name in _own_files(meta):
        if records and name not in records:
            return f"{META_FILE} has no record of {name}"
        if not records and not os.path.isfile(os.path.join(step_dir, name)):
            return f"{name} is missing"  # format 1: no records
    for name, record in records.items():
        path = os.path.join(step_dir, name)
        if not os.path.isfile(path):
            return f"{name} is missing ({record['bytes']} bytes recorded at save)"
        size = os.path.getsize(path)
        if size != record["bytes"]:
            what = "truncated" if size < record["bytes"] else "longer than recorded"
            return f"{name} is {what} ({size} bytes; {record['bytes']} recorded at save)"
    return None


def _meta_problem(meta) -> str | None:
    """What ``checkpoint.json``'s content lacks, or None."""
    if not isinstance(meta, dict):
        return "does not hold a JSON object"
    layout = meta.get("layout")
    if not isinstance(layout, dict) or not isinstance(layout.get("world_size"), int):
        return "has no layout with a world_size"
    if meta.get("format", TORCH_FORMAT) not in CKPT_FORMATS:
        return f"names an unknown format {meta.get('format')!r} (known: {CKPT_FORMATS})"
    records, version = meta.get("files"), meta.get("format_version", 1)
    if records is None and isinstance(version, int) and version < 2:
        return None  # format 1: written before file records
    if not isinstance(records, dict) or not records:
        return "has no file records"
    for name, record in records.items():
        if not (
            isinstance(record, dict)
            and isinstance(record.get("bytes"), int)
            and isinstance(record.get("sha256"), str)
        ):
            return f"has a malformed record for {name}: {record!r}"
    return None


def _own_files(meta: dict) -> list[str]:
    """Files every step folder of ``meta``'s format has (each rank's own files are recorded by
    that rank, so their records cover them)."""
    if meta.get("format", TORCH_FORMAT) == DIST_FORMAT:
        return [DIST_INDEX_FILE, RL_STATE_FILE]
    return [RL_STATE_FILE]


def choose_step(root: str, step: int | None = None, *, fallback: bool = False) -> int | None:
    """The step a load of ``root`` takes (see the module docstring); None when ``root`` holds no
    step folder and no ``latest``.

    Raises:
        CheckpointDamaged: that step's folder is damaged, and ``fallback`` is off or no older
            step folder passes `folder_problem`.
        ValueError: ``step`` was asked for and has no folder.
    """
    if step is not None and not os.path.isdir(os.path.join(root, step_dir_name(step))):
        raise ValueError(
            f"step={step}: no complete checkpoint in {root} (no folder {step_dir_name(step)}); "
            f"step folders: {step_folders(root)}"
        )
    if step is None:
        step = _read_latest(root)
        if step is None:
            steps = step_folders(root)
            if not steps:
                return None
            step = steps[-1]
            logger.warning(
                "%s has no readable %s: taking its newest step folder", root, LATEST_FILE
            )
    newer = [s for s in step_folders(root) if s > step]
    if newer:  # e.g. a save killed after its rename, before `latest`; kept until superseded
        logger.warning(
            "%s: loading step %d; newer step folders are not loaded: %s", root, step, newer
        )
    problem = folder_problem(os.path.join(root, step_dir_name(step)))
    if problem is None:
        return step
    return older_step(root, step, problem, fallback=fallback)


def older_step(
    root: str, bad: int, problem: str, *, fallback: bool, known: dict[int, str] | None = None
) -> int:
    """With ``fallback``: the newest step older than ``bad`` whose folder passes `folder_problem`
    and is not in ``known`` (step -> why it failed at load), logged. Else `CheckpointDamaged`
    naming ``bad``'s ``problem``."""
    known = {**(known or {}), bad: problem}
    older = [
        s
        for s in step_folders(root)
        if s < bad
        and s not in known
        and folder_problem(os.path.join(root, step_dir_name(s))) is None
    ]
    why = f"{step_dir_name(bad)}: {problem}"
    if fallback and older:
        logger.error("%s/%s; --load-fallback: loading step %d instead", root, why, older[-1])
        return older[-1]
    raise CheckpointDamaged(damage_report(root, why, known, fallback_failed=fallback))


def damage_report(root: str, why: str, known: dict[int, str], *, fallback_failed: bool) -> str:
    """``why``, every step folder of ``root`` with its state (newest first), and the ways on."""
    latest = _read_latest(root)
    steps = step_folders(root)[::-1]
    states = []
    if latest is not None and latest not in steps:
        states.append(f"{LATEST_FILE} names step {latest}, which has no folder")
    for step in steps[:_LISTED]:
        state = known.get(step) or folder_problem(os.path.join(root, step_dir_name(step)))
        mark = f" (named by {LATEST_FILE})" if step == latest else ""
        states.append(f"{step_dir_name(step)}{mark}: {state or 'complete'}")
    if len(steps) > _LISTED:
        states.append(f"and {len(steps) - _LISTED} older")
    for name in sorted(filter(SET_ASIDE.fullmatch, os.listdir(root)), reverse=True):
        states.append(f"{name}: set aside by a save of the same step (never loaded)")
    ways = WAYS_ON
    if fallback_failed:
        ways = (
            "--load-fallback found no older step that verifies; to start fresh, pass "
            "--load-ignore-existing instead (these folders are kept until the run has saved a "
            "newer step)"
        )
    return (
        f"cannot load the checkpoint in {root}: {why}. Step folders found: "
        f"{'; '.join(states) or 'none'}. {ways[0].upper()}{ways[1:]}"
    )


def _read_latest(root: str) -> int | None:
    try:
        with open(os.path.join(root, LATEST_FILE), encoding="utf-8") as handle:
            return int(handle.read().strip())
    except (OSError, ValueError):
        return None
