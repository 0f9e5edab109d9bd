"""JSON over HTTP to a set of servers: timeouts, retries with backoff, failover, health.

Standard library only (``http.client``): one short-lived connection per request, so a request
that timed out or failed can never deliver a late answer into a retried slot.

Retried: connection errors (refused, reset, dropped mid-answer), timeouts, HTTP 5xx. Not
retried: HTTP 4xx and malformed JSON (a broken protocol; `RuntimeError`). A server that fails is
marked down for ``down_s`` seconds and the retry goes to another server; when every server is
down, the pool probes ``/health`` on each before giving up with `NoHealthyServerError`.
"""

from __future__ import annotations

import dataclasses
import http.client
import json
import logging
import threading
import time
import urllib.parse

logger = logging.getLogger(__name__)


class NoHealthyServerError(RuntimeError):
    """Every server failed or is down; the request was not answered."""


class ServerError(RuntimeError):
    """A server answered with a non-retryable error (4xx, bad JSON)."""


class _Retryable(Exception):
    pass


@dataclasses.dataclass(kw_only=True, slots=True)
class HttpPoolConfig:
    """Timeouts (seconds) and the retry policy of `HttpPool`."""

    urls: tuple[str, ...]
    connect_timeout_s: float = 5.0
    request_timeout_s: float = 600.0
    max_attempts: int = 4
    backoff_s: float = 0.2
    backoff_max_s: float = 5.0
    down_s: float = 10.0
    health_timeout_s: float = 2.0

    def __post_init__(self) -> None:
        self.urls = tuple(self.urls)
        if not self.urls:
            raise ValueError("HttpPoolConfig.urls=(): give at least one server or router URL")
        for url in self.urls:
            parsed = urllib.parse.urlparse(url)
            if parsed.scheme != "http" or not parsed.hostname or not parsed.port:
                raise ValueError(
                    f"HttpPoolConfig.urls holds {url!r}: use 'http://host:port' (https is not "
                    "supported by this client)"
                )
        for name in ("connect_timeout_s", "request_timeout_s", "health_timeout_s"):
            if getattr(self, name) <= 0:
                raise ValueError(f"HttpPoolConfig.{name}={getattr(self, name)!r}: must be > 0")
        if not isinstance(self.max_attempts, int) or self.max_attempts < 1:
            raise ValueError(f"HttpPoolConfig.max_attempts={self.max_attempts!r}: must be >= 1")
        if self.backoff_s < 0 or self.backoff_max_s < self.backoff_s:
            raise ValueError(
                f"HttpPoolConfig.backoff_s={self.backoff_s!r}, backoff_max_s="
                f"{self.backoff_max_s!r}: need 0 <= backoff_s <= backoff_max_s"
            )


def request_json(
    url: str, method: str, path: str, payload: object | None, *, timeout_s: float
) -> tuple[int, object]:
    """One HTTP request; returns (status, decoded JSON or text). Raises OSError-family errors."""
    parsed = urllib.parse.urlparse(url)
    conn = http.client.HTTPConnection(parsed.hostname, parsed.port, timeout=timeout_s)
    try:
        body = None if payload is None else json.dumps(payload).encode()
        headers = {"Content-Type": "application/json"} if body is not None else {}
        conn.request(method, path, body=body, headers=headers)
        response = conn.getresponse()
        raw = response.read()
    finally:
        conn.close()
    text = raw.decode("utf-8", errors="replace")
    try:
        return response.status, json.loads(text) if text else None
    except json.JSONDecodeError:
        return response.status, text


class HttpPool:
    """Thread-safe: requests from many threads share the health state."""

    def __init__(self, config: HttpPoolConfig) -> None:
        self.config = config
        self._down_until = dict.fromkeys(config.urls, 0.0)
        self._in_flight = dict.fromkeys(config.urls, 0)
        self._lock = threading.Lock()
        self.retries = 0  # requests re-sent after a failure (for metrics and tests)

    # ------------------------------------------------------------------ health
    def probe(self, url: str) -> bool:
        """GET /health on ``url``; marks it up or down."""
        try:
            status, _ = request_json(
                url, "GET", "/health", None, timeout_s=self.config.health_timeout_s
            )
        except (OSError, http.client.HTTPException):
            status = 0
        with self._lock:
            self._down_until[url] = 0.0 if status == 200 else time.monotonic() + self.config.down_s
        return status == 200

    def healthy_urls(self) -> list[str]:
        now = time.monotonic()
        with self._lock:
            return [u for u in self.config.urls if self._down_until[u] <= now]

    def _mark_down(self, url: str, why: str) -> None:
        logger.warning("server %s marked down for %.0f s: %s", url, self.config.down_s, why)
        with self._lock:
            self._down_until[url] = time.monotonic() + self.config.down_s

    def _pick(self, avoid: str | None) -> str:
        candidates = self.healthy_urls()
        if not candidates:
            candidates = [u for u in self.config.urls if self.probe(u)]
        if not candidates:
            raise NoHealthyServerError(
                f"no healthy rollout server among {list(self.config.urls)} (all failed /health)"
            )
        if avoid in candidates and len(candidates) > 1:
            candidates.remove(avoid)
        with self._lock:
            url = min(candidates, key=lambda u: self._in_flight[u])
            self._in_flight[url] += 1
        return url

    # ------------------------------------------------------------------ requests
    def post(self, path: str, payload: object, *, what: str = "request") -> object:
        """POST to one healthy server, retrying and failing over; returns the decoded answer."""
        return self.call("POST", path, payload, what=what)

    def call(self, method: str, path: str, payload: object | None, *, what: str) -> object:
        """``payload`` may be a callable: called once per attempt (e.g. for a fresh request id)."""
        last_error = "no attempt"
        url = None
        for attempt in range(self.config.max_attempts):
            if attempt:
                self.retries += 1
                delay = min(self.config.backoff_max_s, self.config.backoff_s * 2 ** (attempt - 1))
                time.sleep(delay)
            url = self._pick(avoid=url)
            try:
                body = payload() if callable(payload) else payload
                return self._once(url, method, path, body)
            except _Retryable as err:
                last_error = f"{url}: {err}"
                self._mark_down(url, str(err))
            finally:
                with self._lock:
                    self._in_flight[url] -= 1
        raise NoHealthyServerError(
            f"{what} failed after {self.config.max_attempts} attempts; last error {last_error}"
        )

    def call_on(self, url: str, method: str, path: str, payload: object | None) -> object:
        """One request to a specific server (control calls), no retry; errors are RuntimeError."""
        try:
            return self._once(url, method, path, payload)
        except _Retryable as err:
            raise RuntimeError(f"{method} {url}{path} failed: {err}") from err

    def _once(self, url: str, method: str, path: str, payload: object | None) -> object:
        timeout = max(self.config.connect_timeout_s, self.config.request_timeout_s)
        try:
            status, body = request_json(url, method, path, payload, timeout_s=timeout)
        except TimeoutError as err:
            raise _Retryable(f"timed out after {timeout} s") from err
        except (OSError, http.client.HTTPException) as err:
            raise _Retryable(f"{type(err).__name__}: {err}") from err
        if status >= 500:
            raise _Retryable(f"HTTP {status}: {str(body)[:200]}")
        if status >= 400:
            raise ServerError(f"{method} {url}{path}: HTTP {status}: {str(body)[:500]}")
        return body
