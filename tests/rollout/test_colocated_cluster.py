"""``--colocate`` on more than one node, through the real CLI under torchrun (2 gloo ranks on
CPU) against two loopback stand-ins, one per "node": 127.0.0.2 and 127.0.0.3.

Each rank plays a node of its own (`colocated_hosts`: rank r's host is 127.0.0.(2 + r) only), so
rank 0 sees the server on 127.0.0.3 as another node's, as rank 0 of a 4-node job sees node 1's.
Server i loads from trainer rank i (``--sglang-engine-ranks 1``). A job whose every rank checked
every server's host could not start; each rank checks its own server only.
"""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

import pytest
from colocated_hosts import rank_host
from ports import torchrun
from real_sglang.servers import write_tiny_checkpoint
from torchrun_cli import ROOT, SMALL

from megatron_rl.model.presets import load_hf_config
from megatron_rl.rollout import InProcessEngine
from megatron_rl.testing.loopback_server import LoopbackServer

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
STEPS = 2
GENERATION_TAGS = {"kv_cache", "cuda_graph"}


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("colocated_cluster") / "hf")


def _servers(model: Path) -> list[LoopbackServer]:
    """One stand-in per rank's "node", each recording the memory calls it served."""
    servers = []
    for rank in range(2):
        engine = InProcessEngine.from_hf_config(load_hf_config(model), seed=9)
        servers.append(LoopbackServer(engine, host=rank_host(rank)).start())
    return servers


def _train(model: Path, run_dir: Path, servers, *flags: str) -> tuple[int, str]:
    """torchrun 2 ranks of the real CLI, each rank on its own "node"; (exit code, log)."""
    urls = [arg for s in servers for arg in ("--sglang-url", s.url)]
    command = [
        *torchrun(2), str(Path(__file__).parent / "colocated_hosts.py"),
        "--model", str(model), "--run-dir", str(run_dir), "--device", "cpu", "--no-progress",
        "--train-iters", str(STEPS), "--torch-threads", "1", *SMALL,
        "--rollout-engine", "sglang", *urls, "--colocate", "--weight-sync-transport", "tensor",
        *flags,
    ]  # fmt: skip
    log = run_dir.parent / f"{run_dir.name}.log"  # a file: torch's shm manager outlives the run
    with log.open("w") as out:
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=out, timeout=1800).returncode
    return code, log.read_text()


def _memory_calls(server: LoopbackServer) -> list[str]:
    return [p for p in server.requests if p.endswith("_memory_occupation")]


def test_a_two_node_colocated_job_starts_trains_and_leaves_its_servers_released(model, tmp_path):
    """Each rank checks the host of its own server only, so the job starts; both servers take
    every memory call, and the run ends with them released (never resumed next to the trainer's
    weights, gradients and optimizer state)."""
    servers = _servers(model)
    try:
        code, log = _train(model, tmp_path / "run", servers)
    finally:
        for server in servers:
            server.stop()
    assert code == 0, log[-8000:]
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(rows) == STEPS
    assert all(r["mismatch/train_rollout_logprob_abs_gap"] < 1e-4 for r in rows)
    release, resume = "/release_memory_occupation", "/resume_memory_occupation"
    per_step = [resume, release, resume]  # [kv_cache, cuda_graph]; all three; [weights]
    for server in servers:
        assert server.engine.weight_version == STEPS
        assert _memory_calls(server) == [release, *per_step * STEPS]  # none at the end
        assert server.memory.released() == GENERATION_TAGS
        assert "/generate" in server.requests  # each server served its rank's share


def test_a_server_failing_a_colocated_sync_stops_the_run_without_a_reprobe(model, tmp_path):
    """Server 1 fails every weight update after the first sync: the run stops at the next
    sync with an error naming --colocate and the server; it is not dropped (the run does not
    go on with server 0 alone) nor re-probed (a re-probe's /health generates on released
    memory)."""
    servers = _servers(model)
    failing = servers[1]
    synced = []  # /end_weight_update calls served

    def fail_later_updates(path: str, payload: object) -> str | None:
        if path == "/end_weight_update":
            synced.append(path)
        return "503" if path == "/update_weights_from_tensor" and synced else None

    failing.before_request = fail_later_updates
    try:
        code, log = _train(model, tmp_path / "run", servers, "--sglang-reprobe-interval", "0.1")
    finally:
        for server in servers:
            server.stop()
    assert code != 0, log[-8000:]
    assert "--colocate: weight sync to version 1" in log, log[-8000:]
    assert failing.url in log and "needs every server" in log
    first_failure = failing.requests.index(
        "/update_weights_from_tensor", failing.requests.index("/end_weight_update")
    )
    assert "/health" not in failing.requests[first_failure:]
    metrics = tmp_path / "run" / "metrics.jsonl"
    assert not metrics.exists() or not metrics.read_text().strip()  # no step finished
