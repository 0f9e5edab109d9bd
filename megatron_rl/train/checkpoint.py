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

Every rank writes into ``.tmp_step_00000100/``; once all ranks report success, rank 0 fsyncs and
renames the folder to ``step_00000100`` and only then rewrites ``latest``. A crash at any point
leaves the previous checkpoint intact and ``latest`` pointing at it; leftover ``.tmp_*`` entries
are removed by the next save. A checkpoint is resumed with the same world size and parallel
layout only (convert through the HF export in `megatron_rl.model.conversion` to change layout).
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import time

import torch

from megatron_rl.atomic_io import atomic_write_text, fsync_dir, fsync_file
from megatron_rl.backend.distributed import initialized_parallel_state
from megatron_rl.collectives import any_rank, barrier, rank_and_world_size
from megatron_rl.train.optimizer_state import (
    load_optimizer_state,
    optimizer_difference,
    optimizer_state,
)
from megatron_rl.train.rng_state import capture_rng_state, restore_rng_state

logger = logging.getLogger(__name__)

FORMAT_VERSION = 1
LATEST_FILE = "latest"
META_FILE = "checkpoint.json"
RL_STATE_FILE = "rl_state.json"
_TMP_PREFIXES = (".tmp_", ".tmp-")  # our staging folders; atomic_write_text's temp files


def step_dir_name(step: int) -> str:
    return f"step_{step:08d}"


def save_training_state(
    save_dir: str, step: int, *, model, optimizer, rl_state: dict, keep_last: int = 2
) -> str:
    """Write this rank's model, optimizer and RNG shards for ``step``; commit on rank 0.

    Collective: every rank of the job must call it. ``rl_state`` (rank 0's is kept) must be
    JSON-serialisable. After the commit, checkpoints older than the ``keep_last`` most recent
    are deleted.

    Returns:
        The committed folder ``save_dir/step_{step:08d}``.
    """
    if not isinstance(step, int) or step < 0:
        raise ValueError(f"step={step!r}: must be an int >= 0")
    if keep_last < 1:
        raise ValueError(f"keep_last={keep_last}: must be >= 1 (the new checkpoint is kept)")
    try:
        rl_state_text = json.dumps(rl_state, indent=2, sort_keys=True)
    except (TypeError, ValueError) as exc:
        raise ValueError(f"rl_state is not JSON-serialisable ({exc}); pass plain types") from exc
    rank, world_size = rank_and_world_size()
    final = os.path.join(save_dir, step_dir_name(step))
    staging = os.path.join(save_dir, f".tmp_{step_dir_name(step)}")
    if rank == 0:
        os.makedirs(save_dir, exist_ok=True)
        _remove_staging_leftovers(save_dir)
    barrier()
    start = time.perf_counter()
    error: Exception | None = None
    try:
        os.makedirs(staging, exist_ok=True)
        header = {"format_version": FORMAT_VERSION, "layout": _layout(), "coords": _coords()}
        num_bytes = _save(dict(header, model=model.state_dict()), staging, "model", rank)
        num_bytes += _save(
            dict(header, optimizer=optimizer_state(optimizer)), staging, "optim", rank
        )
        num_bytes += _save(dict(header, rng=capture_rng_state()), staging, "rng", rank)
    except Exception as exc:  # reported to every rank below, so no rank waits forever
        error = exc
    _raise_if_any_rank_failed(error, f"writing step {step} under {staging}")
    if rank == 0:
        try:
            meta = {"format_version": FORMAT_VERSION, "step": step, "layout": _layout()}
            _commit(save_dir, staging, final, step, rl_state_text, meta, keep_last)
        except Exception as exc:
            error = exc
    _raise_if_any_rank_failed(error, f"committing step {step} to {final}")
    seconds = time.perf_counter() - start
    megabytes = num_bytes / 1e6
    logger.info(
        "saved step %d to %s: rank %d/%d wrote %.1f MB in %.2f s (%.1f MB/s)",
        step, final, rank, world_size, megabytes, seconds, megabytes / max(seconds, 1e-9),
    )  # fmt: skip
    return final


