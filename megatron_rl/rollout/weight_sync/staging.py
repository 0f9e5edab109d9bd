"""Staging buffers: the flat uint8 buffers a bucket is packed into and checked in before it is
sent (``distributed`` and ``tensor``), on the GPU, in CPU memory, or in a shared-memory file."""

from __future__ import annotations

import contextlib
import logging
import time

import torch

from megatron_rl.rollout import flat_bucket
from megatron_rl.rollout.weight_sync.common import WeightSyncConfig, WeightSyncError

logger = logging.getLogger(__name__)

FLOAT8 = (torch.float8_e4m3fn, torch.float8_e5m2)

SHM_MANAGER_TIMEOUT = "Shared memory manager connection has timed out"
SHM_ATTEMPTS = 3


class Staging:
    """``num_buffers`` uint8 staging buffers, reused across buckets and syncs (the
    ``distributed`` transport keeps two: one packs while the other is on the wire)."""

    def __init__(self, config: WeightSyncConfig, num_buffers: int):
        self.config = config
        self.buffers: list[torch.Tensor | None] = [None] * num_buffers

    def stage(self, bucket, device: torch.device, version: int, *, index=0, shared=False):
        """Pack ``bucket`` into buffer ``index`` (grown when too small; ``shared``: a
        shared-memory file on CPU) and check it for NaN/Inf; (flat bucket, slots)."""
        slots = flat_bucket.bucket_slots(bucket)
        need = slots[-1].end
        staging = self.buffers[index]
        if staging is None or staging.numel() < need or staging.device != device:
            self.buffers[index] = None
            if shared and device.type == "cpu":
                staging = torch.empty(0, dtype=torch.uint8).set_(new_shared_storage(need))
            else:
                staging = torch.empty(need, dtype=torch.uint8, device=device)
            if need <= self.config.bucket_bytes:  # a one-off larger buffer is not kept
                self.buffers[index] = staging
        flat = staging[:need]
        flat_bucket.pack(bucket, flat)
        # float8 has no finiteness reduction on CPU; block_fp8 refused NaN/Inf before rounding
        bad = flat_bucket.first_nonfinite(flat, [s for s in slots if s.dtype not in FLOAT8])
        if bad is not None:
            raise WeightSyncError(
                f"weight sync to version {version}: tensor {bad!r} holds NaN or Inf; "
                "nothing after the previous bucket was sent and the version is unchanged"
            )
        return flat, slots

    def clear(self) -> None:
        self.buffers = [None] * len(self.buffers)


def current_cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


@contextlib.contextmanager
def file_system_sharing():
    """torch's "file_system" sharing strategy for the block: shared CPU storages are named
    files that any process on the host can map (the default "file_descriptor" strategy only
    reaches processes that share this one's multiprocessing authkey)."""
    import torch.multiprocessing as tmp

    before = tmp.get_sharing_strategy()
    tmp.set_sharing_strategy("file_system")
    try:
        yield
    finally:
        tmp.set_sharing_strategy(before)


def new_shared_storage(nbytes: int, *, pause_s: float = 0.5) -> torch.UntypedStorage:
    """A shared-memory file storage of ``nbytes`` ("file_system" strategy).

    torch registers each such file with its ``torch_shm_manager`` process over a socket with a
    timeout; on a loaded host the manager can miss it ("Shared memory manager connection has
    timed out", seen once in CI with 2 busy cores). That error is retried (``SHM_ATTEMPTS`` in
    all, ``pause_s`` then twice that between them); any other error, or the last attempt's, is
    raised.
    """
    for attempt in range(SHM_ATTEMPTS):
        try:
            with file_system_sharing():
                return torch.UntypedStorage._new_shared(nbytes)
        except RuntimeError as error:
            if SHM_MANAGER_TIMEOUT not in str(error) or attempt == SHM_ATTEMPTS - 1:
                raise
            logger.warning("torch's shared-memory manager timed out; retrying (%s)", attempt + 1)
            time.sleep(pause_s * 2**attempt)
    raise AssertionError("unreachable")  # pragma: no cover
