"""One weight sync to the SGLang servers, whatever the transport: pause (in
``WeightSyncConfig.pause_mode``), flush, the update session, the transport's push, the version
move and its check, continue; and which servers take part (a server that fails leaves the sync
and is dropped from the pool)."""

from __future__ import annotations

import logging
import re
import sys
import time
from collections.abc import Callable, Iterable, Sequence
from concurrent.futures import ThreadPoolExecutor, wait

import torch

from megatron_rl.rollout.hf_weights import checksums
from megatron_rl.rollout.http_pool import ServerError
from megatron_rl.rollout.update_session import TRANSPORTS_NEEDING_SESSION, UpdateSessions
from megatron_rl.rollout.weight_sync.common import (
    SyncReport,
    WeightSyncConfig,
    WeightSyncError,
    call_failure,
    sent_stream,
)
from megatron_rl.rollout.weight_sync.disk import DiskTransport
from megatron_rl.rollout.weight_sync.distributed import DistributedTransport
from megatron_rl.rollout.weight_sync.lora import LoRATransport
from megatron_rl.rollout.weight_sync.rank_handles import STOP, HandleLink
from megatron_rl.rollout.weight_sync.reprobe import ReprobeConfig, Reprober
from megatron_rl.rollout.weight_sync.stages import RemoteStage
from megatron_rl.rollout.weight_sync.tensor import TensorTransport
from megatron_rl.rollout.weight_sync.transport import SyncRound, Transport

logger = logging.getLogger(__name__)

SPANS_RELEASE = (0, 5, 19)  # the first SGLang that reports meta_info.weight_versions

# the one place a transport is chosen: each is built with the sync as its `SyncRound`
TRANSPORT_CLASSES: dict[str, Callable[[SyncRound], Transport]] = {
    "distributed": DistributedTransport,
    "tensor": TensorTransport,
    "disk": DiskTransport,
}


