"""Push trainer weights to SGLang servers: three transports, bucketed, versioned, checked.

One sync (`sync_weights`) on the trainer's global rank 0, fed by
`megatron_rl.model.conversion.iter_hf_tensors` (collective: the other ranks iterate it too and
drop the tensors):

1. ``/pause_generation`` and ``/flush_cache`` on every server;
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
3. ``/update_weight_version`` to ``version`` once every bucket loaded, then each server's
   ``weight_version`` (``/model_info``) must equal it, and optionally per-tensor checksums;
4. ``/continue_generation``, whatever happened.

Server membership (see `WeightSync`): a server that dies or fails any step leaves the sync and
is dropped from the pool; the others go on. A dropped server that is healthy again takes part
in the next sync and rejoins the pool only once it has it all. ``distributed``: the group is
destroyed at once and rebuilt without the failed member, within ``failure_timeout_s``.
`WeightSyncError` only when fewer than ``min_servers`` servers are left.

A failure raises `WeightSyncError` before step 3 moves the version, so servers keep reporting
the old version. Caveat on real SGLang: buckets already loaded stay loaded, so the weights are
a mix until a retried sync succeeds; the trainer must not generate from a server whose sync
failed (the version check on samples catches it).
"""

from __future__ import annotations

import base64
import concurrent.futures
import contextlib
import dataclasses
import io
import json
import logging
import os
import shutil
import socket
import sys
import time
import types
import uuid
from collections.abc import Iterable
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from megatron_rl.rollout import flat_bucket
from megatron_rl.rollout.flat_bucket import FLATTENED, flat_buckets
from megatron_rl.rollout.hf_weights import checksums
from megatron_rl.rollout.http_pool import ServerError
from megatron_rl.rollout.update_session import TRANSPORTS_NEEDING_SESSION, UpdateSessions
from megatron_rl.rollout.weight_group import (
    destroy_weight_group,
    dtype_name,
    init_weight_group,
    unique_group_name,
)

logger = logging.getLogger(__name__)

TRANSPORTS = ("distributed", "tensor", "disk")
FIRST_BUCKET_BYTES = 8 * 1024**2  # `distributed`: a small first bucket starts the pipeline


class WeightSyncError(RuntimeError):
    """A sync failed; the servers still report the previous weight version."""


@dataclasses.dataclass(kw_only=True, slots=True)
class WeightSyncConfig:
    """How `sync_weights` pushes weights.

    ``engine_ranks``: ranks (TP size) of each server; one group rank each for ``distributed``,
    one serialised handle each for ``tensor``. ``master_port = 0`` picks a free port.
    ``bucket_bytes`` also bounds the staging buffer this side holds (a larger tensor gets a
    buffer of its own size).
    ``checksum``: per-tensor checksums read back over ``/weights_checksum``, which only the
    loopback server has (SGLang answers 404; the sync then fails with a WeightSyncError).
    ``failure_timeout_s``: how long control calls (pause, version, destroy) and a failing
    group's members may take before the server is given up on (no 120 s hang on a dead member).
    ``group_name``: prefix of the weight-update group's name; every group creation gets its own
    name (`unique_group_name`), so a restarted trainer never collides with a group that a crashed
    run left on the servers.
    """

    transport: str = "distributed"
    bucket_bytes: int = 512 * 1024**2
    disk_dir: str | None = None
    master_address: str = "127.0.0.1"
    master_port: int = 0
    backend: str = "gloo"
    group_name: str = "megatron_rl_weights"
    engine_ranks: int = 1
    checksum: bool = False
    checksum_rtol: float = 1e-6
    group_timeout_s: float = 300.0
    failure_timeout_s: float = 30.0

    def __post_init__(self) -> None:
        if self.transport not in TRANSPORTS:
            raise ValueError(
                f"WeightSyncConfig.transport={self.transport!r}: choose one of {TRANSPORTS}"
            )
        if not isinstance(self.bucket_bytes, int) or self.bucket_bytes < 1:
            raise ValueError(f"WeightSyncConfig.bucket_bytes={self.bucket_bytes!r}: must be >= 1")
        if self.transport == "disk" and not self.disk_dir:
            raise ValueError(
                "WeightSyncConfig.disk_dir=None: the disk transport needs a folder every server "
                "can read"
            )
        if not self.failure_timeout_s > 0:
            raise ValueError(
                f"WeightSyncConfig.failure_timeout_s={self.failure_timeout_s!r}: must be > 0"
            )
        if self.backend not in ("gloo", "nccl"):
            raise ValueError(f"WeightSyncConfig.backend={self.backend!r}: 'gloo' or 'nccl'")


