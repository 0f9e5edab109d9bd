"""A small HTTP server that speaks SGLang's RL endpoints, backed by an `InProcessEngine`.

For tests, benchmarks and the embedded demo; not a serving system. It implements the subset of
SGLang 0.5's HTTP API (field names from ``sglang/srt/managers/io_struct.py``) that
`SGLangEngine` uses: ``/generate`` (``input_ids``, ``sampling_params``, ``return_logprob``,
``logprob_start_len``, ``return_routed_experts``; answer ``output_ids`` and ``meta_info``, whose
``routed_experts`` covers every decoder layer with dense layers zero, as SGLang's does),
``/health``, ``/model_info`` (and ``/get_model_info``), ``/server_info``, ``/flush_cache``,
``/pause_generation``, ``/continue_generation``, ``/abort_request``, ``/begin_weight_update``,
``/end_weight_update``, ``/update_weights_from_disk``, ``/update_weights_from_tensor``,
``/init_weights_update_group``, ``/update_weights_from_distributed``,
``/destroy_weights_update_group``, ``/update_weight_version``, ``/release_memory_occupation``,
``/resume_memory_occupation``.

The weight-update endpoints (sessions, from disk, tensor and distributed, the version) are in
`megatron_rl.testing.loopback_weights`. Differences from SGLang, deliberately: one extra endpoint,
``/weights_checksum`` (SGLang has none), serves the checksum mode. ``before_request`` lets tests
inject faults: return "drop" (close without answering), "503", "stall" (sleep ``stall_s``; a
stalled ``/generate`` counts as running and ends early on ``/abort_request``), "hang" (the
connection is accepted and never answered, whatever the timeout, until `release_hung` or `stop`
close it: a wedged server, e.g. a hung scheduler or a frozen host, which the real server cannot
be made into on demand in a test), or "die" (stop the server, dropping the request).

It refuses what SGLang 0.5.23 refuses: tensor and distributed updates outside a
``/begin_weight_update`` .. ``/end_weight_update`` session and a second begin (HTTP 400,
``srt/managers/scheduler_components/weight_updater.py``; ``sessions = False`` plays a release
before 0.5.21, which answers 404 on begin), ``/health`` while generation is paused (it waits,
then 503 after ``health_check_timeout_s``, as the tokenizer manager's pause holds the health
generation), and a CUDA IPC handle (SGLang's ``srt/utils/patch_torch.py``: "Invalid
device_uuid" for a GPU it cannot see; this server sees none). The real server runs in CI
(``tests/rollout/test_real_sglang.py``); this stand-in is for the fast lane and for faults the
real server cannot be made to show.

Like SGLang 0.5.23 (``srt/entrypoints/http_server.py``) where the client depends on it:
``/health`` (and ``/health_generate``) generates one token, then sleeps ``health_delay_s``
(SGLang: 1 s) before answering 200 (503 if the generation fails); ``/flush_cache`` answers plain
text, 400 while any ``/generate`` is running, and with the ``timeout`` query parameter (seconds)
first waits that long for idle; ``/abort_request`` (``rid`` or ``abort_all``) answers 200 with no
body and ends matching requests with ``finish_reason`` ``abort``; a failed weight update or
version update is HTTP 400 with ``success: false``; ``/pause_generation`` and
``/continue_generation`` answer ``{"message": ..., "status": "ok"}``. Query parameters are passed
to the handlers merged into the payload.

Pausing, as SGLang 0.5.23 (``srt/managers/tokenizer_manager.py`` ``pause_generation``,
``srt/managers/scheduler.py`` ``pause_generation``, ``flush_cache``, ``is_fully_idle``,
``srt/managers/scheduler_components/flush_wrapper.py``, ``weight_updater.py``):
``/pause_generation`` takes ``{"mode": "abort" | "retract" | "in_place"}`` (default ``abort``;
another value is HTTP 422). ``abort`` ends this server's running ``/generate`` calls with
``finish_reason`` ``abort`` and their partial tokens, answering once none runs; ``retract`` and
``in_place`` park them at the next decode step (`InProcessEngine.pause`, scoped to this
server) and answer at once. New ``/generate`` calls wait until ``/continue_generation``.
``/flush_cache`` (``timeout`` 0) succeeds during a ``retract`` pause with only retracted requests
(the scheduler ignores its waiting queue while paused; ``flush_ignores_retracted = False`` plays
a release before 0.5.21, which counts them), and is refused while any request is parked in
``in_place`` mode; with a ``timeout`` > 0 it waits for an empty server, retracted requests
included (the flush wrapper's idle check), and answers "Timed out waiting for idle state.".
Weight updates flush after loading unless the payload says ``flush_cache: false``; where that
flush is refused they load, move the version and answer HTTP 400 ("Weights were updated, but the
cache was not flushed ..."). ``/update_weight_version`` aborts every request unless
``abort_all_requests`` is false (SGLang's default is true); ``/abort_request`` still ends only
stalled requests (the client's tests count exactly those). ``meta_info.weight_versions`` reports
the segments of every answer as SGLang >= 0.5.19 does (``srt/utils/weight_versions.py``,
``add_weight_versions_to_meta_info``: ``[{"version", "start", "end"}]``, versions as strings),
and ``meta_info.weight_version`` is then the newest segment's version.

Memory occupation, as SGLang 0.5.23 (``srt/managers/scheduler_components/weight_updater.py``
``release_memory_occupation`` / ``resume_memory_occupation``; tags in
`megatron_rl.rollout.memory_occupation`): ``/release_memory_occupation`` (``{"tags": [...]}``,
none: all of ``kv_cache``, ``weights``, ``cuda_graph``) needs an idle server, waiting requests
ignored while generation is paused in ``retract`` / ``in_place`` mode (``is_fully_idle(
ignore_waiting=scheduler._engine_paused)``), and releasing ``kv_cache`` flushes the cache;
``/resume_memory_occupation`` of a tag that is not released is refused. Both answer 200 with no
body. Where SGLang's scheduler would die or touch freed GPU memory, this server answers HTTP 400
(``{"error": {"message": ...}}``, SGLang's error shape) instead: a release while requests run
(SGLang asserts), a resume of an unreleased tag (``KeyError``), ``/generate`` while any tag is
released (SGLang schedules it into released KV cache, weights or CUDA-graph memory; ``/health``
answers 503), and a weight update or ``/weights_checksum`` while ``weights`` is released (SGLang
loads into the freed weights: resume ``weights`` first, as slime does before each update).
"""

