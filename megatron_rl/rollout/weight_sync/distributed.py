"""The ``distributed`` transport: rank 0 broadcasts each flat bucket over a weight-update group
that the servers join (``/init_weights_update_group``; NCCL on GPU, gloo on CPU), while each
server loads it (``/update_weights_from_distributed`` with ``load_format="flattened_bucket"``).

Under pipeline parallelism every stage has a group of its own, whose rank 0 is the stage's first
trainer rank (`stages`): rank 0 sends stage 0 here and drives the other stages' senders."""

from __future__ import annotations

import concurrent.futures
import logging
import time
import uuid
from collections.abc import Sequence
from concurrent.futures import wait

import torch

from megatron_rl.rollout.flat_bucket import FLATTENED, flat_buckets
from megatron_rl.rollout.weight_group import (
    destroy_weight_group,
    dtype_name,
    host_store,
    init_weight_group,
    unique_group_name,
)
from megatron_rl.rollout.weight_sync.common import (
    SyncReport,
    WeightSyncConfig,
    WeightSyncError,
    call_failure,
)
from megatron_rl.rollout.weight_sync.stages import RemoteStage
from megatron_rl.rollout.weight_sync.staging import Staging, current_cuda
from megatron_rl.rollout.weight_sync.transport import SyncRound

logger = logging.getLogger(__name__)

FIRST_BUCKET_BYTES = 8 * 1024**2  # a small first bucket starts the pipeline


class _Group:
    """One stage's weight-update group as rank 0 sees it: its unique name, its servers in rank
    order, and who broadcasts over it (``sender``: None for stage 0, whose group is ``local``
    here; else the stage's `RemoteStage`)."""

    def __init__(self, stage: int, sender: RemoteStage | None = None):
        self.stage, self.sender = stage, sender
        self.name: str | None = None
        self.urls: tuple[str, ...] = ()
        self.local = None  # stage 0: this side's torch ProcessGroup


