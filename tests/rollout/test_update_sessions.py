"""Weight-update sessions, health during a pause, and start-up, against the loopback stand-in.

The stand-in refuses what SGLang 0.5.23 refuses (updates outside a session, a second begin,
``/health`` while paused); ``tests/rollout/test_real_sglang.py`` runs the same client against
the real server. Here: what the real server cannot be made to show on demand (a release without
sessions, a session left open by a dead trainer, an update failing midway, a slow start).
"""

from __future__ import annotations

import threading
import time

import pytest
import torch
from rollout_testing import PROMPTS, make_engine, tiny_config

from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.http_pool import HttpPool, HttpPoolConfig, request_json
from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig, check_same_host
from megatron_rl.rollout.weight_sync import WeightSyncConfig, WeightSyncError
from megatron_rl.testing.loopback_server import LoopbackServer

SESSION_TRANSPORTS = ("distributed", "tensor")


def tensors(engine, scale: float = 1.0):
    """The engine's own weights (HF names), scaled: a sync the server can load."""
    return [(n, p.detach().clone() * scale) for n, p in engine.model.named_parameters()]


def client_for(servers, transport: str, **config) -> SGLangEngine:
    return SGLangEngine(
        SGLangEngineConfig.from_hf_config(
            tiny_config(),
            http=HttpPoolConfig(urls=tuple(s.url for s in servers), backoff_s=0.01),
            sync=WeightSyncConfig(transport=transport, bucket_bytes=1 << 20),
            **config,
        )
    )


@pytest.mark.slow
@pytest.mark.parametrize("transport", SESSION_TRANSPORTS)
def test_every_sync_is_begin_transfer_end(servers, transport):
    shared_engine = make_engine()
    (server,) = servers(1, engine=shared_engine)
    with client_for([server], transport) as client:
        client.update_weights(tensors(shared_engine), version=1)
    paths = [p for p in server.requests if p.endswith("weight_update") or "from_" in p]
    assert paths[0] == "/begin_weight_update" and paths[-1] == "/end_weight_update"
    assert paths.count("/begin_weight_update") == paths.count("/end_weight_update") == 1
    assert not server._session_open and shared_engine.weight_version == 1


@pytest.mark.parametrize("transport", SESSION_TRANSPORTS)
def test_updates_outside_a_session_are_refused(servers, shared_engine, transport):
    """The stand-in answers as SGLang 0.5.23 does (what the old client ran into)."""
    (server,) = servers(1)
    path = f"/update_weights_from_{transport}"
    status, body = request_json(server.url, "POST", path, {"group_name": "g"}, timeout_s=10)
    assert status == 400 and body["success"] is False
    assert "must run between begin_weight_update() and end_weight_update()" in body["message"]
    assert request_json(server.url, "POST", "/begin_weight_update", {}, timeout_s=10)[0] == 200
    status, body = request_json(server.url, "POST", "/begin_weight_update", {}, timeout_s=10)
    assert status == 400 and "already open" in body["message"]


def test_servers_without_sessions_are_synced_without_them(servers, shared_engine):
    """An SGLang release before 0.5.21 answers 404 on /begin_weight_update: detected per
    server, its updates go out as before, beside a server that has sessions."""
    old, new = servers(2)
    old.sessions = False
    with client_for([old, new], "tensor") as client:
        for version in (1, 2):
            client.update_weights(tensors(shared_engine), version=version)
        assert client.weight_sync.sessions.has_sessions == {old.url: False, new.url: True}
    assert old.requests.count("/begin_weight_update") == 1  # asked once, remembered
    assert new.requests.count("/begin_weight_update") == 2
    assert old.requests.count("/update_weights_from_tensor") == 2