from __future__ import annotations

import argparse
import base64
import itertools
import json
import logging
import threading
import time
import urllib.parse
from collections.abc import Callable
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

import torch

from megatron_rl.moe_layers import moe_layer_pattern
from megatron_rl.rollout.inprocess import InProcessEngine
from megatron_rl.rollout.memory_occupation import KV_CACHE, MEMORY_TAGS, WEIGHTS, MemoryOccupation
from megatron_rl.rollout.pause_gate import PAUSE_MODES
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.rollout.weight_group import GroupMemberProcess
from megatron_rl.testing.loopback_weights import WeightUpdateEndpoints

logger = logging.getLogger(__name__)


class _DeepQueueServer(ThreadingHTTPServer):
    """A deeper accept queue than socketserver's 5 (uvicorn, under SGLang's server: 2048): a
    client's 64 concurrent ``/generate`` calls overflow 5 while generation holds the GIL, and the
    kernel resets the extra connections."""

    request_queue_size = 2048


class LoopbackServer(WeightUpdateEndpoints):
    """Serve ``engine`` on ``host:port`` (port 0: a free port) from a background thread."""

    weight_group_timeout_s = 120.0  # joining and each broadcast of a weight-update group

    def __init__(self, engine: InProcessEngine, host: str = "127.0.0.1", port: int = 0) -> None:
        self.engine = engine
        self.before_request: Callable[[str, object], str | None] | None = None
        self.stall_s = 30.0
        self.health_delay_s = 1.0  # SGLang's /health sleeps 1 s after starting its generation
        self.health_check_timeout_s = 20.0  # SGLANG_HEALTH_CHECK_TIMEOUT: 503 after this
        self.sessions = True  # False: an SGLang release before /begin_weight_update (404)
        self.tp_size = 1  # what /server_info reports
        self.version = "loopback"  # /server_info's SGLang release (no number: the newest)
        self.flush_ignores_retracted = True  # False: a release before 0.5.21 (see the docstring)
        self.pause_mode: str | None = None  # the mode of /pause_generation, until continued
        self.memory = MemoryOccupation()  # released tags (/release_memory_occupation)
        self.aborts: list[dict] = []  # /abort_request payloads, in order (tests inspect them)
        self._running: dict[int, str | None] = {}  # /generate in progress: id -> rid
        self._aborted: set[int] = set()
        self._state = threading.Condition()
        self._flushing = False
        self._keys = itertools.count()
        self.requests: list[str] = []  # paths served, in order (tests inspect it)
        self.tensor_entries: list[list[str]] = []  # per tensor update: the entries read
        self.weight_groups: dict[str, GroupMemberProcess] = {}
        self._resume = threading.Event()
        self._resume.set()
        self._hang = threading.Condition()
        self._hang_epoch = 0  # `release_hung` moves it: the requests held before it close
        self.hung_now = 0  # requests held unanswered by the "hang" fault right now
        handler = type("Handler", (_Handler,), {"app": self})
        self.httpd = _DeepQueueServer((host, port), handler)
        self.httpd.daemon_threads = True
        self.url = f"http://{host}:{self.httpd.server_address[1]}"
        self._thread = threading.Thread(target=self.httpd.serve_forever, daemon=True)

    def start(self) -> LoopbackServer:
        self._thread.start()
        return self

    def stop(self) -> None:
        self.release_hung()
        self.httpd.shutdown()
        self.httpd.server_close()
        while self.weight_groups:
            self.weight_groups.popitem()[1].close()

    def release_hung(self) -> None:
        """Close every connection the "hang" fault holds, without an answer."""
        with self._hang:
            self._hang_epoch += 1
            self._hang.notify_all()

    def _hold(self) -> None:
        """Hold a request unanswered until `release_hung` (the "hang" fault)."""
        with self._hang:
            epoch = self._hang_epoch
            self.hung_now += 1
            try:
                self._hang.wait_for(lambda: self._hang_epoch != epoch)
            finally:
                self.hung_now -= 1

    def __enter__(self) -> LoopbackServer:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()

    # ------------------------------------------------------------------ endpoints
    def handle(self, path: str, payload: dict) -> tuple[int, object]:
        routes = {
            "/health": self._health,
            "/health_generate": self._health,
            "/model_info": lambda p: (200, self._model_info()),
            "/get_model_info": lambda p: (200, self._model_info()),
            "/server_info": lambda p: (200, {"tp_size": self.tp_size, "version": self.version}),
            "/begin_weight_update": self._begin_session,
            "/end_weight_update": self._end_session,
            "/flush_cache": self._flush,
            "/abort_request": self._abort,
            "/pause_generation": self._pause,
            "/continue_generation": self._continue,
            "/generate": self._generate,
            "/update_weights_from_disk": self._from_disk,
            "/update_weights_from_tensor": self._from_tensor,
            "/init_weights_update_group": self._init_group,
            "/update_weights_from_distributed": self._from_distributed,
            "/destroy_weights_update_group": self._destroy_group,
            "/update_weight_version": self._update_version,
            "/weights_checksum": self._checksums,
            "/release_memory_occupation": self._release_memory,
            "/resume_memory_occupation": self._resume_memory,
        }
        if not self.sessions:  # an SGLang release before weight-update sessions
            del routes["/begin_weight_update"], routes["/end_weight_update"]
        if path not in routes:
            return 404, {"error": f"unknown endpoint {path}"}
        return routes[path](payload)

    def _model_info(self) -> dict:
        return {
            "model_path": "loopback",
            "is_generation": True,
            "weight_version": str(self.engine.weight_version),
        }

    def _health(self, payload: dict) -> tuple[int, object]:
        if self.memory.missing_for("/health", MEMORY_TAGS):  # its generation needs all three
            return 503, None
        # SGLang 0.5.23: the health generation waits behind a pause; after
        # SGLANG_HEALTH_CHECK_TIMEOUT (20 s) the handler answers 503
        if not self._resume.wait(timeout=self.health_check_timeout_s):
            return 503, None
        try:  # SGLang: GenerateReqInput(input_ids=[0], max_new_tokens=1, temperature=0)
            greedy = SamplingParams(temperature=0.0, max_new_tokens=1)
            self.engine.generate_one([0], greedy, sample_seed=None)
        except Exception as err:  # any failure of the generation: unhealthy, like SGLang's 503
            logger.warning("loopback /health generation failed: %s", err)
            return 503, None
        time.sleep(self.health_delay_s)
        return 200, None

    def _pause(self, payload: dict) -> tuple[int, object]:
        mode = payload.get("mode", "abort")
        if mode not in PAUSE_MODES:  # FastAPI's validation of the Literal field
            return 422, {"detail": "mode: Input should be 'abort', 'retract' or 'in_place'"}
        with self._state:
            self.pause_mode = mode
            self._resume.clear()
            self._state.notify_all()
        if mode == "abort":
            # SGLang's tokenizer manager: abort_all, again every second, until none runs. An
            # engine pause left by an earlier retract / in_place pause is lifted after the first
            # abort (its parked calls end; calls admitted meanwhile start and meet the next one)
            self._abort_everything()
            self.engine.resume(scope=self)
            while True:
                self._abort_everything()
                with self._state:
                    if self._state.wait_for(lambda: not self._running, timeout=1.0):
                        break
        else:
            self.engine.pause(mode, scope=self)
        return 200, {"message": "Generation paused successfully.", "status": "ok"}

    def _continue(self, payload: dict) -> tuple[int, object]:
        self.engine.resume(scope=self)
        with self._state:
            self.pause_mode = None
            self._resume.set()
            self._state.notify_all()
        return 200, {"message": "Generation continued successfully.", "status": "ok"}

    def _idle(self, *, waiting_counts: bool) -> bool:
        """No request is running (SGLang's ``is_fully_idle``). A ``retract`` pause moved them to
        the waiting queue, which counts only with ``waiting_counts`` (the flush wrapper's check,
        and releases before 0.5.21). Caller holds ``_state``."""
        if not self._running:
            return True
        retracted = self.pause_mode == "retract" and self.flush_ignores_retracted
        return retracted and not waiting_counts

    def _flush(self, payload: dict) -> tuple[int, object]:
        timeout = float(payload.get("timeout", 0.0))
        if timeout < 0:
            return 422, {"detail": "timeout: Input should be greater than or equal to 0"}
        with self._state:
            if self._flushing:
                return 400, "Another flush_cache is already in progress."
            self._flushing = True
            try:
                if timeout > 0:  # the flush wrapper waits for is_fully_idle(), waiting included
                    idle = self._state.wait_for(
                        lambda: self._idle(waiting_counts=True), timeout=timeout
                    )
                else:
                    idle = self._idle(waiting_counts=False)
            finally:
                self._flushing = False
        if not idle:
            return (
                400,
                "Timed out waiting for idle state." if timeout > 0 else "Flush cache failed.\n",
            )
        self.engine.flush_cache()
        return 200, (
            "Cache flushed.\nPlease check backend logs for more details. (When there are running "
            "or waiting requests, the operation will not be performed.)\n"
        )

    def _release_memory(self, payload: dict) -> tuple[int, object]:
        # SGLang 0.5.23 weight_updater.py release_memory_occupation: asserts
        # is_fully_idle(ignore_waiting=engine paused), then adds the tags to offload_tags
        with self._state:  # no /generate is admitted between the idle check and the release
            paused = self.pause_mode in ("retract", "in_place")  # the scheduler's _engine_paused
            if not self._idle(waiting_counts=not paused):
                message = "release_memory_occupation should be called only when server is idle."
                return 400, {"error": {"message": message}}  # SGLang: the assert ends the server
            tags = self.memory.release(payload.get("tags"))
        if KV_CACHE in tags:  # SGLang pauses the KV memory, then flush_cache()
            self.engine.flush_cache()
        return 200, None

    def _resume_memory(self, payload: dict) -> tuple[int, object]:
        try:  # SGLang: offload_tags.remove(tag), KeyError (and a dead scheduler) if not released
            self.memory.resume(payload.get("tags"))
        except ValueError as err:
            return 400, {"error": {"message": str(err)}}
        return 200, None

    def _refused_without_weights(self, what: str) -> tuple[int, object] | None:
        """HTTP 400 while ``weights`` is released (SGLang would load into freed memory)."""
        if message := self.memory.missing_for(what, (WEIGHTS,)):
            return 400, {"success": False, "message": message}
        return None

    def _checksums(self, payload: dict) -> tuple[int, object]:
        if refused := self._refused_without_weights("/weights_checksum"):
            return refused
        return 200, self.engine.checksums(payload["names"])

    def _flush_after_update(self, payload: dict, answer: tuple[int, object]) -> tuple[int, object]:
        """SGLang's ``flush_cache_after_weight_update``: a successful update whose flush is
        refused (requests running, or parked in place) fails, its weights and version kept."""
        if answer[0] != 200 or not payload.get("flush_cache", True):
            return answer
        with self._state:
            idle = self._idle(waiting_counts=False)
        if idle:
            return answer
        message = (
            "Weights were updated, but the cache was not flushed because requests are still "
            "running or queued. Retract or finish them, then call /flush_cache."
        )
        return 400, {"success": False, "message": message}

    def _abort(self, payload: dict) -> tuple[int, object]:
        self.aborts.append(dict(payload))
        rid, everything = payload.get("rid") or "", bool(payload.get("abort_all", False))
        with self._state:
            hit = {k for k, r in self._running.items() if everything or (rid and r == rid)}
            self._aborted |= hit
            self._state.notify_all()
        return 200, None

    def _abort_everything(self) -> None:
        """End every request of this server: stalled ones, and real generations at their next
        decode step (parked ones too), each answering ``finish_reason`` ``abort``."""
        with self._state:
            self._aborted |= set(self._running)
            self._state.notify_all()
        self.engine.abort_all(scope=self)

    def _track(self, payload: object) -> int:
        """Count a /generate as running (until `_untrack`); its key for `_stalled`."""
        rid = payload.get("rid") if isinstance(payload, dict) else None
        with self._state:  # re-entrant: `_generate` holds it
            key = id(object()) ^ threading.get_ident()
            while key in self._running:
                key += 1
            self._running[key] = rid
        return key

    def _untrack(self, key: int) -> None:
        with self._state:
            self._running.pop(key, None)
            self._aborted.discard(key)
            self._state.notify_all()

    def _stalled(self, key: int | None) -> bool:
        """Sleep ``stall_s`` or until the request is aborted; True if it was aborted."""
        if key is None:
            time.sleep(self.stall_s)
            return False
        with self._state:
            return self._state.wait_for(lambda: key in self._aborted, timeout=self.stall_s)

    def _generate(self, payload: dict) -> tuple[int, object]:
        # paused: the request waits before it is scheduled (SGLang holds it in the tokenizer
        # manager), so it does not count as running for /flush_cache
        with self._state:
            if not self._state.wait_for(lambda: self.pause_mode is None, timeout=60):
                return 503, {"error": "generation paused for more than 60 s"}
            if message := self.memory.missing_for("/generate", MEMORY_TAGS):
                return 400, {"error": {"message": message}}  # SGLang: runs on freed memory
            key = self._track(payload)  # admitted and counted at once: no pause in between
        try:
            return self._generate_now(payload)
        finally:
            self._untrack(key)

    def _generate_now(self, payload: dict) -> tuple[int, object]:
        sampling = dict(payload.get("sampling_params") or {})
        if int(sampling.pop("n", 1)) != 1:
            return 400, {"error": "the loopback server supports n=1 per request"}
        params = SamplingParams(
            temperature=float(sampling.get("temperature", 1.0)),
            top_p=float(sampling.get("top_p", 1.0)),
            top_k=int(sampling.get("top_k", -1)),
            max_new_tokens=int(sampling.get("max_new_tokens", 128)),
            stop_token_ids=tuple(sampling.get("stop_token_ids") or ()),
        )
        ids = [int(t) for t in payload["input_ids"]]
        routes = bool(payload.get("return_routed_experts", False))
        sample = self.engine.generate_one(
            ids,
            params,
            sample_seed=sampling.get("sampling_seed"),
            return_routed_experts=routes,
            scope=self,
        )
        out = sample.response_ids_R.tolist()
        finish = {"type": sample.finish_reason}
        if sample.finish_reason == "abort":  # SGLang's FINISH_ABORT of a running request
            finish.update(message="Aborted", status_code=None, err_type=None)
        meta = {
            "id": payload.get("rid"),
            "finish_reason": finish,
            "prompt_tokens": len(ids),
            "completion_tokens": len(out),
            "cached_tokens": 0,
            **weight_version_meta(sample.weight_versions),
        }
        if payload.get("return_logprob"):
            lps = sample.logprobs_R.tolist()
            meta["output_token_logprobs"] = [[lp, t, None] for lp, t in zip(lps, out, strict=True)]
            if payload.get("logprob_start_len", -1) == 0:
                scores = self.engine.score(ids).tolist()
                meta["input_token_logprobs"] = [[None, ids[0], None]] + [
                    [lp, t, None] for lp, t in zip(scores, ids[1:], strict=True)
                ]
        if routes:
            meta["routed_experts"] = self._all_layer_routes(sample.routes)
        return 200, {"output_ids": out, "meta_info": meta}

    def _all_layer_routes(self, blob) -> str:
        """Like SGLang: int32 ``[T, num_hidden_layers, K]``, dense layers zero, base64."""
        moe_TLK = self.engine.codec.decode(blob, dtype=torch.int32)
        pattern = moe_layer_pattern(self.engine.model.config)
        all_TLK = torch.zeros(moe_TLK.shape[0], len(pattern), moe_TLK.shape[2], dtype=torch.int32)
        all_TLK[:, [i for i, sparse in enumerate(pattern) if sparse]] = moe_TLK
        return base64.b64encode(all_TLK.numpy().tobytes()).decode()


