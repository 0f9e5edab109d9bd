"""A stalled server (accepts connections, never answers) costs its drop once, then nothing.

Loopback servers with the "hang" fault (`LoopbackServer.release_hung` ends it), driven like the
trainer drives its engine: the first sync, then per step generate, sync, membership metrics.
Nothing here passes or fails on a wall-clock threshold: that no step waits on the stalled server
is shown by counts (the requests it received, the probes sent, one probe still in flight while
the steps run); the step-time ratio against a run with only the healthy server is measured and
reported.
"""

from __future__ import annotations

import logging
import statistics
import threading
import time
from concurrent.futures import ThreadPoolExecutor

import pytest
from rollout_testing import (
    PROMPTS,
    checkpoint_tensors,
    make_engine,
    random_hf_model,
    tiny_config,
    wait_for,
)

from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.build import build_engine
from megatron_rl.rollout.engine_config import EngineConfig
from megatron_rl.rollout.http_pool import HttpPoolConfig
from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig
from megatron_rl.rollout.weight_sync import ReprobeConfig, WeightSyncConfig
from megatron_rl.rollout.weight_sync.reprobe import Reprober

PARAMS = SamplingParams(max_new_tokens=2, seed=3)
KEYS = {
    "rollout/servers_up",
    "rollout/servers_out",
    "rollout/servers_dropped",
    "rollout/servers_rejoined",
    "weight_sync/seconds",
    "weight_sync/mb",
}
NUM_STEPS = 5


def hang(path, payload):
    return "hang"


@pytest.fixture(scope="module")
def weights(tmp_path_factory):
    return checkpoint_tensors(random_hf_model(tiny_config(), seed=1), tmp_path_factory.mktemp("w"))


def start(servers, count):
    started = [servers(1, engine=make_engine(seed=0))[0] for _ in range(count)]
    for server in started:
        server.health_delay_s = 0.0  # SGLang's 1 s /health sleep only slows the rejoin tests
    return started


def client_for(servers, *, health_timeout_s=600.0, **http) -> SGLangEngine:
    config = SGLangEngineConfig.from_hf_config(
        tiny_config(),
        http=HttpPoolConfig(
            urls=tuple(s.url for s in servers),
            backoff_s=0.01,
            down_s=0.3,
            health_timeout_s=health_timeout_s,
            **http,
        ),
        sync=WeightSyncConfig(transport="tensor", bucket_bytes=64 * 1024, failure_timeout_s=5.0),
        reprobe=ReprobeConfig(interval_s=0.05, max_interval_s=0.2),
    )
    return SGLangEngine(config)


def step(client, weights, version) -> tuple[float, dict[str, float]]:
    """One trainer step's engine calls: generate, push the new weights, read the metrics."""
    begin = time.perf_counter()
    samples = client.generate(PROMPTS, PARAMS)
    client.update_weights(iter(weights), version=version)
    metrics = client.membership_metrics()
    assert len(samples) == len(PROMPTS)
    return time.perf_counter() - begin, metrics


def drop_the_stalled_one(client, weights, stalled) -> None:
    """The first sync (as the trainer's): the stalled server misses its pause and is dropped."""
    client.update_weights(iter(weights), version=0)
    assert list(client.workers.dropped()) == [stalled.url]
    assert client.membership_metrics()["rollout/servers_out"] == 1.0


@pytest.mark.slow
def test_steps_beside_a_stalled_server_never_wait_on_it(servers, weights, caplog, record_property):
    healthy_only, up, stalled = start(servers, 3)
    stalled.before_request = hang
    with client_for([healthy_only]) as reference, client_for([up, stalled]) as client:
        reference.update_weights(iter(weights), version=0)
        drop_the_stalled_one(client, weights, stalled)
        # the background re-probe has reached the stalled server and hangs there (its timeout
        # is 600 s): every step below runs while it is in flight
        wait_for(lambda: "/health" in stalled.requests, "the first background re-probe")
        seen = len(stalled.requests)
        caplog.clear()
        caplog.set_level(logging.WARNING, logger="megatron_rl")
        times: dict[str, list[float]] = {"healthy": [], "stalled": []}
        for version in range(1, NUM_STEPS + 1):
            arms = [("healthy", reference), ("stalled", client)]
            for arm, engine in arms if version % 2 else arms[::-1]:  # interleaved, both orders
                took, metrics = step(engine, weights, version)
                times[arm].append(took)
                assert set(metrics) == KEYS  # the same keys every step, every arm
                out = 1.0 if arm == "stalled" else 0.0
                assert metrics["rollout/servers_out"] == out
                assert metrics["rollout/servers_up"] == 1.0
        assert stalled.requests[seen:] == []  # no generation, sync, probe or check reached it
        assert client.weight_sync.reprobe.probes_started == 1 and stalled.hung_now >= 1
        assert client.workers.dropped().keys() == {stalled.url}
        assert [r for r in caplog.records if r.levelno >= logging.WARNING] == []  # no news
    ratio = statistics.median(times["stalled"]) / statistics.median(times["healthy"])
    record_property("step_time_ratio_stalled_over_healthy", ratio)
    print(
        f"median step: healthy only {statistics.median(times['healthy']):.3f} s, beside a "
        f"stalled server {statistics.median(times['stalled']):.3f} s (ratio {ratio:.2f})"
    )


