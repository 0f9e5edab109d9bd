"""Training checkpoints: per-rank model/optimizer/RNG shards, committed atomically, resumable.

Layout of ``save_dir``::

    latest                      the committed step, as text (rewritten atomically, last)
    step_00000100/
        checkpoint.json         step, world size, parallel layout, format version (rank 0)
        rl_state.json           the trainer's JSON state: sampler position, weight version, ...
        model_rank00000.pt      rank 0's model state_dict (its TP/EP/PP shard)
        optim_rank00000.pt      rank 0's optimizer state (its distributed-optimizer shard on GPU)
        rng_rank00000.pt        rank 0's torch/CUDA/python/numpy/megatron-tracker RNG states
        ...

Every rank writes into ``.tmp_step_00000100/`` and hashes its files (sha256); once all ranks
report success, rank 0 records every file's size and hash in ``checkpoint.json``, fsyncs, renames
the folder to ``step_00000100`` and only then rewrites ``latest``. A crash at any point leaves the
previous checkpoint intact and ``latest`` pointing at it; leftover ``.tmp_*`` entries are removed
by the next save.

* Loading (`load_training_state`) takes the step ``latest`` names and checks its folder: the
  records and sizes in ``checkpoint.json``, then every file's sha256. Any damage (a missing or
  broken ``checkpoint.json``, a truncated or missing file, a flipped byte) is a
  `CheckpointDamaged` error naming the folder, the file and what is wrong; ``fallback=True``
  (``--load-fallback``) loads the newest older step that verifies instead. Never an older step
  quietly (`megatron_rl.train.checkpoint_folders`).
* A step this process committed is never rewritten or renamed aside: saving it again only points
  ``latest`` at it. A folder of the same step that this process did not commit is renamed to
  ``step_XXXXXXXX.replaced_<ns>`` (kept) before the new one takes its name.
* Pruning, after each commit, removes only folders of steps older than the step just committed
  and checked by this process (`_prune`): nothing that might be the only copy goes before this
  run has a newer step of its own. Folders are removed by renaming them to ``.tmp_*`` first, so
  an interrupted pruning never leaves a step folder that looks loadable.

Two formats (``fmt`` / ``--ckpt-format``; loading reads ``format`` in ``checkpoint.json``, and
a folder without it is ``torch``):

* ``torch`` (default): the per-rank files above. Resumed with the same world size and parallel
  layout only (a different one is a named error).
* ``torch_dist``: model and optimizer through megatron's ``dist_checkpointing``
  (`megatron_rl.train.dist_checkpoint`: ``*.distcp``, ``.metadata``, ``common.pt``,
  ``metadata.json``), plus ``rl_state.json`` and ``rng_rank*.pt``. Resumed at any TP/EP/PP/DP
  layout (PP 2 <-> PP 1 tested). The same staging folder,
  sha256 records (every rank hashes and verifies a share of the files), rename and ``latest``
  make it atomic.

Async save (``torch_dist`` only; ``--async-save``): `start_async_save` snapshots the state and
returns while megatron's writer processes write it into the staging folder (see
`megatron_rl.train.dist_checkpoint` for why the files hold the saved step's tensors whatever the
caller updates meanwhile); ``rl_state.json`` and the RNG files are written from the same moment.
The returned `PendingSave` commits it (hashes, ``checkpoint.json``, rename, ``latest``, pruning,
all as above) with ``finalize()`` (collective; waits for every rank's writer) or
``try_finalize()`` (collective; commits only when every writer has finished). Until then
``latest`` names the previous checkpoint, and a crash leaves only a ``.tmp_`` folder. One save at
a time: starting a save first commits the one in flight. ``abandon()`` (no collective, for error
paths) waits for this rank's writer and commits nothing. The sha256 hashing stays in the commit,
on the caller's time.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import shutil
import time

import torch

from megatron_rl.atomic_io import atomic_write_text, fsync_dir, fsync_file
from megatron_rl.collectives import all_gather_objects, any_rank, barrier, rank_and_world_size
from megatron_rl.parallel import initialized_parallel_state
from megatron_rl.train.checkpoint_folders import (
    CKPT_FORMATS,
    DIST_FORMAT,
    LATEST_FILE,
    META_FILE,
    RL_STATE_FILE,
    SET_ASIDE,
    STEP_FOLDER,
    TORCH_FORMAT,
    CheckpointDamaged,
    choose_step,
    folder_problem,
    latest_step,
    older_step,
    read_meta,
    step_dir_name,
    step_folders,
)
from megatron_rl.train.dist_checkpoint import load_sharded, save_sharded
from megatron_rl.train.optimizer_state import (
    load_optimizer_state,
    optimizer_difference,
    optimizer_state,
)
from megatron_rl.train.rng_state import capture_rng_state, restore_rng_state

logger = logging.getLogger(__name__)

__all__ = [
    "CKPT_FORMATS",
    "DIST_FORMAT",
    "LATEST_FILE",
    "META_FILE",
    "TORCH_FORMAT",
    "CheckpointDamaged",
    "PendingSave",
    "latest_step",
    "load_training_state",
    "pending_save",
    "save_training_state",
    "start_async_save",
    "step_dir_name",
]

FORMAT_VERSION = 2  # 2: checkpoint.json lists every file with its size and sha256
_TMP_PREFIXES = (".tmp_", ".tmp-")  # our staging folders; atomic_write_text's temp files
_RANK_FILE = re.compile(r"(model|optim|rng)_rank\d{5}\.pt$")
# realpath of a save folder -> the steps this process committed (and checked) there
_COMMITTED_HERE: dict[str, set[int]] = {}


def save_training_state(
    save_dir: str,
    step: int,
    *,
    model,
    optimizer,
    rl_state: dict,
    keep_last: int = 2,
    fmt: str = TORCH_FORMAT,
) -> str:
    """Write this rank's model, optimizer and RNG shards for ``step``; commit on rank 0.

    Collective: every rank of the job must call it. ``rl_state`` (rank 0's is kept) must be
    JSON-serialisable. After the commit, folders of older steps are removed but the
    ``keep_last - 1`` newest complete ones (`_prune`; newer folders are never touched). A
    background save still in flight (`start_async_save`) is committed first.

    Returns:
        The committed folder ``save_dir/step_{step:08d}``.
    """
    args = (save_dir, step, model, optimizer, rl_state, keep_last, fmt)
    return _begin_save(*args, background=False).finalize()


def start_async_save(
    save_dir: str, step: int, *, model, optimizer, rl_state: dict, keep_last: int = 2
) -> PendingSave:
    """`save_training_state` in the ``torch_dist`` format, its files written in the background.

    Collective. Returns once the state is snapshotted (model, optimizer, RNG and ``rl_state``
    describe ``step`` whatever the caller updates afterwards) and megatron's writer processes
    run; the step is committed (``latest``) only by the returned `PendingSave`'s ``finalize()``,
    or ``try_finalize()`` once the write has finished. A save still in flight is committed
    first: never two at once.
    """
    return _begin_save(save_dir, step, model, optimizer, rl_state, keep_last, DIST_FORMAT, True)


def pending_save() -> PendingSave | None:
    """The background save of this process not yet committed or abandoned, if any."""
    return _IN_FLIGHT[0]


class PendingSave:
    """A save written into its staging folder, not yet committed (`start_async_save`)."""

    def __init__(self, save_dir, step, fmt, keep_last, rl_state_text, files, write) -> None:
        self.save_dir = save_dir
        self.step = step
        self.fmt = fmt
        self.keep_last = keep_last
        self.final = os.path.join(save_dir, step_dir_name(step))
        self.staging = os.path.join(save_dir, f".tmp_{step_dir_name(step)}")
        self._rl_state_text = rl_state_text
        self._files = files  # this rank's records so far (its rng file, torch-format shards)
        self._write = write  # the BackgroundWrite, None once the data files are complete
        self._started = time.perf_counter()
        self.blocked_seconds = 0.0  # time the caller waited: the start and the commit
        self.committed: str | None = None
        self.failure: str | None = None  # why the save failed (it can never be committed)

    def try_finalize(self) -> str | None:
        """Collective, non-blocking: commit if every rank's write has finished, else None."""
        if self.committed is None and self.failure is None and not self._written(wait=False):
            return None
        return self.finalize()

    def finalize(self) -> str:
        """Collective: wait for every rank's write, hash the files, commit (rank 0), prune.

        Returns:
            The committed folder. Calling it again returns it again.
        """
        if self.committed is not None:
            return self.committed
        if self.failure is not None:
            raise RuntimeError(f"step {self.step} cannot be committed: {self.failure}")
        begin = time.perf_counter()
        self._written(wait=True)
        error: Exception | None = None
        files = dict(self._files)
        if self.fmt == DIST_FORMAT:
            try:
                barrier()  # every rank's files are written before they are hashed
                files.update(_hash_share(self.staging, exclude=files))
            except Exception as exc:
                error = exc
            self._raise_if_failed(error, "hashing")
        every_file = {k: v for part in all_gather_objects(files) for k, v in part.items()}
        rank, world_size = rank_and_world_size()
        if rank == 0:
            try:
                meta = {
                    "format_version": FORMAT_VERSION,
                    "format": self.fmt,
                    "step": self.step,
                    "layout": _layout(),
                }
                _commit(
                    self.save_dir, self.staging, self.final, self.step, self._rl_state_text, meta,
                    self.keep_last, every_file,
                )  # fmt: skip
            except Exception as exc:
                error = exc
        self._raise_if_failed(error, f"committing step {self.step} to {self.final}")
        self.committed = self.final
        _IN_FLIGHT[0] = None
        self.blocked_seconds += time.perf_counter() - begin
        megabytes = sum(record["bytes"] for record in files.values()) / 1e6
        seconds = time.perf_counter() - self._started
        logger.info(
            "saved step %d to %s: rank %d/%d wrote %.1f MB in %.2f s (%.1f MB/s; the caller was "
            "blocked %.2f s)",
            self.step, self.final, rank, world_size, megabytes, seconds,
            megabytes / max(seconds, 1e-9), self.blocked_seconds,
        )  # fmt: skip
        return self.final

    def abandon(self) -> None:
        """Local (no collective, for error paths): wait for this rank's writer, commit nothing.

        The previous checkpoint stays ``latest``; the staging folder is removed by the next save.
        """
        if self._write is not None:
            self._write.abandon()
            self._write = None
        if self.committed is None:
            logger.warning(
                "step %d was not committed (its write was abandoned); %s keeps its previous "
                "checkpoint as latest",
                self.step, self.save_dir,
            )  # fmt: skip
        _IN_FLIGHT[0] = None

    def _written(self, wait: bool) -> bool:
        """Collective: whether the data files are complete on every rank."""
        if self._write is None:
            return True
        error: Exception | None = None
        finished = False
        try:
            finished = self._write.finished(wait=wait)
        except Exception as exc:
            error = exc
        self._raise_if_failed(error, "writing in the background")
        if finished:
            self._write = None
        return finished

    def _raise_if_failed(self, error: Exception | None, what: str) -> None:
        if any_rank(error is not None):
            self.failure = f"{what} failed"
            if self._write is not None:
                self._write.abandon()
                self._write = None
            _IN_FLIGHT[0] = None  # the staging folder is a leftover now, never committed
            _raise_if_any_rank_failed(error, f"{what} step {self.step} under {self.staging}")


_IN_FLIGHT: list[PendingSave | None] = [None]  # this process's uncommitted background save


def _begin_save(save_dir, step, model, optimizer, rl_state, keep_last, fmt, background):
    """Validate, snapshot and write (in the background when asked): the uncommitted save."""
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: must be an int >= 0")
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: must be >= 1 (the new checkpoint is kept)")
    if fmt not in CKPT_FORMATS:
        raise ValueError(f"fmt={fmt!r}: choose one of {CKPT_FORMATS}")
    if background and fmt != DIST_FORMAT:
        raise ValueError(f"a background save needs fmt={DIST_FORMAT!r} (megatron's async writer)")
    try:
        rl_state_text = json.dumps(rl_state, indent=2, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rl_state is not JSON-serialisable ({exc}); pass plain types") from exc
    if _IN_FLIGHT[0] is not None:
        logger.info("committing step %d before saving step %d", _IN_FLIGHT[0].step, step)
        _IN_FLIGHT[0].finalize()
    start = time.perf_counter()
    rank, _ = rank_and_world_size()
    pending = PendingSave(save_dir, step, fmt, keep_last, rl_state_text, {}, None)
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        _remove_staging_leftovers(save_dir)
    barrier()
    error: Exception | None = None
    files = pending._files
    try:
        os.makedirs(pending.staging, exist_ok=True)
        header = {"format_version": FORMAT_VERSION, "layout": _layout(), "coords": _coords()}
        if fmt == TORCH_FORMAT:
            staging = pending.staging
            files.update(_save(dict(header, model=model.state_dict()), staging, "model", rank))
            files.update(
                _save(dict(header, optimizer=optimizer_state(optimizer)), staging, "optim", rank)
            )
        files.update(_save(dict(header, rng=capture_rng_state()), pending.staging, "rng", rank))
    except Exception as exc:  # reported to every rank below, so no rank waits forever
        error = exc
    _raise_if_any_rank_failed(error, f"writing step {step} under {pending.staging}")
    if fmt == DIST_FORMAT:
        try:  # collective: every rank reached it (no rank failed above)
            pending._write = save_sharded(pending.staging, model, optimizer, background)
        except Exception as exc:
            error = exc
        _raise_if_any_rank_failed(error, f"writing step {step} under {pending.staging}")
    if pending._write is not None:
        _IN_FLIGHT[0] = pending
    pending.blocked_seconds = time.perf_counter() - start
    pending._started = start
    return pending


def load_training_state(
    load_dir: str, *, model, optimizer, step: int | None = None, fallback: bool = False
) -> dict | None:
    """Load ``step`` (default: the one ``latest`` names) into ``model`` and ``optimizer`` in place.

    Collective. Restores this rank's RNG states too. Everything is checked on every rank before
    anything is modified: the step folder's records and sizes
    (`megatron_rl.train.checkpoint_folders.folder_problem`), each file's sha256 against its
    record, the world size and parallel layout, and each tensor's name, shape and dtype against
    the model's. A damaged step folder raises `CheckpointDamaged` (naming the folder, the file,
    what is wrong, every step folder found and the flags that go on); ``fallback=True`` loads
    the newest older step that verifies instead (logged). Another difference raises ValueError.

    Returns:
        The saved ``rl_state``, or None when ``load_dir`` does not exist or holds no step folder
        and no ``latest``.
    """
    if not os.path.isdir(load_dir):
        return None
    step = choose_step(load_dir, step, fallback=fallback)
    if step is None:
        return None
    rank, _ = rank_and_world_size()
    failed: dict[int, str] = {}  # step -> why its files failed their sha256
    while True:
        folder = os.path.join(load_dir, step_dir_name(step))
        corrupted = _corruption(folder, rank)
        if not any_rank(corrupted is not None):
            break
        failed[step] = corrupted or "another rank's files are corrupted (see its error)"
        step = older_step(load_dir, step, failed[step], fallback=fallback, known=failed)
    problem: str | None = None
    shards: dict[str, dict] = {}
    meta = read_meta(folder)
    if meta.get("format", TORCH_FORMAT) == DIST_FORMAT:
        return _load_dist(folder, meta, step, model=model, optimizer=optimizer)
    try:
        problem = _layout_difference(meta["layout"], _layout(), folder)
        if problem is None:
            for kind in ("model", "optim", "rng"):  # model tensors are copied out: mmap them
                path = os.path.join(folder, f"{kind}_rank{rank:05d}.pt")
                shards[kind] = torch.load(
                    path, map_location="cpu", weights_only=True, mmap=kind == "model"
                )
            problem = _layout_difference(shards["model"]["coords"], _coords(), folder)
            problem = problem or _model_difference(shards["model"]["model"], model.state_dict())
            problem = problem or optimizer_difference(shards["optim"]["optimizer"], optimizer)
            with open(os.path.join(folder, RL_STATE_FILE), encoding="utf-8") as handle:
                rl_state = json.load(handle)
    except (OSError, KeyError, RuntimeError, ValueError) as exc:
        problem = f"{folder}: cannot read rank {rank}'s shard ({exc!r})"
    if any_rank(problem is not None):
        raise ValueError(problem or f"{folder}: another rank's shard does not match; see its error")
    model.load_state_dict(shards["model"]["model"], strict=True)
    load_optimizer_state(optimizer, shards["optim"]["optimizer"])
    restore_rng_state(shards["rng"]["rng"])
    logger.info("loaded step %d from %s", step, folder)
    return rl_state


def _load_dist(folder: str, meta: dict, step: int, *, model, optimizer) -> dict:
    """Load a ``torch_dist`` step folder at this job's layout (any TP/EP/PP/DP layout)."""
    rank, _ = rank_and_world_size()
    saved_layout = meta["layout"]
    same_layout = _layout_difference(saved_layout, _layout(), folder) is None
    error: Exception | None = None
    rng = rl_state = None
    try:
        with open(os.path.join(folder, RL_STATE_FILE), encoding="utf-8") as handle:
            rl_state = json.load(handle)
        rng_rank = rank if same_layout else rank % saved_layout["world_size"]
        rng_path = os.path.join(folder, f"rng_rank{rng_rank:05d}.pt")
        rng = torch.load(rng_path, map_location="cpu", weights_only=True)["rng"]
    except (OSError, KeyError, RuntimeError, ValueError) as exc:
        error = ValueError(f"{folder}: cannot read rank {rank}'s files ({exc!r})")
    _raise_if_any_rank_failed(error, f"reading {folder}")
    load_sharded(folder, model, optimizer)
    if not same_layout:
        rng.pop("tracker", None)  # megatron's model-parallel RNG streams are per TP rank
        logger.info(
            "%s was saved at layout %s, resumed at %s: tensors resharded; RNG states of saved "
            "rank %d restored (megatron's tensor-parallel RNG tracker kept as seeded)",
            folder, saved_layout, _layout(), rank % saved_layout["world_size"],
        )  # fmt: skip
    restore_rng_state(rng)
    logger.info("loaded step %d from %s (%s)", step, folder, DIST_FORMAT)
    return rl_state


# --- commit and housekeeping (rank 0) ---------------------------------------------------------


def _commit(save_dir, staging, final, step, rl_state_text, meta, keep_last, files) -> None:
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
        files = dict(files, **_file_record(staging, RL_STATE_FILE))
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


def _remove_staging_leftovers(save_dir: str) -> None:
    for name in os.listdir(save_dir):
        if name.startswith(_TMP_PREFIXES):
            path = os.path.join(save_dir, name)
            logger.warning("removing %s left by an interrupted save", path)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)


def _corruption(step_dir: str, rank: int) -> str | None:
    """Why this rank's files in ``step_dir`` differ from their recorded sha256, or None."""
    meta = read_meta(step_dir) or {}
    records = meta.get("files", {})
    if meta.get("format", TORCH_FORMAT) == DIST_FORMAT:  # every rank checks its share
        _, world_size = rank_and_world_size()
        names = sorted(records)[rank::world_size]
    else:
        names = [f"{kind}_rank{rank:05d}.pt" for kind in ("model", "optim", "rng")]
        if rank == 0:
            names.append(RL_STATE_FILE)
    for name in names:
        if name not in records:
            continue  # a checkpoint from before checksums (format 1)
        digest = _sha256(os.path.join(step_dir, name))
        if digest != records[name]["sha256"]:
            return (
                f"{name} is corrupted: its sha256 {digest[:16]}... differs from "
                f"{records[name]['sha256'][:16]}... recorded at save"
            )
    return None


def _sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()


def _hash_share(folder: str, exclude: dict) -> dict[str, dict]:
    """Records of this rank's share of the files in ``folder`` that are not in ``exclude`` and
    not another rank's own files (every rank takes every world-size-th name)."""
    rank, world_size = rank_and_world_size()
    names = sorted(
        name for name in os.listdir(folder) if name not in exclude and not _RANK_FILE.match(name)
    )
    records: dict[str, dict] = {}
    for name in names[rank::world_size]:
        records.update(_file_record(folder, name))
    return records


def _file_record(folder: str, name: str) -> dict[str, dict]:
    path = os.path.join(folder, name)
    return {name: {"bytes": os.path.getsize(path), "sha256": _sha256(path)}}


def _save(obj: dict, folder: str, kind: str, rank: int) -> dict[str, dict]:
    """Write one shard file, fsynced; its ``{name: {bytes, sha256}}`` record."""
    name = f"{kind}_rank{rank:05d}.pt"
    torch.save(obj, os.path.join(folder, name))
    fsync_file(os.path.join(folder, name))
    return _file_record(folder, name)


# --- layout and collectives ------------------------------------------------------------------


_AXES = {
    "tensor_parallel": "tensor_model_parallel",
    "pipeline_parallel": "pipeline_model_parallel",
    "expert_parallel": "expert_model_parallel",
    "expert_tensor_parallel": "expert_tensor_parallel",
    "context_parallel": "context_parallel",
    "data_parallel": "data_parallel",
}


def _layout() -> dict[str, int]:
    """World size and megatron's parallel sizes (all 1 without megatron's groups)."""
    ps = initialized_parallel_state()
    layout = {"world_size": rank_and_world_size()[1]}
    for name, axis in _AXES.items():
        layout[name] = getattr(ps, f"get_{axis}_world_size")() if ps else 1
    return layout


def _coords() -> dict[str, int]:
    """This rank's global rank and its rank along every parallel axis."""
    ps = initialized_parallel_state()
    coords = {"rank": rank_and_world_size()[0]}
    for name, axis in _AXES.items():
        coords[name] = getattr(ps, f"get_{axis}_rank")() if ps else 0
    return coords


def _layout_difference(saved: dict, current: dict, folder: str) -> str | None:
    diffs = [f"{k}: saved {saved.get(k)}, now {v}" for k, v in current.items() if saved.get(k) != v]
    if not diffs:
        return None
    return (
        f"{folder} was saved with another parallel layout ({'; '.join(diffs)}); resume with the "
        "saved layout, or export to HF and load that into the new layout"
    )


def _raise_if_any_rank_failed(error: Exception | None, what: str) -> None:
    if any_rank(error is not None):
        if error is not None:
            raise error
        raise RuntimeError(f"another rank failed while {what}; the previous checkpoint is intact")


# --- state of the model, optimizer and RNGs ---------------------------------------------------


def _model_difference(saved: dict, current: dict) -> str | None:
    missing = sorted(set(current) - set(saved))
    unexpected = sorted(set(saved) - set(current))
    if missing or unexpected:
        return (
            f"checkpoint and model tensors differ: missing {missing[:5]} "
            f"({len(missing)} in all), unexpected {unexpected[:5]} ({len(unexpected)} in all)"
        )
    for name, tensor in current.items():
        old = saved[name]
        if torch.is_tensor(tensor) and (
            not torch.is_tensor(old) or old.shape != tensor.shape or old.dtype != tensor.dtype
        ):
            got = (tuple(old.shape), old.dtype) if torch.is_tensor(old) else type(old).__name__
            want = (tuple(tensor.shape), tensor.dtype)
            return f"tensor {name}: checkpoint has {got}, model has {want}"
    return None
