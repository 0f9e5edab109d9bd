"""Reading and writing (possibly sharded) safetensors checkpoints, with atomic writes.

A checkpoint folder holds ``model.safetensors`` or shards listed by
``model.safetensors.index.json`` (the HF layout). Reads are lazy: only the headers are parsed up
front and each tensor is read when asked for. Every file is written to a temporary name in the
same folder and moved into place with ``os.replace``.
"""

from __future__ import annotations

import json
import os
import tempfile
from collections.abc import Iterable, Iterator
from contextlib import ExitStack
from typing import Any

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from megatron_rl.atomic_io import atomic_write_text, fsync_file

SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


class CheckpointReader:
    """Lazy access to the tensors of a safetensors checkpoint folder (use as a context manager)."""

    def __init__(self, folder: str | os.PathLike) -> None:
        self.folder = os.fspath(folder)
        index_path = os.path.join(self.folder, INDEX_FILE)
        if os.path.exists(index_path):
            with open(index_path, encoding="utf-8") as handle:
                self._file_of: dict[str, str] = json.load(handle)["weight_map"]
        elif os.path.exists(os.path.join(self.folder, SINGLE_FILE)):
            self._file_of = {}
            with safe_open(os.path.join(self.folder, SINGLE_FILE), framework="pt") as handle:
                self._file_of = dict.fromkeys(handle.keys(), SINGLE_FILE)
        else:
            raise FileNotFoundError(f"{self.folder}: neither {SINGLE_FILE} nor {INDEX_FILE} found")
        self._stack = ExitStack()
        self._handles: dict[str, Any] = {}

    def __enter__(self) -> CheckpointReader:
        return self

    def __exit__(self, *exc: object) -> None:
        self._stack.close()

    def _handle(self, name: str) -> Any:
        file = self._file_of[name]
        if file not in self._handles:
            path = os.path.join(self.folder, file)
            self._handles[file] = self._stack.enter_context(safe_open(path, framework="pt"))
        return self._handles[file]

    def names(self) -> list[str]:
        return list(self._file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        """Shape from the file header; reads no tensor data."""
        return tuple(self._handle(name).get_slice(name).get_shape())

    def get(self, name: str) -> torch.Tensor:
        return self._handle(name).get_tensor(name)


def atomic_save_file(tensors: dict[str, torch.Tensor], path: str, metadata: dict[str, str]) -> None:
    folder = os.path.dirname(path)
    fd, tmp = tempfile.mkstemp(prefix=".tmp-", suffix=".safetensors", dir=folder)
    os.close(fd)
    try:
        save_file(tensors, tmp, metadata=metadata)
        fsync_file(tmp)  # the data is on disk before the name points at it
        os.replace(tmp, path)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise


def write_checkpoint(
    tensors: Iterable[tuple[str, torch.Tensor]],
    folder: str | os.PathLike,
    *,
    max_shard_bytes: int = 2 * 1024**3,
    metadata: dict[str, str] | None = None,
) -> list[str]:
    """Stream (name, tensor) pairs into safetensors shards of at most ``max_shard_bytes``.

    Holds one shard in memory at a time. One shard is written as ``model.safetensors``; several
    as ``model-0000i-of-0000n.safetensors`` plus ``model.safetensors.index.json``.

    Returns:
        The file names written.
    """
    folder = os.fspath(folder)
    os.makedirs(folder, exist_ok=True)
    metadata = {"format": "pt", **(metadata or {})}
    temp_names: list[tuple[str, list[str]]] = []
    total = 0
    for bucket in _buckets(tensors, max_shard_bytes):
        tmp_name = f".part-{len(temp_names):05d}.safetensors"
        atomic_save_file(bucket, os.path.join(folder, tmp_name), metadata)
        temp_names.append((tmp_name, list(bucket)))
        total += sum(t.numel() * t.element_size() for t in bucket.values())
    if not temp_names:
        raise ValueError("no tensors to write")
    if len(temp_names) == 1:
        os.replace(os.path.join(folder, temp_names[0][0]), os.path.join(folder, SINGLE_FILE))
        return [SINGLE_FILE]
    count = len(temp_names)
    weight_map: dict[str, str] = {}
    files = []
    for i, (tmp_name, names) in enumerate(temp_names):
        final = f"model-{i + 1:05d}-of-{count:05d}.safetensors"
        os.replace(os.path.join(folder, tmp_name), os.path.join(folder, final))
        weight_map.update(dict.fromkeys(names, final))
        files.append(final)
    index = {"metadata": {"total_size": total}, "weight_map": weight_map}
    atomic_write_text(os.path.join(folder, INDEX_FILE), json.dumps(index, indent=2))
    return [*files, INDEX_FILE]


def _buckets(
    tensors: Iterable[tuple[str, torch.Tensor]], max_bytes: int
) -> Iterator[dict[str, torch.Tensor]]:
    bucket: dict[str, torch.Tensor] = {}
    size = 0
    for name, tensor in tensors:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > max_bytes:
            yield bucket
            bucket, size = {}, 0
        if name in bucket:
            raise RuntimeError(f"tensor {name!r} produced twice")
        bucket[name] = tensor.detach().to("cpu").contiguous()
        size += nbytes
    if bucket:
        yield bucket
