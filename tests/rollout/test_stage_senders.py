"""One weight sender per pipeline stage, through the real CLI under torchrun (PP2, 2 gloo ranks).

The servers are loopback stand-ins in this test's process, so the test sees which group every
bucket came over; `test_real_sglang.py` runs the same layout against the real SGLang server.
"""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest
from real_sglang.servers import write_tiny_checkpoint
from safetensors import safe_open
from torchrun_cli import torchrun_train

from megatron_rl.model.presets import load_hf_config
from megatron_rl.rollout import InProcessEngine
from megatron_rl.testing.loopback_server import LoopbackServer

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
STEPS = 2
PP2 = ("--pipeline-model-parallel-size", "2")


def two_servers(model: Path) -> list[LoopbackServer]:
    """Two loopback stand-ins of the checkpoint's shape (other random weights than it)."""
    hf_config = load_hf_config(model)
    return [
        LoopbackServer(InProcessEngine.from_hf_config(hf_config, seed=s)).start() for s in (9, 8)
    ]


def train_pp2(model: Path, tmp_path: Path, servers, *flags: str) -> list[dict]:
    """The CLI under torchrun with PP2 against ``servers`` over the distributed transport."""
    urls = [flag for s in servers for flag in ("--sglang-url", s.url)]
    return torchrun_train(
        model, tmp_path / "run", *PP2, "--rollout-engine", "sglang", *urls,
        "--weight-sync-transport", "distributed", *flags,
    )  # fmt: skip


def recording(server: LoopbackServer) -> list[tuple[str, list[str]]]:
    """(group name, tensor names) of every bucket ``server`` loads over a weight group."""
    loads: list[tuple[str, list[str]]] = []
    receive = server._from_distributed

    def record(payload: dict):
        answer = receive(payload)
        if answer[0] == 200 and answer[1].get("success"):
            loads.append((payload["group_name"], list(payload["names"])))
        return answer

    server._from_distributed = record
    return loads


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    """The tiny preset with 4 layers: layers 0-1 on stage 0, 2-3 on stage 1."""
    return write_tiny_checkpoint(tmp_path_factory.mktemp("stages") / "hf", num_hidden_layers=4)


@pytest.mark.parametrize("senders", ["per-stage", "rank-0", "per-stage-vp2"])
def test_each_stage_broadcasts_its_own_tensors_once_per_sync(four_layers, tmp_path, senders):
    """Two servers, two stages: every tensor of the checkpoint arrives once per sync on each
    server, stage 1's layers over stage 1's own group (not through rank 0; with
    ``--weight-sync-from-rank-0`` everything over rank 0's), and the servers' log-probs are the
    trainer's (fp32 both: a tensor lost or crossed would show). Interleaved (PP 2 x VP 2), each
    stage sends both its chunks: stage 0 layers 0 and 2, stage 1 layers 1 and 3."""
    servers = two_servers(four_layers)
    loads = [recording(s) for s in servers]
    interleaved = senders == "per-stage-vp2"
    try:
        flags = ["--weight-sync-from-rank-0"] if senders == "rank-0" else []
        if interleaved:
            flags = ["--virtual-pipeline-model-parallel-size", "2"]
        rows = train_pp2(four_layers, tmp_path, servers, *flags)
        versions = [s.engine.weight_version for s in servers]
    finally:
        for server in servers:
            server.stop()
    with safe_open(four_layers / "model.safetensors", "pt") as checkpoint:
        every = set(checkpoint.keys())
    syncs = versions[0] + 1  # version 0 at the start, then one per step
    assert versions == [STEPS, STEPS] and len(rows) == STEPS
    for server_loads in loads:
        counts = Counter(name for _, names in server_loads for name in names)
        assert set(counts) == every and set(counts.values()) == {syncs}, counts
        by_stage = {0: set(), 1: set()}
        for group, names in server_loads:
            by_stage[1 if "-stage1-" in group else 0].update(names)
        if senders == "rank-0":
            assert by_stage == {0: every, 1: set()}
            continue
        stage_layers = ({"0", "2"}, {"1", "3"}) if interleaved else ({"0", "1"}, {"2", "3"})
        assert {n.split(".")[2] for n in by_stage[1] if ".layers." in n} == stage_layers[1]
        assert {n.split(".")[2] for n in by_stage[0] if ".layers." in n} == stage_layers[0]
        assert "lm_head.weight" in by_stage[1] and "model.embed_tokens.weight" in by_stage[0]
    assert rows[-1]["mismatch/train_rollout_logprob_abs_gap"] < 1e-4
    stage_mb = [rows[-1].get(f"weight_sync/stage_mb/{s}", 0.0) for s in (0, 1)]
    assert stage_mb[1] > 0 if senders != "rank-0" else stage_mb[1] == 0, stage_mb


def test_a_server_dying_in_a_later_stage_leaves_and_the_sync_goes_on(four_layers, tmp_path):
    """A server that dies on stage 1's first bucket of the second sync leaves that sync: stage
    1's group is rebuilt over the survivor, which gets every tensor, and the run goes on."""
    servers = two_servers(four_layers)
    survivor, dying = servers
    loads = recording(survivor)

    def die_in_stage_one(path: str, payload) -> str | None:
        stage_one = path == "/update_weights_from_distributed" and "-stage1-" in str(payload)
        return "die" if stage_one and "/update_weight_version" in dying.requests else None

    dying.before_request = die_in_stage_one
    try:
        rows = train_pp2(four_layers, tmp_path, servers, "--sglang-reprobe-interval", "300")
        version = survivor.engine.weight_version
    finally:
        for server in servers:
            server.stop()
    assert version == STEPS and dying.engine.weight_version == 0
    assert rows[-1]["rollout/servers_dropped"] == 1 and rows[-1]["rollout/servers_up"] == 1
    counts = Counter(name for _, names in loads for name in names)
    # every tensor in every sync; the bucket the death broke may have loaded before its resend
    assert min(counts.values()) == STEPS + 1 and max(counts.values()) <= STEPS + 2, counts
    assert len({group for group, _ in loads if "-stage1-" in group}) == 2  # rebuilt once
