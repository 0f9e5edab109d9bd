"""``--colocate``: the flag's checks, the end of a run (`Colocation.close`), and the real CLI
against the loopback SGLang stand-in: the trainer holds no device bytes while the servers
generate, the servers see SGLang's memory calls in slime's order, and the weights they load are
the trainer's (log-prob gap, checksums)."""

from __future__ import annotations

import dataclasses
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from trainer_testing import rendezvous, small_config

from megatron_rl.train.config import TrainConfig

ROOT = Path(__file__).resolve().parents[2]
SGLANG = {"rollout_engine": "sglang", "sglang_url": ("http://127.0.0.1:1",)}
ALL_TAGS = ["kv_cache", "weights", "cuda_graph"]


def test_colocate_needs_sglang_servers_and_the_tensor_transport():
    with pytest.raises(ValueError, match=r"--colocate=True: needs --rollout-engine sglang"):
        TrainConfig.from_flags(colocate=True)
    with pytest.raises(ValueError, match="--weight-sync-transport distributed"):
        TrainConfig.from_flags(colocate=True, **SGLANG)
    TrainConfig.from_flags(colocate=True, weight_sync_transport="tensor", **SGLANG)


def test_colocate_refuses_a_router_and_a_partial_server_set():
    colocated = {"colocate": True, "weight_sync_transport": "tensor", **SGLANG}
    with pytest.raises(ValueError, match=r"--sglang-router-url .* with --colocate"):
        TrainConfig.from_flags(sglang_router_url="http://127.0.0.1:2", **colocated)
    urls = tuple(f"http://127.0.0.1:{port}" for port in (1, 3, 4))
    with pytest.raises(ValueError, match=r"--sglang-min-servers=2: --colocate needs every one"):
        TrainConfig.from_flags(sglang_min_servers=2, **{**colocated, "sglang_url": urls})
    two = {**colocated, "sglang_url": urls[:2]}
    TrainConfig.from_flags(sglang_min_servers=2, **two)  # every server: what colocation needs


@pytest.mark.parametrize("dtype", ["bfloat16", "float8"])
def test_the_in_process_engines_dtype_is_refused_for_sglang_servers(dtype):
    """SGLang serves in the dtype its servers were started with: the flag would be ignored."""
    with pytest.raises(ValueError, match=rf"--rollout-dtype='{dtype}': .*--quantization fp8"):
        TrainConfig.from_flags(rollout_dtype=dtype, **SGLANG)
    TrainConfig.from_flags(rollout_dtype=dtype)  # the in-process engine's


class _Servers:
    """The rank-0 engine's memory calls, each with the trainer's device bytes at that moment."""

    def __init__(self, offload) -> None:
        self.offload = offload
        self.calls: list[tuple[str, tuple[str, ...], int]] = []

    def release_memory(self, tags) -> None:
        self.calls.append(("release", tuple(tags or ALL_TAGS), self.offload.resident_bytes()))

    def resume_memory(self, tags) -> None:
        self.calls.append(("resume", tuple(tags or ALL_TAGS), self.offload.resident_bytes()))


def test_the_end_of_a_colocated_run_resumes_nothing_next_to_the_trainers_state():
    """After a step the trainer holds its weights, gradients and optimizer state; `close` must
    not resume the servers' KV cache and CUDA graphs beside them (torch_memory_saver ends the
    server when that allocation fails on a GPU)."""
    import torch

    from megatron_rl.train.colocate import Colocation, release_generation_memory
    from megatron_rl.train.offload import TrainerOffload

    model = torch.nn.Linear(64, 64)
    optimizer = torch.optim.Adam(model.parameters())
    model(torch.ones(2, 64)).sum().backward()
    optimizer.step()
    offload = TrainerOffload(model, optimizer, device="cpu")
    servers = _Servers(offload)
    release_generation_memory(servers)
    colocation = Colocation(offload, servers)
    for _ in range(2):
        colocation.before_rollout()
        colocation.before_train()
        colocation.before_sync()
    held = offload.resident_bytes()
    assert offload.host_bytes >= held and offload.host_allocations == 1
    colocation.close()
    assert held > 0 and offload.resident_bytes() == held  # the trainer kept its state
    assert offload.host_bytes == 0  # and the host copy went
    resumed_beside_trainer = [
        c
        for c in servers.calls
        if c[0] == "resume" and set(c[1]) & {"kv_cache", "cuda_graph"} and c[2] > 0
    ]
    assert resumed_beside_trainer == []
    assert servers.calls[-1] == ("resume", ("weights",), held)  # the last step's, not close's
    assert colocation.released == {"kv_cache", "cuda_graph"}


