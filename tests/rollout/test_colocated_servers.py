"""Colocated servers (``SGLangEngineConfig.colocated``, the trainer's ``--colocate``): which
servers each rank checks for its handles, and a server failure that stops the run instead of
dropping the server (loopback stand-ins; the trainer-level runs are in
``test_colocated_cluster.py``)."""

from __future__ import annotations

import pytest
from rollout_testing import checkpoint_tensors, make_engine, random_hf_model, tiny_config

from megatron_rl.rollout.http_pool import HttpPoolConfig
from megatron_rl.rollout.server_hosts import handle_servers
from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig
from megatron_rl.rollout.weight_sync import ReprobeConfig, WeightSyncConfig, WeightSyncError

URLS = tuple(f"http://node{i}:30000" for i in range(4))


def test_a_colocated_rank_hands_its_handles_to_the_server_on_its_own_gpus_only():
    # 4 nodes x 8 GPUs, one TP-8 server per node: rank g loads server g // 8
    assert handle_servers(URLS, rank=0, engine_ranks=8, colocated=True) == [URLS[0]]
    assert handle_servers(URLS, rank=13, engine_ranks=8, colocated=True) == [URLS[1]]
    assert handle_servers(URLS, rank=31, engine_ranks=8, colocated=True) == [URLS[3]]
    assert handle_servers(URLS, rank=32, engine_ranks=8, colocated=True) == []  # HandleLink's


def test_without_colocation_rank_0_hands_every_server_its_handles_and_no_other_rank_does():
    assert handle_servers(URLS, rank=0, engine_ranks=8, colocated=False) == list(URLS)
    assert handle_servers(URLS, rank=5, engine_ranks=8, colocated=False) == []


def _config(urls, **kwargs) -> SGLangEngineConfig:
    return SGLangEngineConfig.from_hf_config(
        tiny_config(),
        http=HttpPoolConfig(urls=tuple(urls), request_timeout_s=30.0, backoff_s=0.01),
        sync=WeightSyncConfig(transport="tensor", bucket_bytes=64 * 1024, failure_timeout_s=15.0),
        reprobe=ReprobeConfig(interval_s=0.01, max_interval_s=0.02),
        **kwargs,
    )


def test_colocated_servers_take_no_router():
    with pytest.raises(ValueError, match=r"--sglang-router-url with --colocate"):
        _config(URLS, colocated=True, router_url="http://router:8000")


def test_a_colocated_sync_that_a_server_fails_stops_the_run_and_drops_nobody(servers, tmp_path):
    """Not colocated, the failing server would be dropped and re-probed while the run goes on;
    colocated, the sync fails naming --colocate, the pool keeps both, and no probe is sent."""
    weights = checkpoint_tensors(random_hf_model(tiny_config(), seed=1), tmp_path)
    a, b = (servers(1, engine=make_engine(seed=0))[0] for _ in range(2))
    with SGLangEngine(_config([a.url, b.url], colocated=True)) as client:
        client.update_weights(iter(weights), version=0)
        b.before_request = lambda path, payload: "503"
        with pytest.raises(WeightSyncError, match=r"--colocate: .*needs every server") as err:
            client.update_weights(iter(weights), version=1)
        assert b.url in str(err.value)
        assert client.workers.dropped() == {}  # nothing dropped, so nothing to re-probe
        assert client.weight_sync.reprobe.probes_started == 0
        assert client.weight_version == 0
