"""The ``tensor`` transport (colocated servers): each flat bucket goes by handle, never by its
bytes, in ``/update_weights_from_tensor`` (SGLang's ``MultiprocessingSerializer`` format: a CUDA
IPC handle on GPU, a shared-memory file name on CPU)."""

from __future__ import annotations

import types

import torch

from megatron_rl.rollout import flat_bucket
from megatron_rl.rollout.flat_bucket import FLATTENED, flat_buckets
from megatron_rl.rollout.weight_sync import ipc_serializer
from megatron_rl.rollout.weight_sync.common import SyncReport, WeightSyncConfig, WeightSyncError
from megatron_rl.rollout.weight_sync.rank_handles import BUCKET, HandleLink
from megatron_rl.rollout.weight_sync.staging import Staging, current_cuda
from megatron_rl.rollout.weight_sync.transport import SyncRound


class TensorTransport:
    """Buckets staged in one buffer and passed by handle to the servers of ``sync`` (a
    `SyncRound`)."""

    def __init__(self, sync: SyncRound):
        self.sync = sync
        self.staging = Staging(sync.config, num_buffers=1)

    @property
    def config(self) -> WeightSyncConfig:
        return self.sync.config

    def push(
        self, stream, report: SyncReport, version: int, *, peers: HandleLink | None = None
    ) -> None:
        """``/update_weights_from_tensor`` per bucket with ``load_format="flattened_bucket"``.

        The payload is SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` format
        (``ForkingPickler`` + base64, written by `ipc_serializer`) of ``{"flattened_tensor": flat,
        "metadata": [...]}`` (what ``_update_weights_from_flattened_bucket`` reads; metadata entries
        are ``SimpleNamespace`` with ``FlattenedTensorMetadata``'s fields, which SGLang's
        ``SafeUnpickler`` admits). The tensor itself never travels: on GPU it is a CUDA IPC handle
        (GPUs named by UUID, as SGLang's ``monkey_patch_torch_reductions`` expects), on CPU the name
        of the shared-memory file holding the staging buffer. SGLang's ``serialized_named_tensors``
        holds one entry per TP rank and each rank deserialises only its own
        (``tp_worker.deserialize_own_rank``): every entry is its own serialisation, because each
        carries its own producer-side reference count. A GPU bucket is a fresh buffer (as SGLang's
        producer makes it); the buffer stays referenced until every server's call has returned. On
        CPU the one shared buffer is reused: servers copy on load.

        ``peers`` (``--colocate``, `rank_handles`): every trainer rank stages the bucket too,
        and server i's entry r is the handle of trainer rank ``i * engine_ranks + r``, the one
        on that TP rank's GPU.
        """
        cfg, sync = self.config, self.sync
        on_gpu = torch.cuda.is_available()
        device = current_cuda() if on_gpu else torch.device("cpu")
        serialize = serializer()
        urls = sync.pool.config.urls
        buckets = iter(flat_buckets(stream, cfg.bucket_bytes))
        while True:
            if peers is not None:  # before the pull: the stream's collectives run on every rank
                peers.say(BUCKET)
            bucket = next(buckets, None)
            if bucket is None:
                break
            report.num_buckets += 1
            if on_gpu:
                self.staging.buffers[0] = None  # one buffer per bucket under CUDA IPC
            flat, slots = self.staging.stage(bucket, device, version, shared=True)
            obj = bucket_object(flat, slots)
            if peers is not None:
                handles = peers.gather(serialize(obj))
                entries = [peers.entries(handles, urls.index(u)) for u in sync.urls]
            else:
                entries = [[serialize(obj) for _ in range(cfg.engine_ranks)] for _ in sync.urls]
            payloads = [
                {"serialized_named_tensors": e, "load_format": FLATTENED, "flush_cache": False}
                for e in entries
            ]
            # waits for every server to finish reading before the buffer may be reused
            try:
                sync.phase("/update_weights_from_tensor", payloads, "update_weights_from_tensor")
            finally:
                self._check_device_seen()
            del obj, payloads, flat
        if on_gpu:
            self.staging.buffers[0] = None

    def _check_device_seen(self) -> None:
        """WeightSyncError naming the fix when a server could not open the tensor handle
        (SGLang's ``srt/utils/patch_torch.py`` raises "Invalid device_uuid" when the handle
        names a GPU that is not among the server's visible devices)."""
        failures = self.sync.failures
        unseen = [u for u, why in failures.items() if "Invalid device_uuid" in why]
        if unseen:
            raise WeightSyncError(
                f"--weight-sync-transport tensor: {unseen} cannot see this rank's GPU "
                f"({failures[unseen[0]]}); the tensor transport needs servers on the "
                "trainer's own GPUs. Use --weight-sync-transport distributed"
            )

    def close(self) -> None:
        self.staging.clear()


def bucket_object(flat: torch.Tensor, slots) -> dict:
    """What ``_update_weights_from_flattened_bucket`` reads: the flat buffer and its metadata."""
    return {"flattened_tensor": flat, "metadata": [_metadata(s) for s in slots]}


def serializer():
    """`ipc_serializer.serialize`: CUDA IPC handles (devices by UUID) on GPU, shared-memory file
    names on CPU (through `_serialize_shared`, the seam tests replace)."""
    return ipc_serializer.serialize if torch.cuda.is_available() else _serialize_shared


def _metadata(slot: flat_bucket.Slot) -> types.SimpleNamespace:
    """SGLang's ``FlattenedTensorMetadata`` fields (``numel`` counts bytes, as there)."""
    return types.SimpleNamespace(
        name=slot.name,
        shape=torch.Size(slot.shape),
        dtype=slot.dtype,
        start_idx=slot.start,
        end_idx=slot.end,
        numel=slot.end - slot.start,
    )


def _serialize_shared(obj) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` on CPU:
    ``ForkingPickler`` (shared storages by file name) then base64."""
    return ipc_serializer.serialize(obj)