@pytest.mark.parametrize(
    ("flags", "match"),
    [({"async_rollout": True}, "--async-rollout"), ({"eval_interval": 2}, "evaluation")],
)
def test_colocate_refuses_generation_while_the_trainer_holds_the_gpus(flags, match):
    with pytest.raises(ValueError, match=match):
        TrainConfig.from_flags(colocate=True, weight_sync_transport="tensor", **SGLANG, **flags)


def _server(config: TrainConfig):
    """A loopback server over the policy's architecture; records the memory calls in order."""
    from megatron_rl.data import BuiltinTaskConfig, builtin_task
    from megatron_rl.rollout import InProcessEngine
    from megatron_rl.testing.loopback_server import LoopbackServer
    from megatron_rl.train.task import load_policy_config

    tokenizer, _ = builtin_task(BuiltinTaskConfig(seed=config.parallel.seed))
    hf_config, _ = load_policy_config(config.task, tokenizer)
    server = LoopbackServer(InProcessEngine.from_hf_config(hf_config, seed=99))
    calls: list[tuple[str, list[str] | None]] = []

    def record(path: str, payload: object) -> None:
        if path.endswith("_memory_occupation"):
            calls.append((path.strip("/").split("_")[0], payload.get("tags")))
        elif path in ("/generate", "/update_weights_from_tensor") and (
            not calls or calls[-1][0] != path  # consecutive calls counted once
        ):
            calls.append((path, None))

    server.before_request = record
    return server.start(), calls


def _expected_calls(steps: int) -> list[tuple[str, list[str] | None]]:
    calls = [("release", ["kv_cache", "cuda_graph"]), ("/update_weights_from_tensor", None)]
    for _ in range(steps):
        calls += [
            ("resume", ["kv_cache", "cuda_graph"]),  # after the trainer's offload
            ("/generate", None),
            ("release", ALL_TAGS),  # before the trainer's onload
            ("resume", ["weights"]),
            ("/update_weights_from_tensor", None),
        ]
    return calls  # nothing at the end: the servers stay released (Colocation.close)