def latest_step(load_dir: str) -> int | None:
    """The step named by ``load_dir/latest``; the newest complete step folder if that is unusable.

    Returns None when ``load_dir`` holds no complete checkpoint.
    """
    if not os.path.isdir(load_dir):
        return None
    try:
        with open(os.path.join(load_dir, LATEST_FILE), encoding="utf-8") as handle:
            step = int(handle.read().strip())
        if _is_complete(load_dir, step):
            return step
        logger.warning("%s/latest names step %d, which is incomplete", load_dir, step)
    except (OSError, ValueError):
        pass
    steps = _complete_steps(load_dir)
    return steps[-1] if steps else None


def load_training_state(load_dir: str, *, model, optimizer, step: int | None = None) -> dict | None:
    """Load ``step`` (default: the latest) into ``model`` and ``optimizer`` in place.

    Collective. Restores this rank's RNG states too. Everything is checked on every rank before
    anything is modified: a different world size or parallel layout, or a tensor whose name,
    shape or dtype differs from the model's, raises ValueError naming the difference.

    Returns:
        The saved ``rl_state``, or None when ``load_dir`` does not exist or holds no checkpoint.
    """
    if not os.path.isdir(load_dir):
        return None
    if step is None:
        step = latest_step(load_dir)
        if step is None:
            return None
    if not _is_complete(load_dir, step):
        raise ValueError(
            f"step={step}: no complete checkpoint in {load_dir}; "
            f"available steps: {_complete_steps(load_dir)}"
        )
    folder = os.path.join(load_dir, step_dir_name(step))
    rank, _ = rank_and_world_size()
    problem: str | None = None
    shards: dict[str, dict] = {}
    try:
        with open(os.path.join(folder, META_FILE), encoding="utf-8") as handle:
            problem = _layout_difference(json.load(handle)["layout"], _layout(), folder)
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


# --- commit and housekeeping (rank 0) ---------------------------------------------------------


def _commit(save_dir, staging, final, step, rl_state_text, meta, keep_last) -> None:
    """rl_state + meta into the staging folder, rename it into place, then point ``latest``."""
    for name, text in ((RL_STATE_FILE, rl_state_text), (META_FILE, json.dumps(meta, indent=2))):
        path = os.path.join(staging, name)
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(text)
            handle.flush()
            os.fsync(handle.fileno())
    fsync_dir(staging)
    replaced = None
    if os.path.exists(final):  # re-saving a step (e.g. after resuming from an older one)
        replaced = os.path.join(save_dir, f".tmp_replaced_{step_dir_name(step)}")
        os.replace(final, replaced)
    os.replace(staging, final)
    fsync_dir(save_dir)
    latest = os.path.join(save_dir, LATEST_FILE)
    atomic_write_text(latest, f"{step}\n")
    fsync_file(latest)
    fsync_dir(save_dir)
    if replaced is not None:
        shutil.rmtree(replaced, ignore_errors=True)
    _prune(save_dir, step, keep_last)


def _prune(save_dir: str, step: int, keep_last: int) -> None:
    steps = _complete_steps(save_dir)
    older = [s for s in steps if s < step]
    for old in older[: max(0, len(older) - (keep_last - 1))]:
        shutil.rmtree(os.path.join(save_dir, step_dir_name(old)), ignore_errors=True)
    newer = [s for s in steps if s > step]
    if newer:
        logger.warning("%s holds checkpoints newer than step %d: %s (kept)", save_dir, step, newer)


def _remove_staging_leftovers(save_dir: str) -> None:
    for name in os.listdir(save_dir):
        if name.startswith(_TMP_PREFIXES):
            path = os.path.join(save_dir, name)
            logger.warning("removing %s left by an interrupted save", path)
            if os.path.isdir(path):
                shutil.rmtree(path, ignore_errors=True)
            else:
                os.unlink(path)


def _complete_steps(folder: str) -> list[int]:
    steps = []
    for name in os.listdir(folder):
        if name.startswith("step_") and name[5:].isdigit() and _is_complete(folder, int(name[5:])):
            steps.append(int(name[5:]))
    return sorted(steps)


def _is_complete(folder: str, step: int) -> bool:
    return os.path.isfile(os.path.join(folder, step_dir_name(step), META_FILE))


def _save(obj: dict, folder: str, kind: str, rank: int) -> int:
    path = os.path.join(folder, f"{kind}_rank{rank:05d}.pt")
    torch.save(obj, path)
    fsync_file(path)
    return os.path.getsize(path)


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
