"""Launch helpers: SGLang command lines (sglang itself cannot run here) and the health wait.

The health wait and process handling run against the loopback server, in-thread and as a real
subprocess started by `start_process` (on port 0: it logs the port it bound). A dead port is one
the test holds bound without listening (`ports.HeldPort`): refused, and no other process's.
"""

from __future__ import annotations

import sys

import pytest
from ports import HeldPort, port_from_log
from rollout_testing import tiny_config

from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.http_pool import HttpPoolConfig
from megatron_rl.rollout.launch import (
    SGLangServerConfig,
    router_command,
    server_command,
    start_process,
    stop_process,
    wait_healthy,
)
from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig


def test_server_command_has_the_rl_flags():
    config = SGLangServerConfig(
        model_path="ckpt", port=30000, tp_size=4, ep_size=4, return_routed_experts=True
    )
    cmd = server_command(config, python="python")
    assert cmd[:3] == ["python", "-m", "sglang.launch_server"]
    flags = dict(zip(cmd[3::2], cmd[4::2], strict=False))
    assert flags["--model-path"] == "ckpt" and flags["--tp-size"] == "4"
    assert cmd[cmd.index("--ep-size") + 1] == "4"
    assert "--enable-return-routed-experts" in cmd and "--skip-tokenizer-init" in cmd
    assert cmd[cmd.index("--mem-fraction-static") + 1] == "0.7"
    plain = server_command(SGLangServerConfig(model_path="ckpt", port=30000), python="python")
    assert "--enable-return-routed-experts" not in plain and "--ep-size" not in plain
    router = router_command(["http://a:1", "http://b:2"], 8000, python="python")
    assert router[router.index("--worker-urls") + 1 :] == ["http://a:1", "http://b:2"]


@pytest.mark.parametrize(
    "kwargs,match",
    [
        ({"port": 0}, "port"),
        ({"tp_size": 2, "ep_size": 4}, "ep_size"),
        ({"mem_fraction_static": 1.5}, "mem_fraction_static"),
    ],
)
def test_bad_server_config_names_the_field(kwargs, match):
    with pytest.raises(ValueError, match=match):
        SGLangServerConfig(model_path="m", **{"port": 30000, **kwargs})


def test_wait_healthy_returns_once_the_server_answers(servers):
    (server,) = servers(1)
    assert wait_healthy(server.url, timeout_s=5.0) < 5.0


def test_wait_healthy_times_out_on_a_dead_port():
    with HeldPort() as port, pytest.raises(RuntimeError, match=r"within 0\.5 s"):
        wait_healthy(f"http://127.0.0.1:{port}", timeout_s=0.5, poll_s=0.1)


def test_wait_healthy_reports_a_process_that_exited():
    process = start_process([sys.executable, "-c", "raise SystemExit(3)"])
    with HeldPort() as port, pytest.raises(RuntimeError, match="exited with code 3"):
        wait_healthy(f"http://127.0.0.1:{port}", timeout_s=30.0, process=process)


@pytest.mark.slow
def test_start_wait_generate_stop_a_server_subprocess(tmp_path):
    cmd = [sys.executable, "-m", "megatron_rl.testing.loopback_server", "--port", "0"]
    log = tmp_path / "server.log"
    process = start_process(cmd, log_path=log)
    try:
        port = port_from_log(log, r"loopback server on http://127\.0\.0\.1:(\d+)", process=process)
        url = f"http://127.0.0.1:{port}"
        wait_healthy(url, timeout_s=120.0, process=process)
        config = SGLangEngineConfig.from_hf_config(tiny_config(), http=HttpPoolConfig(urls=(url,)))
        with SGLangEngine(config) as client:
            samples = client.generate([[1, 2, 3]], SamplingParams(max_new_tokens=3), n=2)
        assert [s.response_ids_R.numel() for s in samples] == [3, 3]
    finally:
        assert stop_process(process, timeout_s=10.0) is not None


def test_serve_prints_the_router_apart_from_the_worker_urls(capsys):
    from megatron_rl.rollout.serve import main

    assert (
        main(["--model-path", "m", "--num-servers", "2", "--router-port", "29000", "--dry-run"])
        == 0
    )
    lines = [line for line in capsys.readouterr().out.splitlines() if "URL " in line]
    assert lines == [
        "URL http://127.0.0.1:30000",
        "URL http://127.0.0.1:30001",
        "ROUTER_URL http://127.0.0.1:29000",
    ]


def test_wait_healthy_probe_timeout_must_allow_sglangs_1_s_health(servers):
    (server,) = servers(1)
    with pytest.raises(ValueError, match="probe_timeout_s"):
        wait_healthy(server.url, timeout_s=5.0, probe_timeout_s=1.0)