class _Handler(BaseHTTPRequestHandler):
    app: LoopbackServer
    protocol_version = "HTTP/1.1"

    def log_message(self, fmt: str, *args: object) -> None:
        logger.debug(fmt, *args)

    def do_GET(self) -> None:
        self._serve(None)

    def do_POST(self) -> None:
        length = int(self.headers.get("Content-Length") or 0)
        self._serve(json.loads(self.rfile.read(length) or b"null"))

    def _serve(self, payload: object) -> None:
        path, _, query = self.path.partition("?")
        if query:
            params = dict(urllib.parse.parse_qsl(query))
            payload = {**params, **payload} if isinstance(payload, dict) else params
        app = self.app
        app.requests.append(path)
        fault = app.before_request(path, payload) if app.before_request else None
        if fault == "drop":
            self.close_connection = True
            self.connection.shutdown(2)
            return
        if fault == "hang":  # accepted, never answered; closed by release_hung or stop
            app._hold()
            self.close_connection = True
            return
        if fault == "die":
            self.close_connection = True
            self.connection.shutdown(2)
            threading.Thread(target=app.stop, daemon=True).start()
            return
        if fault == "stall" and path == "/generate":  # running: /abort_request ends it
            key = app._track(payload)
            try:
                if app._stalled(key):
                    self._send(200, _aborted_answer(payload))
                    return
            finally:
                app._untrack(key)
        elif fault == "stall":
            time.sleep(app.stall_s)
        if fault == "503":
            status, body = 503, {"error": "injected 503"}
        elif payload is None and path in _BODY_REQUIRED:  # SGLang 0.5.23 answers 400 (measured)
            status, body = 400, {"detail": "a JSON body is required"}
        else:
            try:
                status, body = app.handle(path, payload or {})
            except (KeyError, TypeError, ValueError) as err:
                status, body = 400, {"error": f"{type(err).__name__}: {err}"}
        self._send(status, body)

    def _send(self, status: int, body: object) -> None:
        if isinstance(body, str):  # SGLang's plain-text answers (/flush_cache)
            data, kind = body.encode(), "text/plain; charset=utf-8"
        else:
            data = b"" if body is None else json.dumps(body).encode()
            kind = "application/json"
        self.send_response(status)
        self.send_header("Content-Type", kind)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)