class WeightSync:
    """Trainer side of weight sync to the servers behind ``pool`` (an `HttpPool`).

    Membership: every sync goes to the pool's members plus the dropped servers that answered
    their last background ``/health`` probe (`Reprober`: the sync never waits for a probe, so a
    stalled server costs no step any time). A server that fails any step (dead, HTTP error,
    wrong version, checksum, no answer to a control call within ``failure_timeout_s``) leaves
    this sync and, once the sync succeeded on the others, is dropped from the pool
    (`HttpPool.drop`: no generation, no later sync until a probe answers again); a dropped server
    that received the whole sync is admitted back (`HttpPool.admit`), so it never serves stale
    weights. One warning per change of membership (`_report_membership`), not per sync. The
    sync fails with `WeightSyncError` only when fewer than ``min_servers`` servers are left in
    it (or on a failure of the trainer's own side); membership then stays as it was.

    ``transport`` (chosen by ``config.transport``, `TRANSPORT_CLASSES`) sends the tensors; it
    sees this sync as a `transport.SyncRound` (``urls``, ``phase``, ``fail``, ``require``,
    ``threads``, ...).
    """

    def __init__(
        self,
        pool,
        config: WeightSyncConfig,
        hf_config=None,
        *,
        min_servers: int = 1,
        reprobe: ReprobeConfig | None = None,
    ):
        if not isinstance(min_servers, int) or min_servers < 1:
            raise ValueError(f"min_servers={min_servers!r}: must be an int >= 1")
        self.pool = pool
        self.config = config
        self.hf_config = hf_config
        self.min_servers = min_servers
        self.sessions = UpdateSessions(pool, timeout_s=config.failure_timeout_s)
        self.threads = ThreadPoolExecutor(max_workers=max(1, 2 * len(pool.config.urls)))
        self._live: list[str] = list(pool.members())  # the servers in the sync under way
        self._failed: dict[str, str] = {}  # url -> why, in the sync under way
        self._version = 0
        self.transport: Transport = TRANSPORT_CLASSES[config.transport](self)
        self.adapters: LoRATransport | None = None  # adapter-only syncs (`sync`'s adapter_config)
        self._adapter_sync = False  # the sync under way sends an adapter
        self.dropped_total = 0  # servers dropped by syncs so far (a metric)
        self.rejoined_total = 0  # dropped servers admitted again after a full sync
        self.reprobe = Reprober(pool.probe, reprobe or ReprobeConfig())
        self._reported_out: frozenset[str] = frozenset()  # membership last warned about
        self._stale_prefix_warned: set[str] = set()  # servers that cannot flush when retracted
        self._modes: dict[str, str] = {}  # url -> its pause mode (`pause_mode_for`)

    @property
    def urls(self) -> tuple[str, ...]:
        """The servers taking part in the current (or last) sync."""
        return tuple(self._live)

    @property
    def failures(self) -> dict[str, str]:
        """Why each server left the current (or last) sync."""
        return self._failed

    def fail(self, url: str, why: str) -> None:
        """``url`` leaves the sync under way, for ``why``."""
        if url in self._live:
            self._live.remove(url)
        self._failed.setdefault(url, why)
        logger.warning("weight sync v%s: %s leaves the sync: %s", self._version, url, why)

    def require(self) -> None:
        """WeightSyncError when fewer than ``min_servers`` servers are left in the sync."""
        if len(self._live) >= self.min_servers:
            return
        reasons = "; ".join(f"{u}: {why}" for u, why in self._failed.items())
        raise WeightSyncError(
            f"weight sync to version {self._version} over {self.config.transport!r} failed: "
            f"{len(self._live)} of {len(self.pool.config.urls)} servers left, fewer than "
            f"min_servers={self.min_servers}" + (f" ({reasons})" if reasons else "")
        )

    def phase(self, path: str, payloads, what: str, *, timeout_s: float | None = None) -> None:
        """POST ``payloads[i]`` (or one payload) to every live server at once; a server that
        fails leaves the sync; WeightSyncError when too few are left."""
        urls = list(self._live)
        if isinstance(payloads, dict):
            payloads = [payloads] * len(urls)
        futures = [
            self.threads.submit(self.pool.call_on, url, "POST", path, payload, timeout_s=timeout_s)
            for url, payload in zip(urls, payloads, strict=True)
        ]
        self._collect(urls, futures, what)

    def versions(self) -> dict[str, object]:
        timeout = self.config.failure_timeout_s
        return {
            u: self.pool.model_info(u, timeout_s=timeout).get("weight_version")
            for u in self.pool.members()
        }

    def _begin_sessions(self) -> list[str]:
        """``/begin_weight_update`` on every live server (transports that need a session;
        see `update_session`); the servers with a session open. A refusal fails that server.
        An adapter load changes no weight: no session."""
        if self.config.transport not in TRANSPORTS_NEEDING_SESSION or self._adapter_sync:
            return []
        urls = list(self._live)
        futures = [self.threads.submit(self.sessions.begin, u) for u in urls]
        self._collect(urls, futures, "begin_weight_update")
        return [u for u, f in zip(urls, futures, strict=True) if u in self._live and f.result()]

    def _end_sessions(self, opened: list[str]) -> None:
        """``/end_weight_update`` on every server a session was opened on, whatever happened
        (a session left open would refuse the next sync's begin). A live server whose end
        fails leaves the sync, unless the transfer already failed (then only logged)."""
        failing = sys.exc_info()[1] is not None
        futures = [self.threads.submit(self.sessions.end, u) for u in opened]
        wait(futures, timeout=self.config.failure_timeout_s + self.pool.config.connect_timeout_s)
        for url, future in zip(opened, futures, strict=True):
            why = call_failure(future) if future.done() else "no answer"
            if why is None:
                continue
            if failing or url not in self._live:
                logger.warning("end_weight_update on %s failed: %s", url, why)
            else:
                self.fail(url, f"end_weight_update: {why}")
        if not failing:
            self.require()

    def sync(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        version: int,
        *,
        stages: Sequence[RemoteStage] = (),
        peers: HandleLink | None = None,
        adapter_config: dict | None = None,
    ) -> SyncReport:
        """Push ``named_tensors`` as weight ``version`` (see the package docstring).

        ``adapter_config``: ``named_tensors`` is the policy's LoRA adapter (PEFT names) with this
        PEFT config, loaded as an SGLang adapter (`lora.LoRATransport`), not merged weights.

        ``stages``: with pipeline parallelism and the ``distributed`` transport, the senders of
        stages 1.. (`stages.RemoteStage`); ``named_tensors`` is then stage 0's only, and each
        other stage broadcasts its own over a group of its own. ``peers``: colocated, the
        ``tensor`` transport sends each server the handles of the trainer ranks on its GPUs
        (`rank_handles`). Either way the other ranks are told the sync is over, whatever
        happened.
        """
        try:
            if stages and self.config.transport != "distributed":
                raise ValueError(
                    f"per-stage senders need the 'distributed' transport, not "
                    f"{self.config.transport!r}: send every stage's tensors from rank 0"
                )
            if peers is not None and self.config.transport != "tensor":
                raise ValueError(
                    f"per-rank handles need the 'tensor' transport, not {self.config.transport!r}"
                )
            if adapter_config is not None and (stages or peers is not None):
                raise ValueError("an adapter sync is sent from rank 0 alone (no stages, peers)")
            self._adapter_sync = adapter_config is not None
            if self._adapter_sync:
                if self.adapters is None:
                    self.adapters = LoRATransport(self)
                self.adapters.adapter_config = adapter_config
            return self._sync(named_tensors, version, stages, peers)
        finally:
            for stage in stages:
                stage.end()
            if peers is not None:
                peers.say(STOP)

    def _sync(self, named_tensors, version: int, stages, peers) -> SyncReport:
        report = SyncReport(version=version)
        start = time.perf_counter()
        sums: dict[str, float] = {}
        if not self._adapter_sync:  # adapters go as they are, and leave the checksums unchanged
            named_tensors = sent_stream(named_tensors, self.config)
        checked = self.config.checksum and not self._adapter_sync
        stream = self._account(named_tensors, report, sums if checked else None)
        members = self.pool.members()
        dropped = list(self.pool.dropped())
        for url in dropped:  # idempotent: each dropped server has its background prober
            self.reprobe.watch(url)
        rejoining = [u for u in self.reprobe.ready() if u in dropped]  # answered: a full sync
        self._version = version
        self._live = [u for u in self.pool.config.urls if u in members or u in rejoining]
        self._failed = {}
        paused = list(self._live)
        control = self.config.failure_timeout_s
        try:
            self.require()
            modes = {u: self.pause_mode_for(u) for u in self._live}
            self.phase(
                "/pause_generation",
                [{"mode": modes[u]} for u in self._live],
                "pause_generation",
                timeout_s=control,
            )
            self._each(lambda u: self._flush(u, modes[u]), "flush_cache")
            opened = self._begin_sessions()
            try:
                if stages:
                    remote_sums = sums if self.config.checksum else None
                    self.transport.push(stream, report, version, stages=stages, sums=remote_sums)
                elif peers is not None:
                    self.transport.push(stream, report, version, peers=peers)
                elif self._adapter_sync:
                    self.adapters.push(stream, report, version)
                else:
                    self.transport.push(stream, report, version)
            finally:
                self._end_sessions(opened)
            # SGLang's default (abort_all_requests=True) would end the paused requests
            self.phase(
                "/update_weight_version",
                [
                    {"new_version": str(version), "abort_all_requests": modes[u] == "abort"}
                    for u in self._live
                ],
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
            self._continue(paused, control)
        for url, why in self._failed.items():
            if url in members and self.pool.drop(url, f"weight sync v{version}: {why}"):
                self.dropped_total += 1
                self.reprobe.watch(url)
        for url in rejoining:
            if url in self._live and self.pool.admit(url):
                self.rejoined_total += 1
                self.reprobe.forget(url)
            elif url not in self._live:
                self.reprobe.retry(url)
        self._report_membership()
        report.servers_up = len(self.pool.members())
        report.servers_out = len(self.pool.dropped())
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

    def pause_mode_for(self, url: str) -> str:
        """``config.pause_mode`` for ``url``, but ``abort`` on a release before 0.5.19
        (``/server_info`` ``version``), which reports no ``weight_versions``: a request kept
        across the sync would carry only the newest version. Asked once per server (one
        warning); a server that does not answer its ``/server_info`` keeps the configured mode
        (its pause fails the sync's usual way)."""
        mode = self.config.pause_mode
        if mode == "abort":
            return mode
        if url not in self._modes:
            try:
                info = self.pool.server_info(url, timeout_s=self.config.failure_timeout_s)
            except RuntimeError:
                return mode
            release = _release(info.get("version"))
            self._modes[url] = mode
            if release is not None and release < SPANS_RELEASE:
                self._modes[url] = "abort"
                logger.warning(
                    "%s runs SGLang %s, before 0.5.19, which reports no per-token weight "
                    "versions: its syncs pause in abort mode, not %s",
                    url,
                    info.get("version"),
                    mode,
                )
        return self._modes[url]

    def _flush(self, url: str, mode: str) -> None:
        """The flush of a server paused in ``mode``: ``abort`` waits for idle and retries
        SGLang's 400 (`HttpPool.flush_cache`); ``retract``: `_flush_retracted`; ``in_place``:
        none (SGLang refuses it while requests are parked in place)."""
        if mode == "abort":
            self.pool.flush_cache(url)
        elif mode == "retract":
            self._flush_retracted(url)

    def _flush_retracted(self, url: str) -> None:
        """One ``/flush_cache?timeout=0`` during a ``retract`` pause: SGLang >= 0.5.21 flushes
        while only retracted requests wait (its flush wrapper with a timeout > 0 would wait for
        an empty waiting queue, which never comes). An older server refuses it (HTTP 400): its
        prefix cache then keeps the prompts' KV from the old weights (the retracted requests
        recompute their generated tokens only), with one warning per server."""
        try:
            self.pool.call_on(
                url, "POST", "/flush_cache?timeout=0", None, timeout_s=self.config.failure_timeout_s
            )
        except ServerError as err:
            if "HTTP 400" not in str(err):
                raise
            if url not in self._stale_prefix_warned:
                self._stale_prefix_warned.add(url)
                logger.warning(
                    "%s refuses /flush_cache while requests are retracted (SGLang < 0.5.21): "
                    "its prefix cache keeps KV computed by the old weights after this sync (%s)",
                    url,
                    str(err)[:200],
                )

    def _continue(self, paused: list[str], timeout_s: float) -> None:
        """``/continue_generation`` on every server this sync paused. A server that left the
        sync gets it too (its pause may have landed) but is not waited for: it may be the one
        that stalls, and a stalled server must cost this sync nothing more."""
        futures = {
            u: self.threads.submit(
                self.pool.call_on, u, "POST", "/continue_generation", {}, timeout_s=timeout_s
            )
            for u in paused
        }
        waited = [u for u in paused if u not in self._failed]
        wait([futures[u] for u in waited], timeout=timeout_s + self.pool.config.connect_timeout_s)
        for url in waited:
            future = futures[url]
            why = call_failure(future) if future.done() else "no answer"
            if why is not None:
                logger.error("continue_generation failed on %s: %s", url, why)

    def _report_membership(self) -> None:
        """A warning when the pool's membership changed since the last one, else nothing."""
        out = self.pool.dropped()
        if frozenset(out) == self._reported_out:
            return
        self._reported_out = frozenset(out)
        total = len(self.pool.config.urls)
        if not out:
            logger.warning("all %d rollout servers are in the pool again", total)
            return
        reprobe = self.reprobe.config
        logger.warning(
            "%d of %d rollout servers out of the pool (%s); each is probed in the background "
            "(/health, first after %.0f s, the wait doubling up to %.0f s) and rejoins after a "
            "full weight sync",
            len(out),
            total,
            "; ".join(f"{u}: {why}" for u, why in sorted(out.items())),
            reprobe.interval_s,
            reprobe.max_interval_s,
        )

    def _each(self, fn, what: str) -> None:
        """``fn(url)`` on every live server at once; failures leave the sync."""
        urls = list(self._live)
        futures = [self.threads.submit(fn, u) for u in urls]
        self._collect(urls, futures, what)

    def _collect(self, urls, futures, what: str) -> None:
        """Wait for one call per server; a failed one takes its server out of the sync."""
        wait(futures)
        for url, future in zip(urls, futures, strict=True):
            why = call_failure(future)
            if why is not None:
                self.fail(url, f"{what}: {why}")
        self.require()

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
                self.fail(url, f"model_info: {err}")
                continue
            got = info.get("weight_version")
            if str(got) != str(version):
                self.fail(url, f"after sync to version {version} the server reports {got!r}")
        self.require()
        if not sums:
            return
        for url in list(self._live):
            try:
                got = self.pool.call_on(url, "POST", "/weights_checksum", {"names": list(sums)})
            except ServerError as err:
                if "HTTP 404" not in str(err):
                    self.fail(url, f"weights_checksum: {err}")
                    continue
                raise WeightSyncError(
                    f"WeightSyncConfig.checksum=True, but {url} has no /weights_checksum: only the "
                    "loopback server serves it. SGLang has no checksum endpoint (its "
                    "/get_weights_by_name returns the first values of one parameter under "
                    "SGLang's own names and is not implemented for Qwen3-MoE); set checksum=False "
                    "and rely on the weight_version check"
                ) from err
            except RuntimeError as err:
                self.fail(url, f"weights_checksum: {err}")
                continue
            for name, want in sums.items():
                if abs(got[name] - want) > self.config.checksum_rtol * max(1.0, abs(want)):
                    self.fail(
                        url,
                        f"checksum of {name!r} on {url} is {got[name]!r}, trainer sent {want!r}",
                    )
                    break
                report.checksums_compared += 1
        self.require()

    def close(self) -> None:
        self.reprobe.close()
        self.transport.close()
        if self.adapters is not None:
            self.adapters.close()
        self.threads.shutdown(wait=False)


def _release(version: object) -> tuple[int, int, int] | None:
    """``"0.5.10.post1"`` -> ``(0, 5, 10)``; None for what is no release number."""
    match = re.match(r"(\d+)\.(\d+)\.(\d+)", str(version or ""))
    return None if match is None else tuple(int(g) for g in match.groups())