class DistributedTransport:
    """The weight-update groups (one per pipeline stage; rebuilt without a member that fails)
    and the buckets sent over them, for the servers of ``sync`` (a `SyncRound`)."""

    def __init__(self, sync: SyncRound):
        self.sync = sync
        self.staging = Staging(sync.config, num_buffers=2)
        self.groups: dict[int, _Group] = {0: _Group(0)}
        self._run_id = uuid.uuid4().hex[:12]

    @property
    def config(self) -> WeightSyncConfig:
        return self.sync.config

    @property
    def group_name(self) -> str | None:
        """Stage 0's live group's unique name."""
        return self.groups[0].name

    def push(
        self,
        stream,
        report: SyncReport,
        version: int,
        *,
        stages: Sequence[RemoteStage] = (),
        sums: dict | None = None,
    ) -> None:
        """Stage 0's ``stream`` from here, then each remote stage's from its own sender.

        ``stages``: the other pipeline stages' senders (`stages.RemoteStage`), in stage order
        (`WeightSync.sync` tells each ``end``, whatever happens). ``sums``: per-tensor
        checksums of the remote stages go there (``WeightSyncConfig.checksum``).
        ``report.stage_bytes`` gets the bytes each stage sent.
        """
        for stage in stages:
            group = self.groups.setdefault(stage.stage, _Group(stage.stage, stage))
            group.sender = stage
        report.stage_bytes = [0] * (1 + len(stages))
        self._push_local(stream, report, version)
        for i, stage in enumerate(stages, start=1):
            self._push_remote(self.groups[stage.stage], report, i, sums)

    def _push_local(self, stream, report: SyncReport, version: int) -> None:
        """Per bucket: announce it to every live server and broadcast it over stage 0's group.

        When a member fails (its call fails or the broadcast breaks), the group is destroyed at
        once (which also frees the members stuck in the broadcast), the failed members leave
        the sync, and the same bucket is sent again over a group rebuilt from the survivors
        (buckets already loaded stay loaded; loading is idempotent).

        Double-buffered: the next bucket is packed and checked while this one is on the wire
        and being loaded (two staging buffers of at most ``bucket_bytes``); the first bucket
        is at most `FIRST_BUCKET_BYTES`, since its packing overlaps nothing.
        """
        cfg, group = self.config, self.groups[0]
        device = current_cuda() if cfg.backend == "nccl" else torch.device("cpu")
        first = min(cfg.bucket_bytes, FIRST_BUCKET_BYTES)
        buckets = iter(flat_buckets(stream, cfg.bucket_bytes, first_bucket_bytes=first))

        def stage_next(index: int):
            bucket = next(buckets, None)
            return (
                None if bucket is None else self.staging.stage(bucket, device, version, index=index)
            )

        try:
            staged, index = stage_next(0), 0
            while staged is not None:
                flat, slots = staged
                report.num_buckets += 1
                report.stage_bytes[0] += sum(s.end - s.start for s in slots)
                ahead: dict = {}

                def prefetch(index=index, ahead=ahead):
                    try:
                        ahead["staged"] = stage_next(1 - index)
                    except BaseException as err:  # raised once this bucket is through
                        ahead["error"] = err

                header = _header(slots)
                self._send_until_delivered(group, header, flat, None if ahead else prefetch)
                if not ahead:
                    prefetch()
                if "error" in ahead:
                    raise ahead["error"]
                staged, index = ahead["staged"], 1 - index
        except BaseException:
            # Ranks may be mid-broadcast: the group cannot be trusted any more. The next sync
            # builds a fresh one under a new name.
            self._destroy_group(group)
            raise

    def _push_remote(self, group: _Group, report: SyncReport, index: int, sums) -> None:
        """Stage ``group.stage``'s buckets, packed and broadcast by its own sender, announced
        to the servers from here; failures as in `_push_local`."""
        try:
            while (header := group.sender.next_bucket()) is not None:
                report.num_buckets += 1
                report.num_tensors += len(header["names"])
                report.num_bytes += header["bytes"]
                report.stage_bytes[index] += header["bytes"]
                if sums is not None:
                    sums.update(header["sums"])
                self._send_until_delivered(group, header, None)
        except BaseException:
            self._destroy_group(group)
            raise

    def _send_until_delivered(self, group: _Group, header: dict, flat, meanwhile=None) -> None:
        """One bucket over ``group``, rebuilt without the members that fail, until every live
        server has it (WeightSyncError when too few are left)."""
        sync = self.sync
        for _ in range(len(sync.pool.config.urls) + 1):
            sync.require()
            if group.name is None or group.urls != sync.urls:
                self._destroy_group(group)
                self._init_group(group)
            if self._send_bucket(group, header, flat, meanwhile=meanwhile):
                return
            meanwhile = None  # ran during the failed attempt
        raise WeightSyncError("a bucket failed on every rebuilt weight group")  # pragma: no cover

    def _send_bucket(self, group: _Group, header: dict, flat, *, meanwhile=None) -> bool:
        """One bucket over the current group; False (group destroyed, failures out) on error.

        ``meanwhile()`` runs here once the broadcast is under way (it must not raise)."""
        sync = self.sync
        urls = list(group.urls)
        payload = {
            "names": header["names"],
            "dtypes": header["dtypes"],
            "shapes": header["shapes"],
            "group_name": group.name,
            "flush_cache": False,
            "load_format": FLATTENED,
        }
        path = "/update_weights_from_distributed"
        futures = [sync.threads.submit(sync.pool.call_on, u, "POST", path, payload) for u in urls]
        broken = None
        try:
            self._broadcast(group, flat, urls, futures, meanwhile)
        except Exception as err:  # a member left mid-broadcast (gloo: "closed by peer")
            broken = err
        if broken is None:
            wait(futures)
            failed = {
                u: why for u, f in zip(urls, futures, strict=True) if (why := call_failure(f))
            }
            if not failed:
                return True
            for url, why in failed.items():
                sync.fail(url, f"update_weights_from_distributed: {why}")
            self._destroy_group(group)
            return False
        logger.warning("weight-group broadcast failed (%s); rebuilding the group", broken)
        early = {u: call_failure(f) for u, f in zip(urls, futures, strict=True) if f.done()}
        self._destroy_group(group)  # frees the members still waiting in the broadcast
        wait(futures, timeout=self.config.failure_timeout_s)
        # generation is paused: SGLang's /health would wait on the pause (503 after 20 s)
        healthy = set(sync.pool.alive_all(urls))
        for url in urls:
            if url not in healthy:
                sync.fail(url, f"broadcast failed ({broken}) and /model_info fails")
            elif early.get(url):
                sync.fail(url, f"update_weights_from_distributed: {early[url]}")
        if set(urls) <= set(sync.urls):
            raise WeightSyncError(
                f"weight-group broadcast failed but every member is healthy: {broken}"
            ) from broken
        return False

    def _broadcast(self, group: _Group, flat, urls, futures, meanwhile=None) -> None:
        """The bucket's broadcast from the group's rank 0 (here, or the stage's sender), given
        up as soon as a member's call has failed (that member will never receive, and the
        broadcast would wait for it until the group timeout)."""
        if group.sender is None:
            options = torch.distributed.BroadcastOptions()
            options.rootRank = 0
            work = group.local.broadcast([flat], options)
            done = work.is_completed
        else:
            answer = group.sender.start_broadcast()
            done = answer.done
        if meanwhile is not None:
            meanwhile()
        while not done():
            for url, future in zip(urls, futures, strict=True):
                if future.done() and (why := call_failure(future)) is not None:
                    raise RuntimeError(f"{url} failed during the broadcast: {why}")
            time.sleep(0.002)
        if group.sender is None:
            work.wait()
        elif (why := answer.result()) is not None:
            group.sender._pending = None
            raise RuntimeError(f"stage {group.stage}'s broadcast failed: {why}")
        else:
            group.sender._pending = None

    def _init_group(self, group: _Group) -> None:
        """Create ``group`` under a fresh name over the live servers: they join as ranks
        ``1..``, the stage's sender is 0. On any failure both sides' halves are destroyed
        before the error propagates."""
        cfg, sync = self.config, self.sync
        urls = sync.urls
        store = None
        if group.sender is None:  # the store listens before its port goes out (no port race)
            store = host_store(cfg.master_address, cfg.master_port, cfg.group_timeout_s)
            address, port = cfg.master_address, store.port
        else:
            address, port = group.sender.endpoint()
        world = 1 + cfg.engine_ranks * len(urls)
        prefix = cfg.group_name if group.stage == 0 else f"{cfg.group_name}-stage{group.stage}"
        name = unique_group_name(prefix, self._run_id)
        payloads = [
            {
                "master_address": address,
                "master_port": port,
                "rank_offset": 1 + i * cfg.engine_ranks,
                "world_size": world,
                "group_name": name,
                "backend": cfg.backend,
            }
            for i in range(len(urls))
        ]
        group.name, group.urls = name, urls
        path = "/init_weights_update_group"
        futures = [
            sync.threads.submit(sync.pool.call_on, u, "POST", path, p)
            for u, p in zip(urls, payloads, strict=True)
        ]
        try:
            if group.sender is None:
                group.local = init_weight_group(
                    backend=cfg.backend,
                    master_address=address,
                    master_port=port,
                    rank=0,
                    world_size=world,
                    group_name=name,
                    timeout_s=cfg.group_timeout_s,
                    store=store,
                )
            else:
                group.sender.join(name, address, port, world)
            wait(futures)
            for url, future in zip(urls, futures, strict=True):
                why = call_failure(future)
                if why is not None:
                    raise WeightSyncError(f"init_weights_update_group failed on {url}: {why}")
        except BaseException:
            # Let the servers finish joining (briefly) so the destroy finds their halves.
            concurrent.futures.wait(futures, timeout=min(30.0, cfg.group_timeout_s))
            self._destroy_group(group)
            raise
        logger.info(
            "weight-update group %r (stage %d): %d ranks over %s from %s:%d",
            name,
            group.stage,
            world,
            cfg.backend,
            address,
            port,
        )

    def _destroy_group(self, group: _Group) -> None:
        """Destroy ``group`` on its servers, then its sender's half, waiting at most
        ``failure_timeout_s`` for the servers; failures are only logged."""
        sync = self.sync
        name, urls, local = group.name, group.urls, group.local
        group.name, group.urls, group.local = None, (), None
        if name is None:
            return
        timeout = self.config.failure_timeout_s
        path = "/destroy_weights_update_group"
        futures = [
            sync.threads.submit(
                sync.pool.call_on, u, "POST", path, {"group_name": name}, timeout_s=timeout
            )
            for u in urls
        ]
        # the servers' halves first: that ends a broadcast still pending at the sender
        wait(futures, timeout=timeout + sync.pool.config.connect_timeout_s)
        if group.sender is None:
            destroy_weight_group(local)
        else:
            group.sender.destroy(timeout_s=self.config.group_timeout_s)
        for url, future in zip(urls, futures, strict=True):
            why = call_failure(future) if future.done() else f"no answer within {timeout} s"
            if why is not None:
                logger.warning("destroy_weights_update_group %r on %s: %s", name, url, why)

    def close(self) -> None:
        """Destroy every stage's group. A remote stage's sender is reached only inside a sync
        (it answers rank 0 only then): its half goes with its process."""
        self.staging.clear()
        for group in self.groups.values():
            if group.sender is None:
                self._destroy_group(group)
            elif group.name is not None:
                self._destroy_servers_half(group)

    def _destroy_servers_half(self, group: _Group) -> None:
        sync, timeout = self.sync, self.config.failure_timeout_s
        futures = [
            sync.threads.submit(
                sync.pool.call_on,
                u,
                "POST",
                "/destroy_weights_update_group",
                {"group_name": group.name},
                timeout_s=timeout,
            )
            for u in group.urls
        ]
        wait(futures, timeout=timeout + sync.pool.config.connect_timeout_s)
        group.name, group.urls = None, ()


def _header(slots) -> dict:
    """A bucket's announcement: its tensors' names, SGLang dtype names and shapes."""
    return {
        "names": [s.name for s in slots],
        "dtypes": [dtype_name(s.dtype) for s in slots],
        "shapes": [list(s.shape) for s in slots],
    }
