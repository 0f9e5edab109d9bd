"""Saving a training checkpoint: every rank writes its shards into a staging folder, rank 0
commits it (`commit`); in the background for ``--async-save``.

Layout of ``save_dir``::

    latest                      the committed step, as text (rewritten atomically, last)
    step_00000100/
        checkpoint.json         step, world size, parallel layout, format version, file records
        rl_state.json           the trainer's JSON state: sampler position, weight version, ...
        model_rank00000.pt      rank 0's model state_dict (its TP/EP/PP shard)
        optim_rank00000.pt      rank 0's optimizer state (its distributed-optimizer shard on GPU)
        rng_rank00000.pt        rank 0's torch/CUDA/python/numpy/megatron-tracker RNG states
        ...

Every rank writes into ``.tmp_step_00000100/`` and hashes its files (sha256, `shards`); once all
ranks report success, rank 0 records every file's size and hash in ``checkpoint.json``, fsyncs,
renames the folder to ``step_00000100`` and only then rewrites ``latest`` (`commit`).

Two formats (``fmt`` / ``--ckpt-format``; loading reads ``format`` in ``checkpoint.json``, and
a folder without it is ``torch``):

* ``torch`` (default): the per-rank files above. Resumed with the same world size and parallel
  layout only, virtual pipeline size included (a different one is a named error).
* ``torch_dist``: model and optimizer through megatron's ``dist_checkpointing``
  (`torch_dist`: ``*.distcp``, ``.metadata``, ``common.pt``, ``metadata.json``), plus
  ``rl_state.json`` and ``rng_rank*.pt``. Resumed at any TP/EP/PP/DP layout, interleaved or not
  (PP 2 <-> PP 1 and PP 2 x VP 2 <-> PP 1 / PP 2 tested). The same staging folder, sha256
  records (every rank hashes and verifies a share of the files), rename and ``latest`` make it
  atomic.

Async save (``torch_dist`` only; ``--async-save``): `start_async_save` snapshots the state and
returns while megatron's writer processes write it into the staging folder (see `async_write`
for why the files hold the saved step's tensors whatever the caller updates meanwhile);
``rl_state.json`` and the RNG files are written from the same moment. The returned `PendingSave`
commits it (hashes, ``checkpoint.json``, rename, ``latest``, pruning, all as above) with
``finalize()`` (collective; waits for every rank's writer) or ``try_finalize()`` (collective;
commits only when every writer has finished). Until then ``latest`` names the previous
checkpoint, and a crash leaves only a ``.tmp_`` folder. One save at a time: starting a save
first commits the one in flight. ``abandon()`` (no collective, for error paths) waits for this
rank's writer and commits nothing. The sha256 hashing stays in the commit, on the caller's time.
"""

from __future__ import annotations

import json
import logging
import os
import time

from megatron_rl.collectives import all_gather_objects, any_rank, barrier, rank_and_world_size
from megatron_rl.lora.checkpoint import trained_state_dict
from megatron_rl.train.checkpoint.commit import commit, remove_staging_leftovers
from megatron_rl.train.checkpoint.folders import (
    CKPT_FORMATS,
    DIST_FORMAT,
    TORCH_FORMAT,
    step_dir_name,
)
from megatron_rl.train.checkpoint.optimizer_state import optimizer_state
from megatron_rl.train.checkpoint.ranks import coords, layout, raise_if_any_rank_failed
from megatron_rl.train.checkpoint.rng_state import capture_rng_state
from megatron_rl.train.checkpoint.shards import hash_share, write_shard
from megatron_rl.train.checkpoint.torch_dist import save_sharded, sharded_save_state

logger = logging.getLogger(__name__)

FORMAT_VERSION = 2  # 2: checkpoint.json lists every file with its size and sha256


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
                files.update(hash_share(self.staging, exclude=files))
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
                    "layout": layout(),
                }
                commit(
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
            raise_if_any_rank_failed(error, f"{what} step {self.step} under {self.staging}")


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
        remove_staging_leftovers(save_dir)
    barrier()
    error: Exception | None = None
    files = pending._files
    try:
        os.makedirs(pending.staging, exist_ok=True)
        header = {"format_version": FORMAT_VERSION, "layout": layout(), "coords": coords()}
        if fmt == TORCH_FORMAT:
            staging = pending.staging
            files.update(
                # a LoRA run's frozen base stays out (megatron_rl/lora/checkpoint.py)
                write_shard(dict(header, model=trained_state_dict(model)), staging, "model", rank)
            )
            files.update(
                write_shard(
                    dict(header, optimizer=optimizer_state(optimizer)), staging, "optim", rank
                )
            )
        rng = dict(header, rng=capture_rng_state())
        files.update(write_shard(rng, pending.staging, "rng", rank))
    except Exception as exc:  # reported to every rank below, so no rank waits forever
        error = exc
    raise_if_any_rank_failed(error, f"writing step {step} under {pending.staging}")
    if fmt == DIST_FORMAT:
        state = None
        try:  # this rank's sharded state: a rank failing here stops all before the write
            state = sharded_save_state(model, optimizer)
        except Exception as exc:
            error = exc
        raise_if_any_rank_failed(error, f"collecting step {step}'s sharded state")
        try:  # collective: every rank reached it (no rank failed above)
            pending._write = save_sharded(pending.staging, state, background)
        except Exception as exc:
            error = exc
        raise_if_any_rank_failed(error, f"writing step {step} under {pending.staging}")
    if pending._write is not None:
        _IN_FLIGHT[0] = pending
    pending.blocked_seconds = time.perf_counter() - start
    pending._started = start
    return pending