@pytest.mark.slow
@pytest.mark.parametrize("transport", SESSION_TRANSPORTS)
def test_a_sync_failing_midway_closes_its_session_and_the_next_succeeds(servers, transport):
    shared_engine = make_engine()
    (server,) = servers(1, engine=shared_engine)
    update = f"/update_weights_from_{transport}"
    calls = []

    def fail_second_bucket(path, payload):
        if path == update:
            calls.append(path)
            return "503" if len(calls) == 2 else None
        return None

    server.before_request = fail_second_bucket
    with client_for([server], transport) as client:
        client.weight_sync.config.bucket_bytes = 4096  # several buckets
        with pytest.raises(WeightSyncError):
            client.update_weights(tensors(shared_engine, 0.5), version=1)
        assert not server._session_open  # end ran in the finally
        assert shared_engine.weight_version == 0
        server.before_request = None
        client.weight_sync.pool.admit(server.url)  # rejoin (a restarted server would probe in)
        client.update_weights(tensors(shared_engine), version=2)
    assert shared_engine.weight_version == 2 and not server._session_open


def test_a_session_left_open_by_a_dead_trainer_is_closed_first(servers):
    shared_engine = make_engine()
    (server,) = servers(1, engine=shared_engine)
    request_json(server.url, "POST", "/begin_weight_update", {}, timeout_s=10)
    with client_for([server], "tensor") as client:
        client.update_weights(tensors(shared_engine), version=3)
    assert shared_engine.weight_version == 3 and not server._session_open


def test_health_waits_on_a_pause_but_the_liveness_probe_answers(servers):
    """SGLang's /health generates a token, which waits behind a pause (503 after its 20 s
    timeout): the sync's recovery path checks liveness with /model_info instead."""
    (server,) = servers(1)
    server.health_check_timeout_s = 0.5
    pool = HttpPool(HttpPoolConfig(urls=(server.url,), health_timeout_s=30.0))
    request_json(server.url, "POST", "/pause_generation", {}, timeout_s=10)
    assert not pool.probe(server.url)  # the old recovery path dropped healthy servers here
    assert pool.alive(server.url)
    request_json(server.url, "POST", "/continue_generation", {}, timeout_s=10)
    assert pool.probe(server.url)


def test_model_info_falls_back_to_the_deprecated_route(servers):
    (server,) = servers(1)
    original = server.handle
    server.handle = lambda path, payload: (
        (404, {"detail": "Not Found"}) if path == "/model_info" else original(path, payload)
    )
    pool = HttpPool(HttpPoolConfig(urls=(server.url,)))
    assert pool.model_info(server.url)["weight_version"] is not None
    assert pool.model_info(server.url) and server.requests.count("/model_info") == 1


@pytest.mark.slow
def test_the_client_waits_for_servers_that_start_late(shared_engine):
    """Servers listen only once their model is loaded: the first sync must not race them."""
    server = LoopbackServer(shared_engine)
    url = server.url
    server.httpd.server_close()  # the port is known but nothing listens yet
    started: list[LoopbackServer] = []

    def start_late():
        time.sleep(1.5)
        port = int(url.rsplit(":", 1)[1])
        started.append(LoopbackServer(shared_engine, port=port).start())

    thread = threading.Thread(target=start_late)
    thread.start()
    try:
        config = SGLangEngineConfig.from_hf_config(
            tiny_config(), http=HttpPoolConfig(urls=(url,), health_timeout_s=30.0)
        )
        with SGLangEngine(config) as client:
            waited = client.wait_until_ready(poll_s=0.2)
            assert waited >= 1.0
            params = SamplingParams(max_new_tokens=2, seed=1)
            assert len(client.generate(PROMPTS[:1], params)) == 1
    finally:
        thread.join()
        for s in started:
            s.stop()


def test_startup_timeout_names_the_flag_and_the_servers():
    config = SGLangEngineConfig.from_hf_config(
        tiny_config(),
        http=HttpPoolConfig(urls=("http://127.0.0.1:9",), connect_timeout_s=0.2),
        startup_timeout_s=0.5,
    )
    with SGLangEngine(config) as client, pytest.raises(RuntimeError) as err:
        client.wait_until_ready(poll_s=0.1)
    assert "--sglang-startup-timeout" in str(err.value) and "127.0.0.1:9" in str(err.value)