_BODY_REQUIRED = ("/pause_generation", "/continue_generation")  # ``Body()`` parameters


def weight_version_meta(spans) -> dict:
    """``meta_info`` fields for a sample's ``((version, start, end), ...)`` segments, as SGLang's
    ``add_weight_versions_to_meta_info`` writes them: ``weight_versions`` (versions as strings)
    and ``weight_version``, the newest segment's."""
    segments = [{"version": str(v), "start": start, "end": end} for v, start, end in spans]
    return {"weight_versions": segments, "weight_version": segments[-1]["version"]}


def _aborted_answer(payload: object) -> dict:
    rid = payload.get("rid") if isinstance(payload, dict) else None
    finish = {"type": "abort", "message": "Abort in waiting queue"}
    meta = {"id": rid, "finish_reason": finish, "prompt_tokens": 0, "completion_tokens": 0}
    return {"output_ids": [], "meta_info": meta}


def main() -> None:
    """``python -m megatron_rl.testing.loopback_server --port P``: serve a random tiny model."""
    from megatron_rl.model import preset_config

    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--port", type=int, default=0)
    parser.add_argument("--preset", default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--vocab-size",
        type=int,
        default=None,
        help="override the preset's vocabulary (the trainer's tiny policy: its tokenizer's, "
        "rounded up to 8 x TP; the built-in task: 16)",
    )
    parser.add_argument(
        "--torch-threads", type=int, default=None, help="intra-op threads (default: auto)"
    )
    args = parser.parse_args()
    logging.basicConfig(level=logging.INFO)
    from megatron_rl.threads import configure_threads

    configure_threads(args.torch_threads)  # the cores left, not torch's one per core
    overrides = {} if args.vocab_size is None else {"vocab_size": args.vocab_size}
    hf_config = preset_config(args.preset, **overrides)
    engine = InProcessEngine.from_hf_config(hf_config, seed=args.seed)
    server = LoopbackServer(engine, port=args.port)
    logger.info("loopback server on %s", server.url)
    server.httpd.serve_forever()


if __name__ == "__main__":
    main()
