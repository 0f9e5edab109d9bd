"""``/release_memory_occupation`` and ``/resume_memory_occupation`` as SGLang 0.5.23 serves them
(tags, idle check, unreleased resume) through the client's `release_memory` / `resume_memory`,
and what the stand-in refuses where SGLang would die or run on freed memory."""

from __future__ import annotations

import threading

import pytest
from rollout_testing import PROMPTS, tiny_config
from sglang_source import sglang_path

from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.http_pool import HttpPoolConfig, request_json
from megatron_rl.rollout.memory_occupation import MEMORY_TAGS
from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig

PARAMS = SamplingParams(max_new_tokens=2, seed=3)


def _client(servers) -> SGLangEngine:
    http = HttpPoolConfig(urls=tuple(s.url for s in servers), request_timeout_s=10.0)
    return SGLangEngine(SGLangEngineConfig.from_hf_config(tiny_config(), http=http))


def _post(server, path: str, payload: object) -> tuple[int, object]:
    return request_json(server.url, "POST", path, payload, timeout_s=10.0)


def test_released_tags_are_sglangs_and_an_unreleased_resume_is_refused(servers):
    one, two = servers(2)
    with _client([one, two]) as client:
        client.release_memory()  # no tags: all three, on every server
        assert one.memory.released() == two.memory.released() == set(MEMORY_TAGS)
        client.resume_memory(["weights"])
        with pytest.raises(RuntimeError, match=r"not released.*KeyError"):
            client.resume_memory(["weights"])
        assert one.memory.released() == {"kv_cache", "cuda_graph"}  # nothing changed
        client.resume_memory(["kv_cache", "cuda_graph"])
        assert not one.memory.released() and not two.memory.released()
        assert len(client.generate(PROMPTS[:1], PARAMS, n=1)) == 1
        with pytest.raises(ValueError, match="unknown memory tags"):
            client.release_memory(["kv"])


def test_generation_health_and_weight_loads_are_refused_while_their_memory_is_released(servers):
    (server,) = servers(1)
    with _client([server]) as client:
        client.release_memory(["kv_cache"])
        with pytest.raises(RuntimeError, match=r"HTTP 400.*kv_cache"):
            client.generate(PROMPTS[:1], PARAMS, n=1)
        assert request_json(server.url, "GET", "/health", None, timeout_s=10.0)[0] == 503
        client.release_memory(["weights"])
        status, body = _post(server, "/update_weights_from_disk", {"model_path": "unused"})
        assert status == 400 and "weights" in body["message"]
        status, body = _post(server, "/weights_checksum", {"names": []})
        assert status == 400 and "released" in body["message"]
        client.resume_memory(["weights"])  # slime's order: weights, the update, then kv_cache
        assert _post(server, "/weights_checksum", {"names": []}) == (200, {})
        client.resume_memory(["kv_cache"])
        assert len(client.generate(PROMPTS[:1], PARAMS, n=1)) == 1


def _stalled_request(server) -> threading.Thread:
    """A ``/generate`` that runs on ``server`` until aborted (the stand-in's "stall" fault)."""
    server.stall_s = 120.0
    server.before_request = lambda path, payload: "stall" if path == "/generate" else None
    stalled = threading.Thread(
        target=_post, args=(server, "/generate", {"input_ids": PROMPTS[0]}), daemon=True
    )
    stalled.start()
    while not server._running:
        threading.Event().wait(0.01)
    return stalled


def test_the_stand_in_refuses_a_release_while_a_request_runs_unless_retract_paused(servers):
    """SGLang asserts an idle scheduler on a release (and dies); the stand-in answers 400."""
    (server,) = servers(1)
    stalled = _stalled_request(server)
    status, body = _post(server, "/release_memory_occupation", {"tags": ["kv_cache"]})
    assert status == 400 and "only when server is idle" in body["error"]["message"]
    assert not server.memory.released()
    _post(server, "/pause_generation", {"mode": "retract"})  # the request now waits
    assert _post(server, "/release_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    assert _post(server, "/resume_memory_occupation", {"tags": ["kv_cache"]})[0] == 200
    _post(server, "/continue_generation", {})
    _post(server, "/abort_request", {"abort_all": True})
    stalled.join(timeout=10.0)
    assert not stalled.is_alive()


def test_a_release_waits_until_the_running_request_ends(servers):
    """The client polls /flush_cache until the server is idle, then releases: the request
    running when the release was asked for ends first, and nothing is refused."""
    (server,) = servers(1)
    stalled = _stalled_request(server)
    errors: list[Exception] = []

    def release(client) -> None:
        try:
            client.release_memory(["kv_cache"])
        except RuntimeError as err:
            errors.append(err)

    with _client([server]) as client:
        releasing = threading.Thread(target=release, args=(client,))
        releasing.start()
        while "/flush_cache" not in server.requests and releasing.is_alive():
            threading.Event().wait(0.01)  # until the release waits for idle (or gave up)
        assert releasing.is_alive() and not errors and not server.memory.released(), errors
        _post(server, "/abort_request", {"abort_all": True})  # the running request ends
        releasing.join(timeout=60.0)
        assert not releasing.is_alive() and not errors, errors
        assert server.memory.released() == {"kv_cache"}
        assert server.requests.count("/release_memory_occupation") == 1  # never refused
    stalled.join(timeout=10.0)


def test_a_server_still_busy_after_the_flush_timeout_fails_the_release_untouched(servers):
    (server,) = servers(1)
    stalled = _stalled_request(server)
    http = HttpPoolConfig(urls=(server.url,), request_timeout_s=10.0, flush_timeout_s=0.2)
    client = SGLangEngine(SGLangEngineConfig.from_hf_config(tiny_config(), http=http))
    with client, pytest.raises(RuntimeError, match=r"not idle, so not released.*within 0.2 s"):
        client.release_memory(None)
    assert "/release_memory_occupation" not in server.requests
    assert not server.memory.released()
    _post(server, "/abort_request", {"abort_all": True})
    stalled.join(timeout=10.0)


def test_memory_calls_refuse_a_dropped_server_instead_of_skipping_it(servers):
    """A server out of the pool would keep its KV cache and weights on GPUs the trainer is
    about to take: the call names it and no server is touched."""
    one, two = servers(2)
    with _client([one, two]) as client:
        client.workers.drop(two.url, "test: failed a sync")
        with pytest.raises(RuntimeError, match=rf"servers \['{two.url}'\] left the pool"):
            client.release_memory(None)
        assert not one.memory.released() and not two.memory.released()
        with pytest.raises(RuntimeError, match="left the pool"):
            client.resume_memory(None)


def test_the_tags_and_the_idle_check_are_sglangs():
    constants = sglang_path("srt/constants.py").read_text()
    for tag in MEMORY_TAGS:
        assert f'"{tag}"' in constants
    updater = sglang_path("srt/managers/scheduler_components/weight_updater.py").read_text()
    assert "self.offload_tags.remove(tag)" in updater  # KeyError for an unreleased tag
    assert "ignore_waiting=scheduler is not None and scheduler._engine_paused" in updater
    assert "release_memory_occupation should be called only when server is idle." in updater