def test_a_tp_size_that_differs_from_engine_ranks_is_refused(servers):
    (server,) = servers(1)
    server.tp_size = 2
    with client_for([server], "distributed") as client, pytest.raises(ValueError) as err:
        client.wait_until_ready()
    assert "--sglang-engine-ranks 2" in str(err.value)


def test_tensor_transport_needs_servers_on_this_host():
    check_same_host("http://127.0.0.1:30000")
    check_same_host("http://localhost:30000")
    with pytest.raises(ValueError, match="--weight-sync-transport distributed"):
        check_same_host("http://192.0.2.7:30000")  # TEST-NET-1: never this host


def test_a_cuda_handle_the_server_cannot_open_names_the_distributed_transport(
    servers, shared_engine, monkeypatch
):
    """SGLang raises "Invalid device_uuid" for a CUDA IPC handle of a GPU it cannot see; the
    stand-in (no GPU at all) refuses every CUDA handle the same way."""
    from megatron_rl.rollout.weight_sync import tensor as tensor_transport

    (server,) = servers(1)

    def cuda_handle(obj):  # what a GPU trainer's pickle names (no GPU needed to write it)
        import base64
        import pickle

        from torch.multiprocessing import reductions

        class Handle:
            def __reduce__(self):
                return (reductions.rebuild_cuda_tensor, (torch.Tensor, (1,), (1,), 0))

        return base64.b64encode(pickle.dumps(Handle())).decode()

    monkeypatch.setattr(tensor_transport, "_serialize_shared", cuda_handle)
    with client_for([server], "tensor") as client, pytest.raises(WeightSyncError) as err:
        client.update_weights(tensors(shared_engine), version=1)
    assert "--weight-sync-transport distributed" in str(err.value)
    assert not server._session_open


def test_a_local_interface_is_this_host_even_when_the_hostname_resolves_to_127_0_1_1(monkeypatch):
    """Stock Debian/DGX-OS /etc/hosts maps the hostname to 127.0.1.1, while a cluster's node name
    resolves to the node's interface: the rank's own server must still be accepted."""
    import socket

    from megatron_rl.rollout import server_hosts

    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as probe:
        probe.connect(("192.0.2.7", 9))  # no packet is sent: picks the outgoing interface
        interface = probe.getsockname()[0]
    if interface.startswith("127."):
        pytest.skip("this machine has no non-loopback interface")
    real = socket.getaddrinfo
    only_loopback = [(socket.AF_INET, socket.SOCK_STREAM, 6, "", ("127.0.1.1", 0))]
    monkeypatch.setattr(
        socket,
        "getaddrinfo",
        lambda host, *a, **k: (
            only_loopback if host == socket.gethostname() else real(host, *a, **k)
        ),
    )
    assert server_hosts.is_this_host(interface)
    check_same_host(f"http://{interface}:30000")
    assert not server_hosts.is_this_host("192.0.2.7")  # TEST-NET-1: never bound here


def test_a_stop_signal_ends_the_wait_for_the_servers_within_one_poll(caplog):
    from megatron_rl import stop_signal

    config = SGLangEngineConfig.from_hf_config(
        tiny_config(),
        http=HttpPoolConfig(urls=("http://127.0.0.1:9",), connect_timeout_s=0.2),
        startup_timeout_s=600,
    )
    caplog.set_level("INFO", logger="megatron_rl.rollout.sglang_client")
    timer = threading.Timer(0.5, stop_signal.request)
    timer.start()
    try:
        with SGLangEngine(config) as client, pytest.raises(stop_signal.StopRequested) as err:
            client.wait_until_ready(poll_s=0.1)
    finally:
        timer.cancel()
        stop_signal.clear()
    assert "waiting for SGLang servers ['http://127.0.0.1:9']" in str(err.value)
    # the first failed probe already said what the trainer waits for
    assert "waiting for SGLang servers" in caplog.records[0].getMessage()