@dataclasses.dataclass(kw_only=True, slots=True)
class SyncReport:
    version: int
    num_tensors: int = 0
    num_bytes: int = 0
    num_buckets: int = 0
    seconds: float = 0.0
    checksums_compared: int = 0
    servers_up: int = 0  # pool members after the sync
    servers_dropped: int = 0  # servers dropped by syncs so far
    servers_rejoined: int = 0  # dropped servers admitted again after a full sync so far

    @property
    def mb_per_s(self) -> float:
        return self.num_bytes / 1e6 / max(self.seconds, 1e-9)


class WeightSync:
    """Trainer side of weight sync to the servers behind ``pool`` (an `HttpPool`).

    Membership: every sync goes to the pool's members plus the dropped servers that answer
    ``/health`` again. A server that fails any step (dead, HTTP error, wrong version, checksum)
    leaves this sync and, once the sync succeeded on the others, is dropped from the pool
    (`HttpPool.drop`: no generation, no later sync until it is healthy again); a dropped server
    that received the whole sync is admitted back (`HttpPool.admit`), so it never serves stale
    weights. The sync fails with `WeightSyncError` only when fewer than ``min_servers`` servers
    are left in it (or on a failure of the trainer's own side); membership then stays as it was.
    """

    def __init__(self, pool, config: WeightSyncConfig, hf_config=None, *, min_servers: int = 1):
        if not isinstance(min_servers, int) or min_servers < 1:
            raise ValueError(f"min_servers={min_servers!r}: must be an int >= 1")
        self.pool = pool
        self.config = config
        self.hf_config = hf_config
        self.min_servers = min_servers
        self.sessions = UpdateSessions(pool, timeout_s=config.failure_timeout_s)
        self.group = None
        self.group_name: str | None = None  # the live group's unique name
        self._group_urls: tuple[str, ...] = ()  # the servers in the live group, in rank order
        self._run_id = uuid.uuid4().hex[:12]
        self._threads = ThreadPoolExecutor(max_workers=max(1, 2 * len(pool.config.urls)))
        self._live: list[str] = list(pool.members())  # the servers in the sync under way
        self._failed: dict[str, str] = {}  # url -> why, in the sync under way
        self._version = 0
        # uint8 staging buffers, reused across buckets and syncs (two: one packs while the
        # other is on the wire)
        self._staging: list[torch.Tensor | None] = [None, None]
        self._written: list[str] = []  # weight folders of the disk transport, oldest first
        self._pruning: concurrent.futures.Future | None = None
        self.dropped_total = 0  # servers dropped by syncs so far (a metric)
        self.rejoined_total = 0  # dropped servers admitted again after a full sync

    @property
    def urls(self) -> tuple[str, ...]:
        """The servers taking part in the current (or last) sync."""
        return tuple(self._live)

    def _fail(self, url: str, why: str) -> None:
        if url in self._live:
            self._live.remove(url)
        self._failed.setdefault(url, why)
        logger.warning("weight sync v%s: %s leaves the sync: %s", self._version, url, why)

    def _require(self) -> None:
        if len(self._live) >= self.min_servers:
            return
        reasons = "; ".join(f"{u}: {why}" for u, why in self._failed.items())
        raise WeightSyncError(
            f"weight sync to version {self._version} over {self.config.transport!r} failed: "
            f"{len(self._live)} of {len(self.pool.config.urls)} servers left, fewer than "
            f"min_servers={self.min_servers}" + (f" ({reasons})" if reasons else "")
        )

    def _phase(self, path: str, payloads, what: str, *, timeout_s: float | None = None) -> None:
        """POST ``payloads[i]`` (or one payload) to every live server at once; a server that
        fails leaves the sync; WeightSyncError when too few are left."""
        urls = list(self._live)
        if isinstance(payloads, dict):
            payloads = [payloads] * len(urls)
        futures = [
            self._threads.submit(self.pool.call_on, url, "POST", path, payload, timeout_s=timeout_s)
            for url, payload in zip(urls, payloads, strict=True)
        ]
        self._collect(urls, futures, what)

    def versions(self) -> dict[str, object]:
        return {u: self.pool.model_info(u).get("weight_version") for u in self.pool.members()}

    def _begin_sessions(self) -> list[str]:
        """``/begin_weight_update`` on every live server (transports that need a session;
        see `update_session`); the servers with a session open. A refusal fails that server."""
        if self.config.transport not in TRANSPORTS_NEEDING_SESSION:
            return []
        urls = list(self._live)
        futures = [self._threads.submit(self.sessions.begin, u) for u in urls]
        self._collect(urls, futures, "begin_weight_update")
        return [u for u, f in zip(urls, futures, strict=True) if u in self._live and f.result()]

    def _end_sessions(self, opened: list[str]) -> None:
        """``/end_weight_update`` on every server a session was opened on, whatever happened
        (a session left open would refuse the next sync's begin). A live server whose end
        fails leaves the sync, unless the transfer already failed (then only logged)."""
        failing = sys.exc_info()[1] is not None
        futures = [self._threads.submit(self.sessions.end, u) for u in opened]
        wait(futures, timeout=self.config.failure_timeout_s + self.pool.config.connect_timeout_s)
        for url, future in zip(opened, futures, strict=True):
            why = _failure(future) if future.done() else "no answer"
            if why is None:
                continue
            if failing or url not in self._live:
                logger.warning("end_weight_update on %s failed: %s", url, why)
            else:
                self._fail(url, f"end_weight_update: {why}")
        if not failing:
            self._require()

    def sync(self, named_tensors: Iterable[tuple[str, torch.Tensor]], version: int) -> SyncReport:
        report = SyncReport(version=version)
        start = time.perf_counter()
        sums: dict[str, float] = {}
        stream = self._account(named_tensors, report, sums if self.config.checksum else None)
        members = self.pool.members()
        dropped = list(self.pool.dropped())
        rejoining = self.pool.probe_all(dropped) if dropped else []  # healthy again: full sync
        self._version = version
        self._live = [u for u in self.pool.config.urls if u in members or u in rejoining]
        self._failed = {}
        paused = list(self._live)
        control = self.config.failure_timeout_s
        try:
            self._require()
            self._phase("/pause_generation", {}, "pause_generation", timeout_s=control)
            # waits for idle and retries SGLang's 400 (`HttpPool.flush_cache`)
            self._each(self.pool.flush_cache, "flush_cache")
            push = {"distributed": self._distributed, "tensor": self._tensor, "disk": self._disk}
            opened = self._begin_sessions()
            try:
                push[self.config.transport](stream, report, version)
            finally:
                self._end_sessions(opened)
            self._phase(
                "/update_weight_version",
                {"new_version": str(version)},
                "update_weight_version",
                timeout_s=control,
            )
            self._verify(version, sums, report)
        except WeightSyncError:
            raise
        except Exception as err:
            raise WeightSyncError(
                f"weight sync to version {version} over {self.config.transport!r} failed: "
                f"{type(err).__name__}: {err}"
            ) from err
        finally:
            futures = [
                self._threads.submit(
                    self.pool.call_on, u, "POST", "/continue_generation", {}, timeout_s=control
                )
                for u in paused
            ]
            wait(futures, timeout=control + self.pool.config.connect_timeout_s)
            for url, future in zip(paused, futures, strict=True):
                why = _failure(future) if future.done() else "no answer"
                if why is not None and url not in self._failed:
                    logger.error("continue_generation failed on %s: %s", url, why)
        for url, why in self._failed.items():
            if url in members and self.pool.drop(url, f"weight sync v{version}: {why}"):
                self.dropped_total += 1
        for url in rejoining:
            if url in self._live and self.pool.admit(url):
                self.rejoined_total += 1
        report.servers_up = len(self.pool.members())
        report.servers_dropped = self.dropped_total
        report.servers_rejoined = self.rejoined_total
        report.seconds = time.perf_counter() - start
        logger.info(
            "weight sync v%d: %d tensors, %.1f MB, %d buckets, %.1f MB/s, %d/%d servers",
            version,
            report.num_tensors,
            report.num_bytes / 1e6,
            report.num_buckets,
            report.mb_per_s,
            report.servers_up,
            len(self.pool.config.urls),
        )
        return report

    def _each(self, fn, what: str) -> None:
        """``fn(url)`` on every live server at once; failures leave the sync."""
        urls = list(self._live)
        futures = [self._threads.submit(fn, u) for u in urls]
        self._collect(urls, futures, what)

    def _collect(self, urls, futures, what: str) -> None:
        """Wait for one call per server; a failed one takes its server out of the sync."""
        wait(futures)
        for url, future in zip(urls, futures, strict=True):
            why = _failure(future)
            if why is not None:
                self._fail(url, f"{what}: {why}")
        self._require()

    def _account(self, named_tensors, report: SyncReport, sums: dict | None):
        for name, tensor in named_tensors:
            report.num_tensors += 1
            report.num_bytes += tensor.numel() * tensor.element_size()
            if sums is not None:
                sums.update(checksums([(name, tensor)]))
            yield name, tensor

    def _verify(self, version: int, sums: dict[str, float], report: SyncReport) -> None:
        for url in list(self._live):
            try:
                info = self.pool.model_info(url, timeout_s=self.config.failure_timeout_s)
            except RuntimeError as err:
                self._fail(url, f"model_info: {err}")
                continue
            got = info.get("weight_version")
            if str(got) != str(version):
                self._fail(url, f"after sync to version {version} the server reports {got!r}")
        self._require()
        if not sums:
            return
        for url in list(self._live):
            try:
                got = self.pool.call_on(url, "POST", "/weights_checksum", {"names": list(sums)})
            except ServerError as err:
                if "HTTP 404" not in str(err):
                    self._fail(url, f"weights_checksum: {err}")
                    continue
                raise WeightSyncError(
                    f"WeightSyncConfig.checksum=True, but {url} has no /weights_checksum: only the "
                    "loopback server serves it. SGLang has no checksum endpoint (its "
                    "/get_weights_by_name returns the first values of one parameter under "
                    "SGLang's own names and is not implemented for Qwen3-MoE); set checksum=False "
                    "and rely on the weight_version check"
                ) from err
            except RuntimeError as err:
                self._fail(url, f"weights_checksum: {err}")
                continue
            for name, want in sums.items():
                if abs(got[name] - want) > self.config.checksum_rtol * max(1.0, abs(want)):
                    self._fail(
                        url,
                        f"checksum of {name!r} on {url} is {got[name]!r}, trainer sent {want!r}",
                    )
                    break
                report.checksums_compared += 1
        self._require()

    # ------------------------------------------------------------------ transports
    def _distributed(self, stream, report: SyncReport, version: int) -> None:
        """Per bucket: announce it to every live server and broadcast it over the group.

        When a member fails (its call fails or the broadcast breaks), the group is destroyed at
        once (which also frees the members stuck in the broadcast), the failed members leave
        the sync, and the same bucket is sent again over a group rebuilt from the survivors
        (buckets already loaded stay loaded; loading is idempotent).

        Double-buffered: the next bucket is packed and checked while this one is on the wire
        and being loaded (two staging buffers of at most ``bucket_bytes``); the first bucket
        is at most `FIRST_BUCKET_BYTES`, since its packing overlaps nothing.
        """
        del version
        cfg = self.config
        device = _current_cuda() if cfg.backend == "nccl" else torch.device("cpu")
        first = min(cfg.bucket_bytes, FIRST_BUCKET_BYTES)
        buckets = iter(flat_buckets(stream, cfg.bucket_bytes, first_bucket_bytes=first))
        try:
            staged, index = self._stage_next(buckets, device, 0), 0
            while staged is not None:
                report.num_buckets += 1
                ahead: dict = {}

                def prefetch(index=index, ahead=ahead):
                    try:
                        ahead["staged"] = self._stage_next(buckets, device, 1 - index)
                    except BaseException as err:  # raised once this bucket is through
                        ahead["error"] = err

                for _ in range(len(self.pool.config.urls) + 1):
                    self._require()
                    if self.group is None or self._group_urls != tuple(self._live):
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

    def _stage_next(self, buckets, device: torch.device, index: int):
        bucket = next(buckets, None)
        return None if bucket is None else self._stage(bucket, device, index=index)

    def _stage(self, bucket, device: torch.device, *, index: int = 0, shared: bool = False):
        """Pack ``bucket`` into staging buffer ``index`` (grown when too small; ``shared``: a
        shared-memory file on CPU) and check it for NaN/Inf; (flat bucket, slots)."""
        slots = flat_bucket.bucket_slots(bucket)
        need = slots[-1].end
        staging = self._staging[index]
        if staging is None or staging.numel() < need or staging.device != device:
            self._staging[index] = None
            if shared and device.type == "cpu":
                staging = torch.empty(0, dtype=torch.uint8).set_(new_shared_storage(need))
            else:
                staging = torch.empty(need, dtype=torch.uint8, device=device)
            if need <= self.config.bucket_bytes:  # a one-off larger buffer is not kept
                self._staging[index] = staging
        flat = staging[:need]
        flat_bucket.pack(bucket, flat)
        bad = flat_bucket.first_nonfinite(flat, slots)
        if bad is not None:
            raise WeightSyncError(
                f"weight sync to version {self._version}: tensor {bad!r} holds NaN or Inf; "
                "nothing after the previous bucket was sent and the version is unchanged"
            )
        return flat, slots

    def _send_bucket(self, flat: torch.Tensor, slots, *, meanwhile=None) -> bool:
        """One bucket over the current group; False (group destroyed, failures out) on error.

        ``meanwhile()`` runs here once the broadcast is under way (it must not raise)."""
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
        futures = [self._threads.submit(self.pool.call_on, u, "POST", path, payload) for u in urls]
        broken = None
        try:
            self._broadcast(flat, urls, futures, meanwhile)
        except Exception as err:  # a member left mid-broadcast (gloo: "closed by peer")
            broken = err
        if broken is None:
            wait(futures)
            failed = {u: why for u, f in zip(urls, futures, strict=True) if (why := _failure(f))}
            if not failed:
                return True
            for url, why in failed.items():
                self._fail(url, f"update_weights_from_distributed: {why}")
            self._destroy_group()
            return False
        logger.warning("weight-group broadcast failed (%s); rebuilding the group", broken)
        early = {u: _failure(f) for u, f in zip(urls, futures, strict=True) if f.done()}
        self._destroy_group()  # frees the members still waiting in the broadcast
        wait(futures, timeout=self.config.failure_timeout_s)
        # generation is paused: SGLang's /health would wait on the pause (503 after 20 s)
        healthy = set(self.pool.alive_all(urls))
        for url in urls:
            if url not in healthy:
                self._fail(url, f"broadcast failed ({broken}) and /model_info fails")
            elif early.get(url):
                self._fail(url, f"update_weights_from_distributed: {early[url]}")
        if set(urls) <= set(self._live):
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
                if future.done() and (why := _failure(future)) is not None:
                    raise RuntimeError(f"{url} failed during the broadcast: {why}")
            time.sleep(0.002)
        work.wait()

    def _init_group(self) -> None:
        """Create a group under a fresh name over the live servers: they join as ranks ``1..``,
        this side is 0. On any failure both sides' halves are destroyed before the error
        propagates."""
        cfg = self.config
        urls = tuple(self._live)
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
            self._threads.submit(self.pool.call_on, u, "POST", path, p)
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
                why = _failure(future)
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
        name, group, urls = self.group_name, self.group, self._group_urls
        self.group, self.group_name, self._group_urls = None, None, ()
        if name is None:
            return
        timeout = self.config.failure_timeout_s
        path = "/destroy_weights_update_group"
        futures = [
            self._threads.submit(
                self.pool.call_on, u, "POST", path, {"group_name": name}, timeout_s=timeout
            )
            for u in urls
        ]
        # the servers' halves first: that ends a broadcast still pending here
        wait(futures, timeout=timeout + self.pool.config.connect_timeout_s)
        destroy_weight_group(group)
        for url, future in zip(urls, futures, strict=True):
            why = _failure(future) if future.done() else f"no answer within {timeout} s"
            if why is not None:
                logger.warning("destroy_weights_update_group %r on %s: %s", name, url, why)

    def _tensor(self, stream, report: SyncReport, version: int) -> None:
        """``/update_weights_from_tensor`` per bucket with ``load_format="flattened_bucket"``.

        The payload is SGLang's own ``MultiprocessingSerializer.serialize(obj, output_str=True)``
        format (``ForkingPickler`` + base64) of ``{"flattened_tensor": flat, "metadata": [...]}``
        (what ``_update_weights_from_flattened_bucket`` reads; metadata entries are
        ``SimpleNamespace`` with ``FlattenedTensorMetadata``'s fields, which SGLang's
        ``SafeUnpickler`` admits). The tensor itself never travels: on GPU it is a CUDA IPC
        handle (after SGLang's ``monkey_patch_torch_reductions``, GPUs named by UUID), on CPU
        the name of the shared-memory file holding the staging buffer. SGLang's
        ``serialized_named_tensors`` holds one entry per TP rank and each rank deserialises only
        its own (``tp_worker.deserialize_own_rank``): every entry is its own serialisation,
        because each carries its own producer-side reference count. A GPU bucket is a fresh
        buffer (as SGLang's producer makes it); the buffer stays referenced until every server's
        call has returned. On CPU the one shared buffer is reused: servers copy on load.
        """
        del version
        cfg = self.config
        on_gpu = torch.cuda.is_available()
        device = _current_cuda() if on_gpu else torch.device("cpu")
        serialize = _sglang_serialize() if on_gpu else _serialize_shared
        for bucket in flat_buckets(stream, cfg.bucket_bytes):
            report.num_buckets += 1
            if on_gpu:
                self._staging[0] = None  # one buffer per bucket under CUDA IPC
            flat, slots = self._stage(bucket, device, shared=True)
            obj = {"flattened_tensor": flat, "metadata": [_metadata(s) for s in slots]}
            payloads = [
                {
                    "serialized_named_tensors": [serialize(obj) for _ in range(cfg.engine_ranks)],
                    "load_format": FLATTENED,
                    "flush_cache": False,
                }
                for _ in self._live
            ]
            # waits for every server to finish reading before the buffer may be reused
            try:
                self._phase("/update_weights_from_tensor", payloads, "update_weights_from_tensor")
            finally:
                self._check_device_seen()
            del obj, payloads, flat
        if on_gpu:
            self._staging[0] = None

    def _check_device_seen(self) -> None:
        """WeightSyncError naming the fix when a server could not open the tensor handle
        (SGLang's ``srt/utils/patch_torch.py`` raises "Invalid device_uuid" when the handle
        names a GPU that is not among the server's visible devices)."""
        unseen = [u for u, why in self._failed.items() if "Invalid device_uuid" in why]
        if unseen:
            raise WeightSyncError(
                f"--weight-sync-transport tensor: {unseen} cannot see this rank's GPU "
                f"({self._failed[unseen[0]]}); the tensor transport needs servers on the "
                "trainer's own GPUs. Use --weight-sync-transport distributed"
            )

    def _disk(self, stream, report: SyncReport, version: int) -> None:
        """Safetensors shards in ``weights-v{version}`` (written under a temporary name, then
        renamed). Folders this sync wrote before are removed except the newest, which the
        servers run on and SGLang reloads if this update fails: at most two versions on disk.
        """
        from megatron_rl.atomic_io import atomic_write_text
        from megatron_rl.model.conversion.safetensors_io import write_checkpoint

        root = os.fspath(self.config.disk_dir)
        final = os.path.join(root, f"weights-v{version}")
        if self._pruning is not None:
            self._pruning.result()
        # freeing hundreds of MB takes a while: done beside this sync
        stale, self._written = self._written[:-1], [w for w in self._written[-1:] if w != final]
        self._pruning = self._threads.submit(_remove_folders, stale)
        tmp = os.path.join(root, f".weights-v{version}.tmp")
        shutil.rmtree(tmp, ignore_errors=True)
        try:
            files = write_checkpoint(
                self._finite(stream), tmp, max_shard_bytes=self.config.bucket_bytes
            )
        except BaseException:
            shutil.rmtree(tmp, ignore_errors=True)
            raise
        report.num_buckets = sum(f.endswith(".safetensors") for f in files)
        if self.hf_config is not None:
            config = {**self.hf_config.to_dict(), "architectures": ["Qwen3MoeForCausalLM"]}
            atomic_write_text(os.path.join(tmp, "config.json"), json.dumps(config, indent=2))
        shutil.rmtree(final, ignore_errors=True)
        os.replace(tmp, final)
        self._written.append(final)
        payload = {"model_path": final, "load_format": "auto"}
        self._phase("/update_weights_from_disk", payload, "update_weights_from_disk")

    def _finite(self, stream):
        """``stream``, failing on the first tensor holding NaN or Inf (one aminmax each)."""
        for name, tensor in stream:
            if flat_bucket.nonfinite_name([(name, tensor)]) is not None:
                raise WeightSyncError(
                    f"weight sync to version {self._version}: tensor {name!r} holds NaN or Inf; "
                    "the version is unchanged"
                )
            yield name, tensor

    def close(self) -> None:
        self._staging = [None, None]
        if self._pruning is not None:
            self._pruning.result()
        self._destroy_group()
        self._threads.shutdown(wait=False)


