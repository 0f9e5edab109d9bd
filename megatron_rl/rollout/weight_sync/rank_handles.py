"""Colocated servers load every bucket from the trainer rank on their own GPU (the ``tensor``
transport under ``--colocate``).

SGLang's ``/update_weights_from_tensor`` takes ``serialized_named_tensors``, one entry per TP
rank of the server, and TP rank r deserialises entry r only (``tp_worker.deserialize_own_rank``).
Colocated, server i's TP rank r shares its GPU with trainer global rank ``i * engine_ranks + r``
(the launcher places them so), and entry r must be a handle of a buffer on that GPU: a CUDA IPC
handle of another GPU, another node's above all, cannot be opened there. So every trainer rank
stages each bucket itself (every rank holds the full tensors: the TP/EP gathers, and under
pipeline parallelism the pipeline broadcast of `iter_hf_tensors_every_stage`), serialises a
handle of it, and global rank 0 gathers the handles (a few hundred bytes each) and posts each
server the entries of its own ranks (slime gathers its colocated handles the same way).

Before each bucket rank 0 says ``"bucket"`` (every rank pulls its next bucket from its stream,
at the same time, since the stream's gathers and pipeline broadcasts are collectives; each
stages it and the handles are gathered) or ``"stop"`` (the sync is over, whatever happened:
the other ranks iterate the rest of their stream and return). A rank's buffer is reused only
after the next ``"bucket"``, so every server has finished reading it by then.
"""

from __future__ import annotations

import torch
import torch.distributed as dist

from megatron_rl.collectives import broadcast_object
from megatron_rl.rollout.flat_bucket import flat_buckets
from megatron_rl.rollout.weight_sync.common import WeightSyncConfig, sent_stream
from megatron_rl.rollout.weight_sync.staging import Staging, current_cuda

BUCKET, STOP = "bucket", "stop"


class HandleLink:
    """A gloo group over every trainer rank (created by all of them) and the per-bucket
    messages of the module docstring; ``engine_ranks`` trainer ranks per server, in order."""

    def __init__(self, config: WeightSyncConfig, num_servers: int):
        world = dist.get_world_size()
        if world != config.engine_ranks * num_servers:
            raise ValueError(
                f"--colocate: {world} trainer ranks but {num_servers} servers x "
                f"--sglang-engine-ranks {config.engine_ranks}: each server's TP rank r must "
                "share a GPU with one trainer rank (server i's with ranks i * engine_ranks + r)"
            )
        self.config = config
        self.group = dist.new_group(backend="gloo")
        self.open = False  # rank 0: a sync is under way and its "stop" not yet said

    def say(self, what: str) -> None:
        """Rank 0: ``"bucket"`` or ``"stop"`` to every rank."""
        broadcast_object(what, 0, self.group)
        self.open = what != STOP

    def hear(self) -> str:
        return broadcast_object(None, 0, self.group)

    def gather(self, handle: str) -> list[str] | None:
        """Every rank's handle on rank 0 (None elsewhere)."""
        out = [None] * dist.get_world_size() if dist.get_rank() == 0 else None
        dist.gather_object(handle, out, dst=0, group=self.group)
        return out

    def entries(self, handles: list[str], server: int) -> list[str]:
        """``serialized_named_tensors`` of server ``server``: its TP ranks' trainer handles."""
        ranks = self.config.engine_ranks
        return handles[server * ranks : (server + 1) * ranks]


def serve_handles(link: HandleLink, stream, version: int, serialize, obj_of) -> None:
    """A trainer rank other than 0: stage each bucket of ``stream`` and hand rank 0 a handle
    of it (``serialize(obj_of(flat, slots))``) until rank 0 says ``"stop"``."""
    device = current_cuda() if torch.cuda.is_available() else torch.device("cpu")
    staging = Staging(link.config, num_buffers=1)
    buckets = iter(flat_buckets(sent_stream(stream, link.config), link.config.bucket_bytes))
    try:
        while link.hear() == BUCKET:
            bucket = next(buckets, None)  # rank 0 pulls its own at the same time
            if bucket is None:
                continue  # the stream is over here as on rank 0: its "stop" comes next
            if device.type == "cuda":
                staging.buffers[0] = None  # one buffer per bucket under CUDA IPC
            flat, slots = staging.stage(bucket, device, version, shared=True)
            link.gather(serialize(obj_of(flat, slots)))
    finally:
        for _ in buckets:  # the gathers are collectives: take part to the end
            pass
        staging.clear()
