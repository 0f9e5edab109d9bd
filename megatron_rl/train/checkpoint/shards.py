"""The files of a step folder and their records: each written and fsynced, recorded as
``{name: {"bytes": size, "sha256": hex digest}}`` in ``checkpoint.json``, and checked against
that record at load.

Per-rank files are ``{model,optim,rng}_rank{rank:05d}.pt``; the files megatron writes for the
``torch_dist`` format (``*.distcp``, ``.metadata``, ...) are hashed and checked in shares, every
rank taking every world-size-th name.
"""

from __future__ import annotations

import hashlib
import os
import re

import torch

from megatron_rl.atomic_io import fsync_file
from megatron_rl.collectives import rank_and_world_size
from megatron_rl.train.checkpoint.folders import DIST_FORMAT, RL_STATE_FILE, TORCH_FORMAT, read_meta

RANK_FILE = re.compile(r"(model|optim|rng)_rank\d{5}\.pt$")


def write_shard(obj: dict, folder: str, kind: str, rank: int) -> dict[str, dict]:
    """Write one shard file, fsynced; its ``{name: {bytes, sha256}}`` record."""
    name = f"{kind}_rank{rank:05d}.pt"
    torch.save(obj, os.path.join(folder, name))
    fsync_file(os.path.join(folder, name))
    return file_record(folder, name)


def file_record(folder: str, name: str) -> dict[str, dict]:
    path = os.path.join(folder, name)
    return {name: {"bytes": os.path.getsize(path), "sha256": sha256(path)}}


def hash_share(folder: str, exclude: dict) -> dict[str, dict]:
    """Records of this rank's share of the files in ``folder`` that are not in ``exclude`` and
    not another rank's own files (every rank takes every world-size-th name)."""
    rank, world_size = rank_and_world_size()
    names = sorted(
        name for name in os.listdir(folder) if name not in exclude and not RANK_FILE.match(name)
    )
    records: dict[str, dict] = {}
    for name in names[rank::world_size]:
        records.update(file_record(folder, name))
    return records


def corruption(step_dir: str, rank: int) -> str | None:
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
        digest = sha256(os.path.join(step_dir, name))
        if digest != records[name]["sha256"]:
            return (
                f"{name} is corrupted: its sha256 {digest[:16]}... differs from "
                f"{records[name]['sha256'][:16]}... recorded at save"
            )
    return None


def sha256(path: str) -> str:
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 22), b""):
            digest.update(block)
    return digest.hexdigest()
