"""The ``distributed`` transport: rank 0 broadcasts each flat bucket over a weight-update group
that the servers join (``/init_weights_update_group``; NCCL on GPU, gloo on CPU), while each
server loads it (``/update_weights_from_distributed`` with ``load_format="flattened_bucket"``)."""

from __future__ import annotations

import concurrent.futures
import logging
import socket
import time
import uuid
from concurrent.futures import wait
from typing import TYPE_CHECKING

import torch

from megatron_rl.rollout.flat_bucket import FLATTENED, flat_buckets
from megatron_rl.rollout.weight_group import (
    destroy_weight_group,
    dtype_name,
    init_weight_group,
    unique_group_name,
)
from megatron_rl.rollout.weight_sync.common import (
    SyncReport,
    WeightSyncConfig,
    WeightSyncError,
    call_failure,
)
from megatron_rl.rollout.weight_sync.staging import Staging, current_cuda

if TYPE_CHECKING:
    from megatron_rl.rollout.weight_sync.sync import WeightSync

logger = logging.getLogger(__name__)

FIRST_BUCKET_BYTES = 8 * 1024**2  # a small first bucket starts the pipeline


class DistributedTransport:
    """The weight-update group (rebuilt without a member that fails) and the buckets sent over
    it, for the servers of ``sync`` (a `WeightSync`)."""

    def __init__(self, sync: WeightSync):
        self.sync = sync
        self.staging = Staging(sync.config, num_buffers=2)
        self.group = None
        self.group_name: str | None = None  # the live group's unique name
        self._group_urls: tuple[str, ...] = ()  # the servers in the live group, in rank order
        self._run_id = uuid.uuid4().hex[:12]

    @property
    def config(self) -> WeightSyncConfig:
        return self.sync.config

    def push(self, stream, report: SyncReport, version: int) -> None:
        """Per bucket: announce it to every live server and broadcast it over the group.

        When a member fails (its call fails or the broadcast breaks), the group is destroyed at
        once (which also frees the members stuck in the broadcast), the failed members leave
        the sync, and the same bucket is sent again over a group rebuilt from the survivors
        (buckets already loaded stay loaded; loading is idempotent).

        Double-buffered: the next bucket is packed and checked while this one is on the wire
        and being loaded (two staging buffers of at most ``bucket_bytes``); the first bucket
        is at most `FIRST_BUCKET_BYTES`, since its packing overlaps nothing.
        """
        cfg, sync = self.config, self.sync
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
                report.num_buckets += 1
                ahead: dict = {}

                def prefetch(index=index, ahead=ahead):
                    try:
                        ahead["staged"] = stage_next(1 - index)
                    except BaseException as err:  # raised once this bucket is through
                        ahead["error"] = err

                for _ in range(len(sync.pool.config.urls) + 1):
                    sync.require()
                    if self.group is None or self._group_urls != sync.urls:
                        self._destroy_group()
                        self._init_group()
                    if self._send_bucket(*staged, meanwhile=None if ahead else prefetch):
                        break
                else:  # pragma: no cover - every retry drops at least one server
                    raise WeightSyncError("a bucket failed on every rebuilt weight group")
                if not ahead:
                    prefetch()
                if "error" in ahead:
                    raise ahead["error"]
                staged, index = ahead["staged"], 1 - index
        except BaseException:
            # Ranks may be mid-broadcast: the group cannot be trusted any more. The next sync
            # builds a fresh one under a new name.
            self._destroy_group()
            raise

    def _send_bucket(self, flat: torch.Tensor, slots, *, meanwhile=None) -> bool:
        """One bucket over the current group; False (group destroyed, failures out) on error.

        ``meanwhile()`` runs here once the broadcast is under way (it must not raise)."""
        sync = self.sync
        urls = list(self._group_urls)
        payload = {
            "names": [s.name for s in slots],
            "dtypes": [dtype_name(s.dtype) for s in slots],
            "shapes": [list(s.shape) for s in slots],
            "group_name": self.group_name,
            "flush_cache": False,
            "load_format": FLATTENED,
        }
        path = "/update_weights_from_distributed"
        futures = [sync.threads.submit(sync.pool.call_on, u, "POST", path, payload) for u in urls]
        broken = None
        try:
            self._broadcast(flat, urls, futures, meanwhile)
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
            self._destroy_group()
            return False
        logger.warning("weight-group broadcast failed (%s); rebuilding the group", broken)
        early = {u: call_failure(f) for u, f in zip(urls, futures, strict=True) if f.done()}
        self._destroy_group()  # frees the members still waiting in the broadcast
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

    def _broadcast(self, tensor: torch.Tensor, urls, futures, meanwhile=None) -> None:
        """`broadcast_tensor`, but given up as soon as a member's call has failed (that member
        will never receive, and the broadcast would wait for it until the group timeout)."""
        options = torch.distributed.BroadcastOptions()
        options.rootRank = 0
        work = self.group.broadcast([tensor], options)
        if meanwhile is not None:
            meanwhile()
        while not work.is_completed():
            for url, future in zip(urls, futures, strict=True):
                if future.done() and (why := call_failure(future)) is not None:
                    raise RuntimeError(f"{url} failed during the broadcast: {why}")
            time.sleep(0.002)
        work.wait()

    def _init_group(self) -> None:
        """Create a group under a fresh name over the live servers: they join as ranks ``1..``,
        this side is 0. On any failure both sides' halves are destroyed before the error
        propagates."""
        cfg, sync = self.config, self.sync
        urls = sync.urls
        port = cfg.master_port or _free_port(cfg.master_address)
        world = 1 + cfg.engine_ranks * len(urls)
        name = unique_group_name(cfg.group_name, self._run_id)
        payloads = [
            {
                "master_address": cfg.master_address,
                "master_port": port,
                "rank_offset": 1 + i * cfg.engine_ranks,
                "world_size": world,
                "group_name": name,
                "backend": cfg.backend,
            }
            for i in range(len(urls))
        ]
        self.group_name, self._group_urls = name, urls
        path = "/init_weights_update_group"
        futures = [
            sync.threads.submit(sync.pool.call_on, u, "POST", path, p)
            for u, p in zip(urls, payloads, strict=True)
        ]
        try:
            self.group = init_weight_group(
                backend=cfg.backend,
                master_address=cfg.master_address,
                master_port=port,
                rank=0,
                world_size=world,
                group_name=name,
                timeout_s=cfg.group_timeout_s,
            )
            wait(futures)
            for url, future in zip(urls, futures, strict=True):
                why = call_failure(future)
                if why is not None:
                    raise WeightSyncError(f"init_weights_update_group failed on {url}: {why}")
        except BaseException:
            # Let the servers finish joining (briefly) so the destroy finds their halves.
            concurrent.futures.wait(futures, timeout=min(30.0, cfg.group_timeout_s))
            self._destroy_group()
            raise
        logger.info("weight-update group %r: %d ranks over %s", name, world, cfg.backend)

    def _destroy_group(self) -> None:
        """Destroy the current group on its servers and here, waiting at most
        ``failure_timeout_s`` for them; failures are only logged."""
        sync = self.sync
        name, group, urls = self.group_name, self.group, self._group_urls
        self.group, self.group_name, self._group_urls = None, None, ()
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
        # the servers' halves first: that ends a broadcast still pending here
        wait(futures, timeout=timeout + sync.pool.config.connect_timeout_s)
        destroy_weight_group(group)
        for url, future in zip(urls, futures, strict=True):
            why = call_failure(future) if future.done() else f"no answer within {timeout} s"
            if why is not None:
                logger.warning("destroy_weights_update_group %r on %s: %s", name, url, why)

    def close(self) -> None:
        self.staging.clear()
        self._destroy_group()


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