@pytest.mark.slow
def test_the_cli_colocates_trainer_and_servers_in_slimes_order(tmp_path):
    config = small_config(tmp_path)
    server, calls = _server(config)
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "megatron_rl.train", "--device", "cpu", "--train-iters", "2",
        "--rollout-batch-size", "4", "--n-samples-per-prompt", "4", "--global-batch-size", "8",
        "--micro-batch-size", "4", "--max-response-length", "3", "--seed", "7",
        "--run-dir", str(run_dir), "--no-progress", "--torch-threads", "1",
        "--rollout-engine", "sglang", "--sglang-url", server.url,
        "--weight-sync-transport", "tensor", "--colocate",
    ]  # fmt: skip
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    log = tmp_path / "cli.log"
    # to a file, not a pipe: on CPU the tensor transport's shared memory starts torch's
    # torch_shm_manager, which inherits the pipe and outlives the CLI
    try:
        with log.open("w") as out:
            result = subprocess.run(
                command, cwd=ROOT, stdout=out, stderr=subprocess.STDOUT, env=env, timeout=600
            )
    finally:
        server.stop()
    assert result.returncode == 0, log.read_text()[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["colocate/trainer_resident_bytes_during_rollout"] == 0.0
        assert row["colocate/offloaded_bytes"] > 1e5  # the tiny policy, its grads and Adam
        assert row["colocate/offload_s"] > 0 and row["colocate/onload_s"] > 0
        # one host buffer for each step's copy, of the bytes moved up to alignment
        assert 1 <= row["colocate/host_arena_bytes"] / row["colocate/copied_bytes"] < 1.05
        # the gradient buffers are freed but never copied (zeroed before every update)
        assert row["colocate/copied_bytes"] < row["colocate/offloaded_bytes"]
        assert "colocate/device_free_bytes" not in row  # CUDA only
        assert row["mismatch/train_rollout_logprob_abs_gap"] < 1e-4  # the trainer's weights
    # Adam's moments exist from the optimizer's construction: the first rollout's offload
    # (before any update) already moves every byte, and its arena serves every later one
    assert [r["colocate/host_allocations"] for r in rows] == [1, 1]
    assert rows[0]["colocate/copied_bytes"] == rows[1]["colocate/copied_bytes"]
    assert calls == _expected_calls(steps=2)
    assert server.engine.weight_version == 2
    assert server.memory.released() == {"kv_cache", "cuda_graph"}  # left released at the end


@pytest.mark.slow
def test_a_colocated_run_syncs_the_trainers_exact_weights(tmp_path, monkeypatch):
    """In process, with the sync's per-tensor checksums on (a mismatch drops the only server
    and fails the sync): every sync after an offload and onload loads the trainer's weights."""
    from megatron_rl.rollout import weight_sync
    from megatron_rl.train.run import run

    def checked(**kwargs):
        return dataclasses.replace(original(**kwargs), checksum=True)

    original = weight_sync.WeightSyncConfig
    monkeypatch.setattr(weight_sync, "WeightSyncConfig", checked)
    config = small_config(tmp_path, train_iters=2)
    server, calls = _server(config)
    try:
        colocated = config.with_flags(
            rollout_engine="sglang",
            sglang_url=(server.url,),
            weight_sync_transport="tensor",
            colocate=True,
        )
        last = run(colocated, **rendezvous(tmp_path))
    finally:
        server.stop()
    assert server.requests.count("/weights_checksum") == 3  # the first sync and one per step
    assert last["colocate/trainer_resident_bytes_during_rollout"] == 0.0
    assert last["colocate/offloaded_bytes"] > 1e5
    assert calls == _expected_calls(steps=2)


def test_a_resume_that_would_not_fit_is_a_named_error_and_no_server_call():
    """torch_memory_saver ends an SGLang server whose KV-cache / CUDA-graph resume does not fit.
    The trainer measures what the servers released at start-up and, after its offload, refuses
    the resume with a named error when the GPU has less free than that (before, it resumed and
    the server died). Device memory is a stand-in here: the CPU has none to measure."""
    import torch

    from megatron_rl.train.colocate import ColocateMemoryError, Colocation
    from megatron_rl.train.offload import TrainerOffload

    model = torch.nn.Linear(8, 8)
    offload = TrainerOffload(model, torch.optim.Adam(model.parameters()), device="cpu")
    servers = _Servers(offload)
    free = {"bytes": 10 * 2**30}
    colocation = Colocation(
        offload, servers, generation_bytes=12 * 2**30, free_bytes=lambda: free["bytes"]
    )
    with pytest.raises(ColocateMemoryError, match=r"2\.00 GiB less free memory"):
        colocation.before_rollout()
    assert not [c for c in servers.calls if c[0] == "resume"]  # nothing was asked of them
    offload.onload()
    free["bytes"] = 12 * 2**30  # room for exactly what they released
    colocation.before_rollout()
    assert servers.calls[-1][:2] == ("resume", ("kv_cache", "cuda_graph"))
    unmeasured = Colocation(offload, servers, generation_bytes=None, free_bytes=lambda: 0)
    offload.onload()
    unmeasured.before_rollout()  # off CUDA nothing is measured and nothing is refused
