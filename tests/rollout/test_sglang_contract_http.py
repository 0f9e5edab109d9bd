"""The HTTP client and the loopback stand-in against SGLang 0.5.23's own handlers (read, not run).

``sglang`` is installed without its dependencies, so the handlers' source is parsed
(`sglang_source`): the ``/health`` sleep and health-check timeout, the ``/flush_cache`` query
parameter and its 400, the ``AbortReq`` fields, the weight-update failure status, and the routes
the pinned ``sglang-router`` serves. Each check ties a constant or behaviour of this project to
that text, so an SGLang upgrade that changes it fails here.
"""

from __future__ import annotations

import ast
import importlib.util
import re
import threading
import time
from pathlib import Path

import pytest
from sglang_source import dataclass_fields, sglang_path

from megatron_rl.rollout import launch
from megatron_rl.rollout.http_pool import (
    SGLANG_HEALTH_CHECK_TIMEOUT_S,
    SGLANG_HEALTH_MIN_S,
    HttpPool,
    HttpPoolConfig,
    request_json,
)

HTTP_SERVER = "srt/entrypoints/http_server.py"
IO_STRUCT = "srt/managers/io_struct.py"


def _handler(name: str) -> ast.AsyncFunctionDef:
    tree = ast.parse(sglang_path(HTTP_SERVER).read_text(encoding="utf-8"))
    for node in tree.body:
        if isinstance(node, ast.AsyncFunctionDef) and node.name == name:
            return node
    raise AssertionError(f"{name} is no longer a handler in sglang/{HTTP_SERVER}")


def _routes(node) -> set[str]:
    return {
        d.args[0].value
        for d in node.decorator_list
        if isinstance(d, ast.Call) and d.args and isinstance(d.args[0], ast.Constant)
    }


def test_health_timeouts_allow_sglangs_health_handler():
    """SGLang's /health generates one token and sleeps 1 s before its first check, answering
    503 only after HEALTH_CHECK_TIMEOUT (20 s): every health timeout here must exceed that."""
    handler = _handler("health_generate")
    assert {"/health", "/health_generate"} <= _routes(handler)
    sleeps = [
        n.args[0].value
        for n in ast.walk(handler)
        if isinstance(n, ast.Call)
        and ast.unparse(n.func) == "asyncio.sleep"
        and isinstance(n.args[0], ast.Constant)
    ]
    assert sleeps and sleeps[0] == SGLANG_HEALTH_MIN_S
    text = sglang_path(HTTP_SERVER).read_text(encoding="utf-8")
    env = r'HEALTH_CHECK_TIMEOUT = int\(os\.getenv\("SGLANG_HEALTH_CHECK_TIMEOUT", (\d+)\)'
    match = re.search(env, text)
    assert match and float(match.group(1)) == SGLANG_HEALTH_CHECK_TIMEOUT_S
    assert "max_new_tokens" in ast.unparse(handler)  # the one-token generation
    assert HttpPoolConfig(urls=("http://h:1",)).health_timeout_s > SGLANG_HEALTH_CHECK_TIMEOUT_S
    assert launch.DEFAULT_PROBE_TIMEOUT_S > SGLANG_HEALTH_CHECK_TIMEOUT_S
    # the stand-in sleeps likewise by default
    loopback = Path(__file__).parents[2] / "megatron_rl/testing/loopback_server.py"
    assert "self.health_delay_s = 1.0" in loopback.read_text(encoding="utf-8")


@pytest.mark.slow
def test_pool_and_launch_see_a_server_whose_health_takes_seconds(servers):
    """The old 2 s pool probe and 1 s launch probe both call this server dead."""
    (server,) = servers(1)
    server.health_delay_s = 2.5  # a loaded SGLang: the 1 s sleep plus a slow first token
    assert HttpPool(HttpPoolConfig(urls=(server.url,))).probe(server.url)
    assert launch.wait_healthy(server.url, timeout_s=20.0) < 20.0


