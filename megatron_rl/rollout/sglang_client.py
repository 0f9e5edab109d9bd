"""`RolloutEngine` over SGLang servers via HTTP, optionally generating through ``sglang-router``.

Where requests go. ``http.urls`` are the SGLang *worker* servers (``sglang.launch_server``);
``router_url``, when given, is an ``sglang-router`` in front of them. Generation (``/generate``,
`score`) goes to the router when there is one, else straight to the workers with the client's
own failover. Every control call goes to each worker URL, never to the router: pause / continue,
``/flush_cache``, ``/abort_request``, the weight updates and ``/update_weight_version``, the
memory-occupation calls of ``--colocate`` (`release_memory` / `resume_memory`; to every
configured worker, `memory_occupation.ServerMemory`), and the
weight-version reads of `health`. sglang-router 0.3.2 serves only ``/generate``, ``/health``,
``/health_generate``, ``/flush_cache``, ``/get_model_info`` (and the OpenAI routes), none of the
pause, weight-update or weight-version routes, and it is no member of the weight-update process
group; so a router URL must not be given as a worker URL (`WeightSync` gets the worker pool).

Generation that needs routed experts (R3) goes to the workers directly even when a router is
given: sglang-router 0.3.2 forwards a fixed set of ``/generate`` fields and drops
``return_routed_experts`` (``tests/rollout/test_real_router.py`` runs the real binary).

Every sample is one ``/generate`` request (``n = 1``) with its own slot in the result list, run by
a pool of ``max_in_flight`` threads. Sent to the workers directly (no router, or R3), all samples
of a prompt go to one worker, which reuses the prompt's KV from its prefix cache; when that
worker fails mid-batch the prompt's remaining samples move together (`prompt_affinity`, which
also says what the router does instead). A retried request (timeout, dropped connection, 5xx; see
`HttpPool`) carries a fresh ``rid`` and fills the same slot, so no sample is lost or duplicated:
the batch returns exactly ``len(prompts) * n`` samples or raises. An answer whose
``finish_reason`` is ``abort`` (HTTP 200 with a partial answer: ``/abort_request``, a pause in
``abort`` mode, another generator's ``abort_all``) is generated again, at most
``max_abort_retries`` times, and counted (`take_aborted`, the ``rollout/aborted`` metric). Answers
are checked and decoded one by one (`sglang_payload.decode_generate`). When a batch fails, its
requests not yet sent are dropped and every worker gets ``/abort_request`` with ``abort_all``
(SGLang's ``AbortReq``), so the samples already sent stop occupying the servers. A request that
reaches the read timeout (``http.request_timeout_s``; none by default) is aborted by ``rid`` on
every worker and retried elsewhere; a read timeout does not mark the server down.

Routed experts (``return_routed_experts=True``; servers started with
``--enable-return-routed-experts --skip-tokenizer-init``, SGLang >= 0.5.10): SGLang returns
every decoder layer's top-k per position (``num_hidden_layers`` rows, dense layers zero); the
client keeps the MoE layers of ``SGLangEngineConfig.layer_pattern``. Prompt tokens served from
the radix cache come back with the routes recorded when their KV was computed; rows SGLang never
captured (all zeros, e.g. slots reloaded by ``--enable-hierarchical-cache``) fail the sample
with a RuntimeError instead of replaying wrong routes. See `sglang_payload` for the details.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import uuid
from collections.abc import Iterable, Sequence
from concurrent.futures import FIRST_EXCEPTION, ThreadPoolExecutor, wait

import torch
import torch.distributed as dist

from megatron_rl import stop_signal
from megatron_rl.moe_layers import moe_layer_pattern, num_routed_experts
from megatron_rl.rollout.http_pool import HttpPool, HttpPoolConfig, check_url
from megatron_rl.rollout.memory_occupation import ServerMemory
from megatron_rl.rollout.prompt_affinity import PromptAffinity
from megatron_rl.rollout.protocol import check_generate_args
from megatron_rl.rollout.server_hosts import check_same_host, handle_servers
from megatron_rl.rollout.sglang_payload import (
    decode_generate,
    finish_reason,
    generate_request,
    parse_version,
)
from megatron_rl.rollout.types import EngineHealth, RolloutSample, SamplingParams
from megatron_rl.rollout.weight_sync import (
    ReprobeConfig,
    SyncReport,
    WeightSync,
    WeightSyncConfig,
    WeightSyncError,
)
from megatron_rl.rollout.weight_sync.lora import adapter_name
from megatron_rl.routing import CODECS, RoutingCodec

logger = logging.getLogger(__name__)


class BatchCancelledError(RuntimeError):
    """Another sample of the batch failed; this one is not sent (again)."""


@dataclasses.dataclass(kw_only=True, slots=True)
class SGLangEngineConfig:
    """Where the servers are and what the model looks like (for routed-expert decoding).

    ``http.urls``: the SGLang worker servers (control calls, weight sync); ``router_url``: an
    optional ``sglang-router`` that generation goes through (see the module docstring).
    ``layer_pattern``: per HF decoder layer, 1 for a MoE layer and 0 for a dense one
    (`moe_layer_pattern` of the HF config); SGLang returns routes for all of them.
    ``min_servers``: a weight sync fails (`WeightSyncError`, the run stops) when fewer worker
    servers than this are left; a dead one is dropped and the run goes on with the others.
    ``reprobe``: how a dropped worker is probed in the background until it may rejoin
    (`megatron_rl.rollout.weight_sync.reprobe`).

    ``colocated`` (``--colocate``): the servers share the trainer's GPUs, and a server failure
    stops the run. Every sync needs every server (``min_servers`` is not used), so no server is
    ever dropped or re-probed: a dropped server would keep its KV cache while the trainer
    onloads, and a re-probe's ``/health`` generates on a server whose memory is released. No
    router (generation on the trainer's GPUs only between the memory hand-overs); the
    ``tensor`` transport's handles go from each rank to its own server (`server_hosts`).
    """

    http: HttpPoolConfig
    num_experts: int
    topk: int
    layer_pattern: tuple[int, ...]
    router_url: str | None = None
    routing_codec: str = "auto"
    max_in_flight: int = 64
    max_abort_retries: int = 8
    startup_timeout_s: float = 3600.0
    sync: WeightSyncConfig = dataclasses.field(default_factory=WeightSyncConfig)
    min_servers: int = 1
    reprobe: ReprobeConfig = dataclasses.field(default_factory=ReprobeConfig)
    colocated: bool = False

    def __post_init__(self) -> None:
        if not isinstance(self.min_servers, int) or self.min_servers < 1:
            raise ValueError(f"SGLangEngineConfig.min_servers={self.min_servers!r}: must be >= 1")
        if self.min_servers > len(self.http.urls):
            raise ValueError(
                f"SGLangEngineConfig.min_servers={self.min_servers}: only "
                f"{len(self.http.urls)} worker URLs given"
            )
        if self.routing_codec not in CODECS:
            raise ValueError(
                f"SGLangEngineConfig.routing_codec={self.routing_codec!r}: choose one of {CODECS}"
            )
        if not isinstance(self.max_abort_retries, int) or self.max_abort_retries < 0:
            raise ValueError(
                f"SGLangEngineConfig.max_abort_retries={self.max_abort_retries!r}: must be an "
                "int >= 0"
            )
        if not self.startup_timeout_s > 0:
            raise ValueError(
                f"SGLangEngineConfig.startup_timeout_s={self.startup_timeout_s!r}: must be > 0"
            )
        if not isinstance(self.max_in_flight, int) or self.max_in_flight < 1:
            raise ValueError(
                f"SGLangEngineConfig.max_in_flight={self.max_in_flight!r}: must be an int >= 1"
            )
        self.layer_pattern = tuple(int(x) for x in self.layer_pattern)
        if set(self.layer_pattern) - {0, 1} or 1 not in self.layer_pattern:
            raise ValueError(
                f"SGLangEngineConfig.layer_pattern={self.layer_pattern!r}: one 0 (dense) or 1 "
                "(MoE) per decoder layer, with at least one MoE layer"
            )
        if self.router_url is not None and self.colocated:
            raise ValueError(
                f"SGLangEngineConfig.router_url={self.router_url!r} with colocated=True "
                "(--sglang-router-url with --colocate): colocated servers are driven one by one; "
                "drop the router URL"
            )
        if self.router_url is not None:
            check_url(self.router_url, "SGLangEngineConfig.router_url")
            if self.router_url in self.http.urls:
                raise ValueError(
                    f"SGLangEngineConfig: {self.router_url} is both router_url and a worker URL; "
                    "give the router only as router_url (it serves no control routes)"
                )

    @property
    def required_servers(self) -> int:
        """Servers a weight sync needs: every one when colocated, else ``min_servers``."""
        return len(self.http.urls) if self.colocated else self.min_servers

    @property
    def num_moe_layers(self) -> int:
        return sum(self.layer_pattern)

    @classmethod
    def from_hf_config(cls, hf_config, **kwargs) -> SGLangEngineConfig:
        return cls(
            num_experts=num_routed_experts(hf_config),
            topk=int(hf_config.num_experts_per_tok),
            layer_pattern=tuple(moe_layer_pattern(hf_config)),
            **kwargs,
        )


class SGLangEngine:
    """HTTP client engine; see the module docstring. Call `close` (or use ``with``) when done."""

    def __init__(self, config: SGLangEngineConfig, hf_config=None) -> None:
        self.config = config
        self.workers = HttpPool(config.http)  # control calls and weight sync: every worker
        self.pool = (  # generation: the router when there is one, else the workers
            self.workers
            if config.router_url is None
            else HttpPool(dataclasses.replace(config.http, urls=(config.router_url,)))
        )
        self.codec = RoutingCodec(config.num_experts, config.topk, config.routing_codec)
        self.weight_sync = WeightSync(
            self.workers,
            config.sync,
            hf_config,
            min_servers=config.required_servers,
            reprobe=config.reprobe,
        )
        self.memory = ServerMemory(self.workers)
        self._threads = ThreadPoolExecutor(max_workers=config.max_in_flight)
        self._version = 0
        self._adapter: int | None = None  # the weight version of the newest adapter (LoRA sync)
        self._aborted = 0  # samples aborted by a server and generated again (`take_aborted`)
        self._lock = threading.Lock()
        self.last_sync: SyncReport | None = None

    def __enter__(self) -> SGLangEngine:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def close(self) -> None:
        self.weight_sync.close()
        self._threads.shutdown(wait=False, cancel_futures=True)

    # ------------------------------------------------------------------ protocol
    @property
    def weight_version(self) -> int:
        return self._version

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        return_routed_experts: bool = False,
    ) -> list[RolloutSample]:
        check_generate_args(prompts, n, None)
        batch = uuid.uuid4().hex[:12]
        cancelled = threading.Event()
        state = (batch, cancelled, PromptAffinity(n))  # affinity: sent to the workers directly
        routes = return_routed_experts
        futures = [
            self._threads.submit(self._one, list(map(int, prompt)), params, i, j, routes, state)
            for i, prompt in enumerate(prompts)
            for j in range(n)
        ]
        done, pending = wait(futures, return_when=FIRST_EXCEPTION)
        failed = [f for f in futures if f in done and f.exception() is not None]
        if failed:
            cancelled.set()  # no further attempt of this batch is sent
            for future in pending:
                future.cancel()
            if pending:
                self.abort_all()
            raise failed[0].exception()
        samples = [f.result() for f in futures]
        assert [(s.prompt_index, s.sample_index) for s in samples] == [
            (i, j) for i in range(len(prompts)) for j in range(n)
        ]
        return samples

    def _one(self, prompt, params, i, j, routes, state) -> RolloutSample:
        batch, cancelled, affinity = state
        attempt = iter(range(1 << 30))

        adapter: list[int | None] = [None]  # the adapter the last attempt named (LoRA sync)

        def payload() -> dict:  # a fresh rid per attempt: servers reject duplicate ids
            if cancelled.is_set():
                raise BatchCancelledError(f"sample (prompt {i}, sample {j}): batch failed")
            body = generate_request(
                prompt,
                params,
                prompt_index=i,
                sample_index=j,
                return_routed_experts=routes,
                rid=f"{batch}-{i}-{j}-{next(attempt)}",
            )
            adapter[0] = self._adapter  # a retry names the newest adapter
            if adapter[0] is not None:
                body["lora_path"] = adapter_name(adapter[0])
            return body

        # sglang-router 0.3.2 drops return_routed_experts and return_sampling_mask from the
        # body it forwards (its request type has no such fields): R3 generation and sampling
        # supports go to the workers directly; so do adapter requests (each worker loads them)
        direct = routes or params.return_sampling_support or self._adapter is not None
        pool = self.workers if direct else self.pool
        choose = affinity.chooser(i) if pool is self.workers else None  # else the router's
        what = f"sample (prompt {i}, sample {j})"
        for _ in range(self.config.max_abort_retries + 1):
            body = pool.post(
                "/generate", payload, what=what, on_timeout=self._abort_timed_out, choose=choose
            )
            reason = finish_reason(body)
            if reason.get("type") != "abort":
                if choose is not None:
                    affinity.answered(i)
                sample = decode_generate(
                    body,
                    prompt=prompt,
                    prompt_index=i,
                    sample_index=j,
                    codec=self.codec if routes else None,
                    layer_pattern=self.config.layer_pattern,
                    want_support=params.return_sampling_support,
                )
                if adapter[0] is not None:  # every token from the adapter it named
                    sample.weight_version = adapter[0]
                    sample.weight_versions = ((adapter[0], 0, len(sample.response_ids_R)),)
                return sample
            with self._lock:
                self._aborted += 1
            logger.warning("%s was aborted by the server (%s); generating it again", what, reason)
        raise RuntimeError(
            f"{what} was aborted {self.config.max_abort_retries + 1} times in a row (last: "
            f"{reason}); raise SGLangEngineConfig.max_abort_retries or see the server log"
        )

    def take_aborted(self) -> int:
        """Samples the servers aborted (and that were generated again) since the last call."""
        with self._lock:
            count, self._aborted = self._aborted, 0
        return count

    def wait_until_ready(self, *, poll_s: float = 2.0, progress_s: float = 30.0) -> float:
        """Wait until every worker (and the router) answers ``/health``; the seconds waited.

        SGLang listens only once its model is loaded (minutes for a 235B checkpoint), so a
        trainer started beside its servers would otherwise fail its first sync with "connection
        refused". Logs a progress line at the first failed probe and every ``progress_s``
        seconds; RuntimeError naming the servers still down after ``startup_timeout_s``
        (``--sglang-startup-timeout``);
        `StopRequested` within one poll of a stop signal (`megatron_rl.stop_signal`). Then
        checks each worker's TP size (`check_servers`).
        """
        start = time.monotonic()
        waiting = list(self.config.http.urls)
        if self.config.router_url is not None:
            waiting.append(self.config.router_url)
        last_log = start - progress_s  # the first failed probe says what is waited for
        while waiting:
            stop_signal.raise_if_requested(f"waiting for SGLang servers {waiting}")
            pools = [self.pool if u == self.config.router_url else self.workers for u in waiting]
            waiting = [u for u, pool in zip(waiting, pools, strict=True) if not pool.probe(u)]
            now = time.monotonic()
            if not waiting:
                break
            if now - start > self.config.startup_timeout_s:
                raise RuntimeError(
                    f"SGLang servers {waiting} did not answer /health within "
                    f"{self.config.startup_timeout_s:.0f} s (--sglang-startup-timeout); check "
                    "their logs"
                )
            if now - last_log >= progress_s:
                logger.info(
                    "waiting for SGLang servers %s to answer /health (%.0f s of %.0f s)",
                    waiting,
                    now - start,
                    self.config.startup_timeout_s,
                )
                last_log = now
            time.sleep(poll_s)
        self.check_servers()
        return time.monotonic() - start

    def check_servers(self) -> None:
        """ValueError when a worker's ``/server_info`` ``tp_size`` differs from the weight
        group's ranks per server (``--sglang-engine-ranks``): the group's world size and rank
        offsets would be wrong and the broadcast would hang. Workers that do not report
        ``tp_size`` are not checked. The ``tensor`` transport passes handles, not bytes: each
        worker that opens this rank's handles must run on this host (`server_hosts`: rank 0's
        every worker, or colocated the rank's own; a 4-node colocated job checks on each rank
        the server on its node)."""
        if self.config.sync.transport == "tensor":
            rank = dist.get_rank() if dist.is_initialized() else 0
            for url in handle_servers(
                self.config.http.urls,
                rank=rank,
                engine_ranks=self.config.sync.engine_ranks,
                colocated=self.config.colocated,
            ):
                check_same_host(url)
        want = self.config.sync.engine_ranks
        for url in self.workers.members():
            info = self.workers.server_info(url, timeout_s=self.config.http.health_timeout_s)
            got = info.get("tp_size")
            if got is not None and int(got) != want:
                raise ValueError(
                    f"{url} runs with tp_size={got} (its /server_info), but the weight sync "
                    f"expects {want} ranks per server: pass --sglang-engine-ranks {got}"
                )

    def membership_metrics(self) -> dict[str, float]:
        """The same keys on every call of a run: ``rollout/servers_up`` (pool members),
        ``rollout/servers_out`` (dropped and not rejoined: up + out = the ``--sglang-url``
        count), ``rollout/servers_dropped`` and ``rollout/servers_rejoined`` (events so far);
        after a sync also its ``weight_sync/seconds``, ``weight_sync/mb`` and, with one sender
        per pipeline stage, ``weight_sync/stage_mb/<stage>``."""
        out = {
            "rollout/servers_up": float(len(self.workers.members())),
            "rollout/servers_out": float(len(self.workers.dropped())),
            "rollout/servers_dropped": float(self.weight_sync.dropped_total),
            "rollout/servers_rejoined": float(self.weight_sync.rejoined_total),
        }
        report = self.last_sync
        if report is not None:
            out["weight_sync/seconds"] = report.seconds
            out["weight_sync/mb"] = report.num_bytes / 1e6
            for stage, num_bytes in enumerate(report.stage_bytes):
                out[f"weight_sync/stage_mb/{stage}"] = num_bytes / 1e6
        return out

    def update_weights(
        self,
        named_tensors: Iterable[tuple[str, torch.Tensor]],
        *,
        version: int,
        stages=(),
        peers=None,
        adapter_config: dict | None = None,
    ) -> None:
        """Sync over the configured transport (`WeightSync.sync`); WeightSyncError on failure.
        ``adapter_config``: ``named_tensors`` is a LoRA adapter with this PEFT config, loaded as
        the SGLang adapter of ``version`` that every later request names (`weight_sync.lora`).
        ``stages``: the other pipeline stages' senders (`weight_sync.stages.RemoteStage`);
        ``peers``: colocated, every trainer rank's handles (`weight_sync.rank_handles`).
        Colocated, a sync that any server fails stops the run (see `SGLangEngineConfig`)."""
        try:
            self.last_sync = self.weight_sync.sync(
                named_tensors, version, stages=stages, peers=peers, adapter_config=adapter_config
            )
        except WeightSyncError as err:
            if not self.config.colocated:
                raise
            raise WeightSyncError(
                f"--colocate: {err}. A colocated run needs every server (each shares its GPUs "
                "with trainer ranks; one left out would keep its memory there while they train), "
                "so the run stops: restart it with every server up"
            ) from err
        self._version = version
        self._adapter = version if adapter_config is not None else None

    def flush_cache(self) -> None:
        """``/flush_cache`` on each member worker, waiting for idle (`HttpPool.flush_cache`)."""
        for url in self.workers.members():
            self.workers.flush_cache(url)

    def abort_all(self) -> None:
        """``/abort_request`` with ``abort_all`` on every worker (the router has no such route);
        best effort: failures are logged."""
        self._abort({"abort_all": True})

    def release_memory(self, tags: Sequence[str] | None = None) -> None:
        """``/release_memory_occupation`` of ``tags`` (None: ``kv_cache``, ``weights`` and
        ``cuda_graph``) on every configured worker at once (colocated mode), each once it is
        idle (``/flush_cache`` polled, up to ``http.flush_timeout_s``). RuntimeError naming the
        servers that stayed busy, failed or were dropped (`memory_occupation.ServerMemory`)."""
        self.memory.release(tags)

    def resume_memory(self, tags: Sequence[str] | None = None) -> None:
        """``/resume_memory_occupation`` of ``tags`` (None: all three) on every configured
        worker; each tag must have been released. RuntimeError naming the servers that failed."""
        self.memory.resume(tags)

    def _abort_timed_out(self, url: str, payload: object) -> None:
        rid = payload.get("rid") if isinstance(payload, dict) else None
        if rid:  # with a router we do not know which worker has it: ask all
            self._abort({"rid": rid})

    def _abort(self, payload: dict) -> None:
        """``/abort_request`` on every member at once (a stalled one costs ``health_timeout_s``
        once, not once per member)."""

        def abort(url: str) -> bool:
            try:
                self.workers.call_on(
                    url,
                    "POST",
                    "/abort_request",
                    payload,
                    timeout_s=self.config.http.health_timeout_s,
                )
            except RuntimeError as err:
                logger.warning("abort_request %s on %s failed: %s", payload, url, err)
            return True

        self.workers.each(abort, self.workers.members())

    def health(self) -> EngineHealth:
        """Healthy when at least one member worker answers /health, all healthy ones agree on
        the weight version, and the router (if any) answers /health (dropped workers are not
        asked)."""
        up = self.workers.probe_all(self.workers.members())
        router_up = self.config.router_url is None or bool(self.pool.probe_all())
        router = "" if self.config.router_url is None else f"; router up: {router_up}"
        if not up:
            return EngineHealth(
                healthy=False, weight_version=self._version, detail=f"no server up{router}"
            )
        timeout = self.config.http.health_timeout_s
        versions = {
            u: parse_version(self.workers.model_info(u, timeout_s=timeout).get("weight_version"), u)
            for u in up
        }
        agree = len(set(versions.values())) == 1
        dropped = self.workers.dropped()
        detail = f"{len(up)}/{len(self.config.http.urls)} servers up; versions {versions}{router}"
        detail += f"; dropped {sorted(dropped)}" if dropped else ""
        return EngineHealth(
            healthy=agree and router_up, weight_version=next(iter(versions.values())), detail=detail
        )

    def score(self, token_ids: Sequence[int]) -> torch.Tensor:
        """float32 [S - 1]: the server's prompt log-probs (``input_token_logprobs``, T = 1)."""
        payload = {
            "input_ids": [int(t) for t in token_ids],
            "sampling_params": {"max_new_tokens": 1, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
        }
        pool = self.pool
        if self._adapter is not None:  # the policy's adapter, on a worker directly
            payload["lora_path"], pool = adapter_name(self._adapter), self.workers
        body = pool.post("/generate", payload, what="score")
        entries = body["meta_info"]["input_token_logprobs"]
        if len(entries) != len(token_ids):
            raise RuntimeError(f"score: {len(entries)} input logprobs for {len(token_ids)} tokens")
        return torch.tensor([float(e[0]) for e in entries[1:]], dtype=torch.float32)