def _failure(future) -> str | None:
    """Why a finished control call failed (its error, or ``success: false``), else None."""
    error = future.exception()
    if error is not None:
        return f"{type(error).__name__}: {error}"
    answer = future.result()
    if isinstance(answer, dict) and answer.get("success") is False:
        return f"success=false: {answer.get('message')}"
    return None


def _remove_folders(folders: list[str]) -> None:
    for folder in folders:
        shutil.rmtree(folder, ignore_errors=True)


def _current_cuda() -> torch.device:
    return torch.device("cuda", torch.cuda.current_device())


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


@contextlib.contextmanager
def _file_system_sharing():
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


SHM_MANAGER_TIMEOUT = "Shared memory manager connection has timed out"
SHM_ATTEMPTS = 3


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
            with _file_system_sharing():
                return torch.UntypedStorage._new_shared(nbytes)
        except RuntimeError as error:
            if SHM_MANAGER_TIMEOUT not in str(error) or attempt == SHM_ATTEMPTS - 1:
                raise
            logger.warning("torch's shared-memory manager timed out; retrying (%s)", attempt + 1)
            time.sleep(pause_s * 2**attempt)
    raise AssertionError("unreachable")  # pragma: no cover


def _serialize_shared(obj) -> str:
    """SGLang's ``MultiprocessingSerializer.serialize(obj, output_str=True)`` on CPU:
    ``ForkingPickler`` (shared storages by file name) then base64."""
    from multiprocessing.reduction import ForkingPickler

    buffer = io.BytesIO()
    with _file_system_sharing():
        ForkingPickler(buffer).dump(obj)
    return base64.b64encode(buffer.getvalue()).decode()


def _sglang_serialize():
    """SGLang's serializer, after SGLang's own patch of torch's CUDA-IPC reductions."""
    from sglang.srt.utils import MultiprocessingSerializer  # pragma: no cover - needs sglang
    from sglang.srt.utils.patch_torch import monkey_patch_torch_reductions

    monkey_patch_torch_reductions()  # idempotent
    return lambda obj: MultiprocessingSerializer.serialize(obj, output_str=True)


def _free_port(address: str) -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind((address, 0))
        return sock.getsockname()[1]