def test_flush_cache_uses_sglangs_timeout_query_and_retries_its_400(servers):
    handler = _handler("flush_cache")
    (timeout,) = [a for a in handler.args.args if a.arg == "timeout"]
    defaults = dict(zip(handler.args.args[::-1], handler.args.defaults[::-1], strict=False))
    default = defaults[timeout]
    assert ast.unparse(default) == "Query(0.0, ge=0.0)"  # seconds to wait for idle, default 0
    assert "HTTPStatus.BAD_REQUEST" in ast.unparse(handler)  # not idle: 400, plain text
    assert "timeout_s" in dataclass_fields(IO_STRUCT, "FlushCacheReqInput")

    (server,) = servers(1)
    server.stall_s = 1.5  # one /generate keeps the server busy for 1.5 s
    server.before_request = lambda path, payload: "stall" if path == "/generate" else None
    busy = threading.Thread(
        target=request_json,
        args=(
            server.url,
            "POST",
            "/generate",
            {"input_ids": [1, 2], "sampling_params": {"max_new_tokens": 1}},
        ),
        kwargs={"timeout_s": 30.0},
    )
    busy.start()
    try:
        while not server._running:
            time.sleep(0.01)
        assert request_json(server.url, "POST", "/flush_cache", None, timeout_s=5.0)[0] == 400
        pool = HttpPool(HttpPoolConfig(urls=(server.url,), flush_timeout_s=0.3, backoff_s=0.05))
        with pytest.raises(RuntimeError, match=r"not idle within 0\.3 s"):
            pool.flush_cache(server.url)
        pool.flush_cache(server.url, timeout_s=20.0)  # waits for idle, then 200
    finally:
        busy.join()
    status, body = request_json(server.url, "POST", "/flush_cache?timeout=0", None, timeout_s=5.0)
    assert status == 200 and isinstance(body, str) and body.startswith("Cache flushed.")


def test_abort_request_fields_are_sglangs():
    fields = {*dataclass_fields(IO_STRUCT, "BaseReq"), *dataclass_fields(IO_STRUCT, "AbortReq")}
    assert {"rid", "abort_all"} <= fields
    handler = _handler("abort_request")
    assert "obj.rid" in ast.unparse(handler) and "obj.abort_all" in ast.unparse(handler)


def test_weight_update_failures_are_http_400_like_sglangs(servers, tmp_path):
    for name in ("update_weights_from_disk", "update_weights_from_tensor", "update_weight_version"):
        assert "BAD_REQUEST" in ast.unparse(_handler(name)), name
    (server,) = servers(1)
    status, body = request_json(
        server.url, "POST", "/update_weights_from_disk",
        {"model_path": str(tmp_path / "missing")}, timeout_s=10.0,
    )  # fmt: skip
    assert status == 400 and body["success"] is False
    status, body = request_json(
        server.url, "POST", "/update_weight_version", {"new_version": "x"}, timeout_s=10.0
    )
    assert status == 400 and body["success"] is False
    status, body = request_json(server.url, "POST", "/pause_generation", {}, timeout_s=10.0)
    assert status == 200 and body["status"] == "ok"  # SGLang's answer
    request_json(server.url, "POST", "/continue_generation", {}, timeout_s=10.0)


CONTROL_ROUTES = {
    "/pause_generation",
    "/continue_generation",
    "/abort_request",
    "/init_weights_update_group",
    "/update_weights_from_distributed",
    "/update_weights_from_tensor",
    "/update_weights_from_disk",
    "/update_weight_version",
    "/destroy_weights_update_group",
}


def router_routes() -> set[str]:
    """The routes of the pinned sglang-router's Python load balancer (the Rust router's are the
    same set for these paths: ``/generate``, ``/health``, ``/flush_cache``, ``/get_model_info``)."""
    spec = importlib.util.find_spec("sglang_router")
    assert spec is not None and spec.submodule_search_locations
    path = Path(next(iter(spec.submodule_search_locations))) / "mini_lb.py"
    tree = ast.parse(path.read_text(encoding="utf-8"))
    return {r for n in ast.walk(tree) if isinstance(n, ast.AsyncFunctionDef) for r in _routes(n)}


def test_the_router_serves_generation_but_no_control_route():
    routes = router_routes()
    assert {"/generate", "/health", "/flush_cache", "/get_model_info"} <= routes
    assert not routes & CONTROL_ROUTES
