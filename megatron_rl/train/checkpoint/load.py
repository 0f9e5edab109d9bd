"""Loading a training checkpoint into the model, the optimizer and this rank's RNGs.

`load_training_state` takes the step ``latest`` names (or the one asked for) and checks its
folder before anything is modified: the records and sizes in ``checkpoint.json``
(`folders.folder_problem`), then every file's sha256 (`shards.corruption`), the parallel layout
and every tensor's name, shape and dtype. Any damage (a missing or broken ``checkpoint.json``, a
truncated or missing file, a flipped byte) is a `CheckpointDamaged` error naming the folder, the
file and what is wrong; ``fallback=True`` (``--load-fallback``) loads the newest older step that
verifies instead. Never an older step quietly (`folders`). A ``torch`` folder loads at its saved
layout only; a ``torch_dist`` one at any layout (`torch_dist.load_sharded`).
"""

from __future__ import annotations

import json
import logging
import os

import torch

from megatron_rl.collectives import any_rank, rank_and_world_size
from megatron_rl.lora.checkpoint import load_trained_state, trained_state_dict
from megatron_rl.train.checkpoint.folders import (
    DIST_FORMAT,
    RL_STATE_FILE,
    TORCH_FORMAT,
    choose_step,
    older_step,
    read_meta,
    step_dir_name,
)
from megatron_rl.train.checkpoint.optimizer_state import load_optimizer_state, optimizer_difference
from megatron_rl.train.checkpoint.ranks import (
    coords,
    layout,
    layout_difference,
    raise_if_any_rank_failed,
)
from megatron_rl.train.checkpoint.rng_state import restore_rng_state
from megatron_rl.train.checkpoint.shards import corruption
from megatron_rl.train.checkpoint.torch_dist import load_sharded

logger = logging.getLogger(__name__)


def load_training_state(
    load_dir: str, *, model, optimizer, step: int | None = None, fallback: bool = False
) -> dict | None:
    """Load ``step`` (default: the one ``latest`` names) into ``model`` and ``optimizer`` in place.

    Collective. Restores this rank's RNG states too. Everything is checked on every rank before
    anything is modified: the step folder's records and sizes
    (`folders.folder_problem`), each file's sha256 against its
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
        corrupted = corruption(folder, rank)
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
        problem = layout_difference(meta["layout"], layout(), folder)
        if problem is None:
            for kind in ("model", "optim", "rng"):  # model tensors are copied out: mmap them
                path = os.path.join(folder, f"{kind}_rank{rank:05d}.pt")
                shards[kind] = torch.load(
                    path, map_location="cpu", weights_only=True, mmap=kind == "model"
                )
            problem = layout_difference(shards["model"]["coords"], coords(), folder)
            current = trained_state_dict(model)  # LoRA: the adapters, not the frozen base
            problem = problem or _model_difference(shards["model"]["model"], current)
            problem = problem or optimizer_difference(shards["optim"]["optimizer"], optimizer)
            with open(os.path.join(folder, RL_STATE_FILE), encoding="utf-8") as handle:
                rl_state = json.load(handle)
    except (OSError, KeyError, RuntimeError, ValueError) as exc:
        problem = f"{folder}: cannot read rank {rank}'s shard ({exc!r})"
    if any_rank(problem is not None):
        raise ValueError(problem or f"{folder}: another rank's shard does not match; see its error")
    load_trained_state(model, shards["model"]["model"])
    load_optimizer_state(optimizer, shards["optim"]["optimizer"])
    restore_rng_state(shards["rng"]["rng"])
    logger.info("loaded step %d from %s", step, folder)
    return rl_state


def _load_dist(folder: str, meta: dict, step: int, *, model, optimizer) -> dict:
    """Load a ``torch_dist`` step folder at this job's layout (any TP/EP/PP/DP layout)."""
    rank, _ = rank_and_world_size()
    saved_layout = meta["layout"]
    same_layout = layout_difference(saved_layout, layout(), folder) is None
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
    raise_if_any_rank_failed(error, f"reading {folder}")
    load_sharded(folder, model, optimizer)
    if not same_layout:
        rng.pop("tracker", None)  # megatron's model-parallel RNG streams are per TP rank
        logger.info(
            "%s was saved at layout %s, resumed at %s: tensors resharded; RNG states of saved "
            "rank %d restored (megatron's tensor-parallel RNG tracker kept as seeded)",
            folder, saved_layout, layout(), rank % saved_layout["world_size"],
        )  # fmt: skip
    restore_rng_state(rng)
    logger.info("loaded step %d from %s (%s)", step, folder, DIST_FORMAT)
    return rl_state


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
