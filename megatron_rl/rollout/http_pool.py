"""JSON over HTTP to a set of servers: timeouts, retries with backoff, failover, health.

Standard library only (``http.client``): one short-lived connection per request, so a request
that timed out or failed can never deliver a late answer into a retried slot.

Retried: connection errors (refused, reset, dropped mid-answer), read timeouts, HTTP 5xx. Not
retried: HTTP 4xx and malformed JSON (a broken protocol; `RuntimeError`). A server that refused
or dropped the connection or answered 5xx is marked down for ``down_s`` seconds and the retry goes
to another server; a read timeout also moves the retry to another server when there is one, but
does not mark the server down (a long generation on a busy, healthy server is not a fault). When
every server is down, the pool probes ``/health`` on each (in parallel) before giving up with
`NoHealthyServerError`.

Membership: `HttpPool.drop` takes a server out of the pool (no generation is sent to it, no
probe brings it back) until `HttpPool.admit`; `WeightSync` drops a server that died or failed a
sync and admits it again only after a full sync at the current version.

Stalls: a request without a read timeout (``/generate`` by default, weight updates) waits for
its answer in slices of ``liveness_interval_s``; after each silent slice the server's
``/model_info`` must answer within ``health_timeout_s`` (one check per server at a time, its
verdict shared by every request waiting on it). A server that accepts connections but answers
nothing is so marked down and the request retried elsewhere within about ``2 x
liveness_interval_s + health_timeout_s``, instead of never. SGLang answers ``/model_info`` from
its HTTP process (the tokenizer manager), also while it generates, loads weights or is paused.

Timeouts follow SGLang 0.5's handlers (``sglang/srt/entrypoints/http_server.py``): ``/health``
generates one token and sleeps 1 s before its first check, answering 503 only after
``SGLANG_HEALTH_CHECK_TIMEOUT`` (20 s), so ``health_timeout_s`` defaults to 30 s; ``/generate``
has no read timeout unless ``request_timeout_s`` is set (the connect timeout always applies);
``/flush_cache?timeout=T`` waits up to T s for the server to be idle and answers 400 if it is
not, which `HttpPool.flush_cache` retries until ``flush_timeout_s``.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import math
import socket
import threading
import time
import urllib.parse
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor

logger = logging.getLogger(__name__)

# SGLang's /health answers no sooner than this (its handler's first ``asyncio.sleep(1)``) and no
# later than SGLANG_HEALTH_CHECK_TIMEOUT (default 20 s); health timeouts must exceed both.
SGLANG_HEALTH_MIN_S = 1.0
SGLANG_HEALTH_CHECK_TIMEOUT_S = 20.0


class NoHealthyServerError(RuntimeError):
    """Every server failed or is down; the request was not answered."""


class ServerError(RuntimeError):
    """A server answered with a non-retryable error (4xx, bad JSON)."""


class ReadTimeout(TimeoutError):
    """Connected, but no (complete) answer within the read timeout: the server may be busy."""


class ServerSilent(ConnectionError):
    """Connected, no answer yet, and the server does not answer its liveness check either."""


class _Retryable(Exception):
    def __init__(self, message: str, *, mark_down: bool = True) -> None:
        super().__init__(message)
        self.mark_down = mark_down


@dataclasses.dataclass(kw_only=True, slots=True)
class HttpPoolConfig:
    """Timeouts (seconds) and the retry policy of `HttpPool`.

    ``request_timeout_s``: read timeout of ``/generate`` and control calls; None (the default)
    waits as long as the server takes (generations can be long; a dead server is still noticed
    through a refused or reset connection). ``health_timeout_s``: one ``/health`` probe, > 20 s
    (SGLang's own health-check timeout). ``flush_timeout_s``: how long `HttpPool.flush_cache`
    waits for a server to become idle. ``liveness_interval_s``: a request without a read timeout
    checks its server's ``/model_info`` after every this many seconds without an answer (see the
    module docstring); None: no check (a stalled server is waited for forever).
    """

    urls: tuple[str, ...]
    connect_timeout_s: float = 5.0
    request_timeout_s: float | None = None
    max_attempts: int = 4
    backoff_s: float = 0.2
    backoff_max_s: float = 5.0
    down_s: float = 10.0
    health_timeout_s: float = 30.0
    flush_timeout_s: float = 120.0
    liveness_interval_s: float | None = 30.0

    def __post_init__(self) -> None:
        self.urls = tuple(self.urls)
        if not self.urls:
            raise ValueError("HttpPoolConfig.urls=(): give at least one server or router URL")
        for url in self.urls:
            check_url(url, "HttpPoolConfig.urls")
        for name in ("connect_timeout_s", "health_timeout_s", "flush_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HttpPoolConfig.{name}={getattr(self, name)!r}: must be > 0")
        if self.request_timeout_s is not None and self.request_timeout_s <= 0:
            raise ValueError(
                f"HttpPoolConfig.request_timeout_s={self.request_timeout_s!r}: must be > 0, or "
                "None for no read timeout"
            )
        if self.liveness_interval_s is not None and not self.liveness_interval_s > 0:
            raise ValueError(
                f"HttpPoolConfig.liveness_interval_s={self.liveness_interval_s!r}: must be > 0 "
                "seconds, or None for no liveness check"
            )
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"HttpPoolConfig.max_attempts={self.max_attempts!r}: must be >= 1")
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(
                f"HttpPoolConfig.backoff_s={self.backoff_s!r}, backoff_max_s="
                f"{self.backoff_max_s!r}: need 0 <= backoff_s <= backoff_max_s"
            )


def check_url(url: str, where: str) -> None:
    parsed = urllib.parse.urlparse(url)
    if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
        raise ValueError(
            f"{where} holds {url!r}: use 'http://host:port' (https is not supported by this client)"
        )


def request_json(
    url: str,
    method: str,
    path: str,
    payload: object | None,
    *,
    timeout_s: float | None,
    connect_timeout_s: float | None = None,
    liveness_s: float | None = None,
    still_alive: Callable[[], None] | None = None,
) -> tuple[int, object]:
    """One HTTP request; returns (status, decoded JSON or text).

    ``connect_timeout_s`` bounds the TCP connect (default: ``timeout_s``); ``timeout_s`` bounds
    each read after it (None: no read timeout). Without a read timeout, ``still_alive()`` (when
    given) runs after every ``liveness_s`` seconds without the answer's first byte; it raises
    (e.g. `ServerSilent`) to give up. Raises OSError-family errors; a timeout after the
    connection was made is a `ReadTimeout`.
    """
    parsed = urllib.parse.urlparse(url)
    connect = connect_timeout_s if connect_timeout_s is not None else timeout_s
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=connect)
    try:
        conn.connect()
        conn.sock.settimeout(timeout_s)
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        try:
            conn.request(method, path, body=body, headers=headers)
            if timeout_s is None and liveness_s is not None and still_alive is not None:
                _await_answer(conn.sock, liveness_s, still_alive)
            response = conn.getresponse()
            raw = response.read()
        except TimeoutError as err:
            raise ReadTimeout(f"no answer within {timeout_s} s") from err
    finally:
        conn.close()
    text = raw.decode("utf-8", errors="replace")
    try:
        return response.status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return response.status, text


def _await_answer(sock: socket.socket, every_s: float, still_alive: Callable[[], None]) -> None:
    """Block until the answer's first byte is there (or the peer closed), calling
    ``still_alive()`` after every ``every_s`` seconds of silence."""
    sock.settimeout(every_s)
    try:
        while True:
            try:
                sock.recv(1, socket.MSG_PEEK)  # b"" when closed: getresponse reports it
                return
            except TimeoutError:
                still_alive()
    finally:
        sock.settimeout(None)


class HttpPool:
    """Thread-safe: requests from many threads share the health state."""

    def __init__(self, config: HttpPoolConfig) -> None:
        self.config = config
        self._down_until = dict.fromkeys(config.urls, 0.0)
        self._in_flight = dict.fromkeys(config.urls, 0)
        self._dropped: dict[str, str] = {}  # url -> why (out of the pool until `admit`)
        self._info_paths: dict[tuple[str, str], str] = {}  # (url, route) -> path served
        self._lock = threading.Lock()
        self._liveness = dict.fromkeys(config.urls, (-math.inf, True))  # url -> (when, verdict)
        self._liveness_locks = {u: threading.Lock() for u in config.urls}
        self.retries = 0  # requests re-sent after a failure (for metrics and tests)
        self.liveness_checks = 0  # `_alive_now` checks sent (for tests)

    # ------------------------------------------------------------------ health
    def probe(self, url: str) -> bool:
        """GET /health on ``url`` (SGLang: a one-token generation, >= 1 s); marks it up or down."""
        try:
            status, _ = request_json(
                url,
                "GET",
                "/health",
                None,
                timeout_s=self.config.health_timeout_s,
                connect_timeout_s=self.config.connect_timeout_s,
            )
        except (OSError, http.client.HTTPException):
            status = 0
        with self._lock:
            self._down_until[url] = 0.0 if status == 200 else time.monotonic() + self.config.down_s
        return status == 200

    def alive(self, url: str) -> bool:
        """Whether ``url`` answers `model_info` within ``health_timeout_s``: a liveness check
        that, unlike SGLang's ``/health``, answers while generation is paused (SGLang 0.5.23's
        ``/health`` waits on the tokenizer manager's pause and answers 503 after 20 s).
        Does not mark the server up or down."""
        try:
            self.model_info(url, timeout_s=self.config.health_timeout_s)
        except RuntimeError:
            return False
        return True

    def _alive_now(self, url: str) -> bool:
        """`alive`, for requests waiting on ``url``: one check at a time per server, and a
        verdict younger than ``liveness_interval_s`` is reused instead of asking again."""
        with self._liveness_locks[url]:
            checked_at, verdict = self._liveness[url]
            if time.monotonic() - checked_at < (self.config.liveness_interval_s or 0.0):
                return verdict
            self.liveness_checks += 1
            verdict = self.alive(url)
            self._liveness[url] = (time.monotonic(), verdict)
            return verdict

    def _still_alive(self, url: str) -> Callable[[], None]:
        def check() -> None:
            if not self._alive_now(url):
                raise ServerSilent(
                    f"no answer for {self.config.liveness_interval_s} s and /model_info "
                    f"unanswered within {self.config.health_timeout_s} s"
                )

        return check

    def alive_all(self, urls: Sequence[str]) -> list[str]:
        """`alive` on every url at once; the live ones, in order."""
        return self.each(self.alive, urls)

    def model_info(self, url: str, *, timeout_s: float | None = None) -> dict:
        """``GET /model_info`` (``/get_model_info``, its deprecated alias, where that answers
        404, as on older releases); the decoded answer. RuntimeError when neither answers."""
        return self._info(url, "model_info", timeout_s)

    def server_info(self, url: str, *, timeout_s: float | None = None) -> dict:
        """``GET /server_info`` (``/get_server_info`` where that answers 404); the answer."""
        return self._info(url, "server_info", timeout_s)

    def _info(self, url: str, route: str, timeout_s: float | None) -> dict:
        """``/{route}``, else ``/get_{route}``; the path that answered is remembered per
        server and route."""
        known = self._info_paths.get((url, route))
        last: Exception | None = None
        for path in (known,) if known else (f"/{route}", f"/get_{route}"):
            try:
                answer = self.call_on(url, "GET", path, None, timeout_s=timeout_s)
            except ServerError as err:
                if "HTTP 404" not in str(err):
                    raise
                last = err
                continue
            self._info_paths[(url, route)] = path
            return answer if isinstance(answer, dict) else {}
        raise ServerError(f"{url}: neither /{route} nor /get_{route} is served ({last})")

    def probe_all(self, urls: Sequence[str] | None = None) -> list[str]:
        """`probe` every url at once (each takes >= 1 s on SGLang); the healthy ones, in order."""
        return self.each(self.probe, self.config.urls if urls is None else urls)

    @staticmethod
    def each(check: Callable[[str], bool], urls: Sequence[str]) -> list[str]:
        """``check`` on every url at once (one thread each); those it passed, in order."""
        urls = list(urls)
        if len(urls) <= 1:
            return [u for u in urls if check(u)]
        with ThreadPoolExecutor(max_workers=len(urls)) as threads:
            ok = list(threads.map(check, urls))
        return [u for u, up in zip(urls, ok, strict=True) if up]

    def healthy_urls(self) -> list[str]:
        """Members not marked down, in order."""
        now = time.monotonic()
        with self._lock:
            return [
                u for u in self.config.urls if self._down_until[u] <= now and u not in self._dropped
            ]

    # ------------------------------------------------------------------ membership
    def members(self) -> list[str]:
        """The servers in the pool (not dropped), in order; some may be marked down."""
        with self._lock:
            return [u for u in self.config.urls if u not in self._dropped]

    def dropped(self) -> dict[str, str]:
        """Dropped servers and why."""
        with self._lock:
            return dict(self._dropped)

    def drop(self, url: str, why: str) -> bool:
        """Take ``url`` out of the pool until `admit`; False if it was already out."""
        with self._lock:
            if url in self._dropped:
                return False
            self._dropped[url] = why
        logger.warning("server %s dropped from the pool: %s", url, why)
        return True

    def admit(self, url: str) -> bool:
        """Put a dropped ``url`` back into the pool (up); False if it was a member."""
        with self._lock:
            if self._dropped.pop(url, None) is None:
                return False
            self._down_until[url] = 0.0
        logger.warning("server %s rejoined the pool", url)
        return True

    def _mark_down(self, url: str, why: str) -> None:
        logger.warning("server %s marked down for %.0f s: %s", url, self.config.down_s, why)
        with self._lock:
            self._down_until[url] = time.monotonic() + self.config.down_s

    def _pick(self, avoid: str | None, choose: Callable[[list[str]], str] | None = None) -> str:
        candidates = self.healthy_urls()
        if not candidates:
            members = self.members()
            if not members:
                raise NoHealthyServerError(
                    f"no rollout server left in the pool: all of {list(self.config.urls)} were "
                    f"dropped ({self.dropped()})"
                )
            candidates = [u for u in self.probe_all(members) if u not in self.dropped()]
        if not candidates:
            raise NoHealthyServerError(
                f"no healthy rollout server among {self.members()} (all failed /health)"
            )
        if avoid in candidates and len(candidates) > 1:
            candidates.remove(avoid)
        url = choose(candidates) if choose is not None else None
        if url is not None and url not in candidates:
            raise RuntimeError(f"choose picked {url}, which is not among {candidates}")
        with self._lock:
            if url is None:
                url = min(candidates, key=lambda u: self._in_flight[u])
            self._in_flight[url] += 1
        return url

    # ------------------------------------------------------------------ requests
    def post(
        self,
        path: str,
        payload: object,
        *,
        what: str = "request",
        on_timeout: Callable[[str, object], None] | None = None,
        choose: Callable[[list[str]], str] | None = None,
    ) -> object:
        """POST to one healthy server, retrying and failing over; returns the decoded answer."""
        return self.call("POST", path, payload, what=what, on_timeout=on_timeout, choose=choose)

    def call(
        self,
        method: str,
        path: str,
        payload: object | None,
        *,
        what: str,
        on_timeout: Callable[[str, object], None] | None = None,
        choose: Callable[[list[str]], str] | None = None,
    ) -> object:
        """``payload`` may be a callable: called once per attempt (e.g. for a fresh request id);
        an exception it raises ends the call (e.g. the batch was cancelled). ``on_timeout(url,
        payload)`` runs after a read timeout, before the retry (e.g. to abort that request).
        ``choose(candidates)`` picks each attempt's server among the healthy members (less the
        one the previous attempt failed on, when another is left) instead of the least loaded
        (`prompt_affinity.PromptAffinity`: a prompt's samples on one server)."""
        last_error = "no attempt"
        url = None
        for attempt in range(self.config.max_attempts):
            if attempt:
                self.retries += 1
                delay = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** (attempt - 1))
                time.sleep(delay)
            url = self._pick(avoid=url, choose=choose)
            body = None
            try:
                body = payload() if callable(payload) else payload
                return self._once(url, method, path, body)
            except _Retryable as err:
                last_error = f"{url}: {err}"
                if err.mark_down:
                    self._mark_down(url, str(err))
                else:
                    logger.warning("%s on %s: %s; retrying elsewhere", what, url, err)
                    if on_timeout is not None:
                        try:
                            on_timeout(url, body)
                        except Exception as hook_err:  # best effort: the retry matters more
                            logger.warning("on_timeout for %s failed: %s", url, hook_err)
            finally:
                with self._lock:
                    self._in_flight[url] -= 1
        raise NoHealthyServerError(
            f"{what} failed after {self.config.max_attempts} attempts; last error {last_error}"
        )

    def call_on(
        self,
        url: str,
        method: str,
        path: str,
        payload: object | None,
        *,
        timeout_s: float | None = None,
    ) -> object:
        """One request to a specific server (control calls), no retry; errors are RuntimeError.

        ``timeout_s``: the read timeout (default ``request_timeout_s``).
        """
        try:
            return self._once(url, method, path, payload, timeout_s=timeout_s)
        except _Retryable as err:
            raise RuntimeError(f"{method} {url}{path} failed: {err}") from err

    def flush_cache(self, url: str, timeout_s: float | None = None) -> None:
        """``/flush_cache`` on ``url``, waiting up to ``timeout_s`` (default ``flush_timeout_s``)
        for the server to be idle.

        SGLang answers 400 (plain text) while requests are running or queued, or while another
        flush is pending; its ``timeout`` query parameter (seconds, >= 0) makes the server wait
        for idle itself. Each attempt passes the time left; a 400 is retried until the deadline.
        Raises RuntimeError when the server is still busy then, or on any other error.
        """
        budget = self.config.flush_timeout_s if timeout_s is None else timeout_s
        deadline = time.monotonic() + budget
        while True:
            left = max(0.0, deadline - time.monotonic())
            path = f"/flush_cache?timeout={left:.3f}"
            try:
                status, body = self._request(
                    url, "POST", path, None, timeout_s=left + self.config.health_timeout_s
                )
            except _Retryable as err:
                raise RuntimeError(f"POST {url}/flush_cache failed: {err}") from err
            if status == 200:
                return
            if status != 400:
                raise ServerError(f"POST {url}{path}: HTTP {status}: {str(body)[:500]}")
            if time.monotonic() >= deadline:
                raise RuntimeError(
                    f"{url}/flush_cache: the server was not idle within {budget} s "
                    f"(HTTP 400: {str(body).strip()[:300]})"
                )
            time.sleep(min(self.config.backoff_s, max(0.0, deadline - time.monotonic())))

    def _request(
        self, url: str, method: str, path: str, payload: object | None, *, timeout_s: float | None
    ) -> tuple[int, object]:
        try:
            status, body = request_json(
                url,
                method,
                path,
                payload,
                timeout_s=timeout_s,
                connect_timeout_s=self.config.connect_timeout_s,
                liveness_s=self.config.liveness_interval_s,
                still_alive=self._still_alive(url) if url in self._liveness_locks else None,
            )
        except ReadTimeout as err:
            raise _Retryable(f"read timed out after {timeout_s} s", mark_down=False) from err
        except (OSError, http.client.HTTPException) as err:
            raise _Retryable(f"{type(err).__name__}: {err}") from err
        if status >= 500:
            raise _Retryable(f"HTTP {status}: {str(body)[:200]}")
        return status, body

    def _once(
        self,
        url: str,
        method: str,
        path: str,
        payload: object | None,
        *,
        timeout_s: float | None = None,
    ) -> object:
        timeout = self.config.request_timeout_s if timeout_s is None else timeout_s
        status, body = self._request(url, method, path, payload, timeout_s=timeout)
        if status >= 400:
            raise ServerError(f"{method} {url}{path}: HTTP {status}: {str(body)[:500]}")
        return body
