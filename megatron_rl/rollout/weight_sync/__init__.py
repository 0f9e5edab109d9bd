"""Push trainer weights to SGLang servers: three transports, bucketed, versioned, checked.

Modules: `common` (config, report, error), `sync` (`WeightSync`: one sync and its membership;
the one module that picks a transport), `transport` (what a transport sees of the sync,
`SyncRound`, and what the sync asks of it, `Transport`), `reprobe` (dropped servers probed in
the background), `staging` (the buffers buckets are packed into), one per transport:
`distributed`, `tensor`, `disk` (each imports `transport`, never `sync`); `stages` (under
pipeline parallelism the ``distributed`` transport sends each stage's tensors from that stage's
first rank, over a group of the stage's own, driven by rank 0).

One sync (`sync_weights`) on the trainer's global rank 0, fed by
`megatron_rl.model.conversion.iter_hf_tensors` (collective: the other ranks iterate it too and
drop the tensors):

1. ``/pause_generation`` in ``pause_mode`` and ``/flush_cache`` on every server: ``abort``
   (SGLang's default) ends the requests in flight, ``retract`` and ``in_place`` keep them to go
   on under the new weights (``--partial-rollout``); see `sync` for the releases that have each
   and for the flush each mode allows;
2. ``/begin_weight_update`` (transports ``distributed`` and ``tensor``, on servers that have
   sessions: `update_session`), the tensors, in buckets of at most ``bucket_bytes``
   (`flat_bucket.flat_buckets`), each packed into one staging buffer in SGLang's
   ``flattened_bucket`` layout and checked for NaN/Inf there, once, on this side
   (`flat_bucket.first_nonfinite`; servers do not check), then sent by one transport:
   ``distributed`` (``/init_weights_update_group`` once, then per bucket
   ``/update_weights_from_distributed`` with ``load_format="flattened_bucket"`` while rank 0
   broadcasts the flat buffer once over that group; NCCL on GPU, gloo on CPU), ``tensor``
   (``/update_weights_from_tensor``, colocated: the flat buffer by SGLang's
   ``MultiprocessingSerializer`` format, which passes CUDA IPC handles on GPU and a shared-memory
   file name on CPU, never the bytes), or ``disk`` (HF safetensors written to a temporary folder
   renamed into place, then ``/update_weights_from_disk``), then ``/end_weight_update``, whatever
   happened;
3. ``/update_weight_version`` to ``version`` once every bucket loaded (``abort_all_requests``
   false, so the paused requests survive), then each server's
   ``weight_version`` (``/model_info``) must equal it, and optionally per-tensor checksums;
4. ``/continue_generation``, whatever happened.

Server membership (see `WeightSync`): a server that dies or fails any step leaves the sync and
is dropped from the pool; the others go on. A dropped server is probed in the background on an
exponential backoff (`reprobe`; no sync waits for a probe); once a probe answers it takes part
in the next sync and rejoins the pool only once it has it all. ``distributed``: the group is
destroyed at once and rebuilt without the failed member, within ``failure_timeout_s``.
`WeightSyncError` only when fewer than ``min_servers`` servers are left.

A failure raises `WeightSyncError` before step 3 moves the version, so servers keep reporting
the old version. Caveat on real SGLang: buckets already loaded stay loaded, so the weights are
a mix until a retried sync succeeds; the trainer must not generate from a server whose sync
failed (the version check on samples catches it).
"""

from megatron_rl.rollout.weight_sync.common import (
    TRANSPORTS,
    SyncReport,
    WeightSyncConfig,
    WeightSyncError,
)
from megatron_rl.rollout.weight_sync.distributed import FIRST_BUCKET_BYTES
from megatron_rl.rollout.weight_sync.reprobe import ReprobeConfig
from megatron_rl.rollout.weight_sync.staging import (
    SHM_ATTEMPTS,
    SHM_MANAGER_TIMEOUT,
    new_shared_storage,
)
from megatron_rl.rollout.weight_sync.sync import WeightSync

__all__ = [
    "FIRST_BUCKET_BYTES",
    "SHM_ATTEMPTS",
    "SHM_MANAGER_TIMEOUT",
    "TRANSPORTS",
    "ReprobeConfig",
    "SyncReport",
    "WeightSync",
    "WeightSyncConfig",
    "WeightSyncError",
    "new_shared_storage",
]