@pytest.mark.slow
def test_a_stalled_server_rejoins_after_a_full_sync_once_it_answers(servers, weights, caplog):
    up, stalled = start(servers, 2)
    stalled.before_request = hang
    with client_for([up, stalled], health_timeout_s=30.0) as client:
        caplog.set_level(logging.WARNING, logger="megatron_rl")
        drop_the_stalled_one(client, weights, stalled)
        assert sum("1 of 2 rollout servers out" in r.getMessage() for r in caplog.records) == 1
        _, metrics = step(client, weights, version=1)
        assert metrics["rollout/servers_out"] == 1.0 and stalled.engine.weight_version == 0
        stalled.before_request = None
        stalled.release_hung()  # the hung probe ends unanswered; a later one gets its answer
        wait_for(lambda: stalled.url in client.weight_sync.reprobe.ready(), "a probe answered")
        assert client.workers.dropped().keys() == {stalled.url}  # stale weights: not yet
        before = stalled.requests.count("/generate")
        client.generate(PROMPTS, PARAMS)
        assert stalled.requests.count("/generate") == before
        _, metrics = step(client, weights, version=2)  # the full sync takes it back
        assert client.workers.dropped() == {} and stalled.engine.weight_version == 2
        assert (
            metrics.items()
            >= {
                "rollout/servers_up": 2.0,
                "rollout/servers_out": 0.0,
                "rollout/servers_dropped": 1.0,
                "rollout/servers_rejoined": 1.0,
            }.items()
        )
        assert sum("in the pool again" in r.getMessage() for r in caplog.records) == 1
        samples = client.generate(PROMPTS * 4, PARAMS)
        assert {s.weight_version for s in samples} == {2}
        assert stalled.requests.count("/generate") > before


@pytest.mark.slow
def test_a_request_to_a_server_that_stalls_mid_run_is_retried_elsewhere(servers, weights):
    up, stalling = start(servers, 2)
    with client_for([up, stalling], health_timeout_s=10.0, liveness_interval_s=0.3) as client:
        client.update_weights(iter(weights), version=0)
        stalling.before_request = hang  # wedged after the sync: no generation timeout is set
        with ThreadPoolExecutor(1) as thread:  # a guard: a hang fails the test, not the run
            samples = thread.submit(client.generate, PROMPTS * 2, PARAMS).result(timeout=600)
        assert len(samples) == 2 * len(PROMPTS) and {s.weight_version for s in samples} == {0}
        assert "/generate" in stalling.requests and stalling.hung_now >= 1
        assert client.workers.liveness_checks >= 1 and client.workers.retries >= 1


def test_reprobe_waits_double_up_to_the_cap_and_a_blocked_probe_blocks_no_one():
    config = ReprobeConfig(interval_s=1.0, max_interval_s=5.0)
    assert [config.wait_s(k) for k in range(5)] == [1.0, 2.0, 4.0, 5.0, 5.0]
    with pytest.raises(ValueError, match="--sglang-reprobe-max-interval"):
        ReprobeConfig(interval_s=2.0, max_interval_s=1.0)
    answers = {"http://x:1": [], "http://y:2": []}
    release = threading.Event()

    def probe(url):
        answers[url].append(url)
        if url == "http://x:1":
            release.wait()  # a stalled server: the probe blocks until the test lets it go
            return False
        return len(answers[url]) >= 3  # answers on its third probe

    reprober = Reprober(probe, ReprobeConfig(interval_s=0.01, max_interval_s=0.04))
    try:
        reprober.watch("http://x:1")
        reprober.watch("http://y:2")
        wait_for(lambda: reprober.ready() == ["http://y:2"], "y answering its third probe")
        wait_for(lambda: answers["http://x:1"] != [], "x's first probe")
        assert len(answers["http://y:2"]) == 3 and len(answers["http://x:1"]) == 1
        reprober.retry("http://y:2")  # it failed its rejoining sync: probed again, backing off
        wait_for(lambda: reprober.ready() == ["http://y:2"], "y answering again")
        reprober.forget("http://y:2")
        assert reprober.ready() == [] and reprober.probes_started == 5
    finally:
        release.set()
        reprober.close()


def test_reprobe_and_liveness_flags_reach_the_client_and_bad_values_name_the_flag():
    config = EngineConfig(
        kind="sglang",
        sglang_url=("http://127.0.0.1:9",),
        sglang_reprobe_interval=2.0,
        sglang_reprobe_max_interval=8.0,
        sglang_liveness_interval=7.0,
        weight_sync_failure_timeout=4.0,
    )
    with build_engine(config, tiny_config(), pad_token_id=0, seed=0) as engine:  # no server call
        assert engine.config.reprobe == ReprobeConfig(interval_s=2.0, max_interval_s=8.0)
        assert engine.config.http.liveness_interval_s == 7.0
        assert engine.weight_sync.config.failure_timeout_s == 4.0
    for bad, flag in [
        ({"sglang_reprobe_interval": 0.0}, "--sglang-reprobe-interval"),
        ({"sglang_reprobe_max_interval": 1.0}, "--sglang-reprobe-max-interval"),
        ({"sglang_liveness_interval": -1.0}, "--sglang-liveness-interval"),
        ({"weight_sync_failure_timeout": float("nan")}, "--weight-sync-failure-timeout"),
    ]:
        with pytest.raises(ValueError, match=flag):
            EngineConfig(**bad)
