"""The 32-GPU Qwen3-30B-A3B launcher and its SLURM entry: valid bash, and the commands they would
run (DRY_RUN=1) are accepted by the trainer's and the server launcher's own argument checks. The
run script's own failure handling (shared-filesystem check, heartbeat, torchrun under traps) runs
for real with a fake torchrun. Nothing here runs on a GPU: this proves the launcher's wiring, not
a cluster run."""

from __future__ import annotations

import os
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from megatron_rl.train.config import parse_args

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "examples" / "qwen3_moe" / "run_qwen3_30b_a3b.sh"
SBATCH = ROOT / "examples" / "qwen3_moe" / "slurm_qwen3_30b_a3b.sbatch"
LAUNCH_VARIABLES = ("NODE_RANK", "MASTER_ADDR", "ROLLOUT_HOSTS", "NODE_HOSTS", "LAUNCH_ID")


def _base_env(**env) -> dict:
    base = {k: v for k, v in os.environ.items() if k not in LAUNCH_VARIABLES}
    base = {k: v for k, v in base.items() if not k.startswith("SLURM_")}
    return {
        **base,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HF_CKPT": "/shared/Qwen3-30B-A3B",
        "PROMPTS": "/shared/dapo-math-17k.parquet",
        **env,
    }


def _train_argv(out: str) -> list[str]:
    """The torchrun command of a training node's DRY_RUN output (other lines: exports, checks)."""
    (line,) = [line for line in out.splitlines() if line.startswith("torchrun ")]
    return shlex.split(line)


def _trainer_config(argv: list[str]):
    return parse_args(argv[argv.index("megatron_rl.train") + 1 :])


def _dry_run(node_rank: int, **env) -> str:
    environment = _base_env(
        MASTER_ADDR="node0",
        ROLLOUT_HOSTS="node2 node3",
        NODE_RANK=str(node_rank),
        DRY_RUN="1",
        **env,
    )
    result = subprocess.run(
        ["bash", str(SCRIPT)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.parametrize("script", [SCRIPT, SBATCH], ids=lambda p: p.name)
def test_launcher_is_valid_bash(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize(("loss", "replay", "staleness"), [("vespo", "off", 8), ("epic", "r3", 4)])
def test_training_node_command_passes_the_trainer_checks(loss, replay, staleness):
    out = _dry_run(0, LOSS=loss, REPLAY=replay, STALENESS=str(staleness))
    argv = _train_argv(out)
    assert argv[0] == "torchrun" and "--nproc-per-node" in argv
    config = _trainer_config(argv)
    assert config.loss == loss and config.routing_replay == replay
    assert config.updates_per_rollout == staleness
    assert config.data_parallel_size(16) == 8  # 2 nodes x 8 GPUs, TP 2
    assert len(config.sglang_url) == 2 and config.sglang_engine_ranks == 8


def test_serving_node_starts_one_sglang_server_with_routes_for_r3():
    out = _dry_run(2, REPLAY="r3")
    assert "sglang.launch_server" in out and "--enable-return-routed-experts" in out
    assert "--tp-size 8" in out and "--ep-size 8" in out and "--skip-tokenizer-init" in out
    assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in out
    assert "--enable-return-routed-experts" not in _dry_run(3, REPLAY="r2")


@pytest.mark.parametrize(
    ("loss", "env", "kl"),
    [
        ("epic", {}, 1e-3),
        ("gspo", {}, 1e-3),
        ("vespo", {}, 0.0),
        ("vespo", {"KL_COEF": "0.01"}, 0.01),
    ],
)
def test_the_kl_coefficient_is_a_per_recipe_choice(loss, env, kl):
    config = _trainer_config(_train_argv(_dry_run(0, LOSS=loss, **env)))
    assert config.kl_coef == kl
    assert config.reference_offload and config.use_distributed_optimizer
    assert config.overlap_grad_reduce


def test_training_nodes_get_cuda_device_max_connections_and_serving_nodes_the_heartbeat():
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in _dry_run(1).splitlines()
    serving = _dry_run(3)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in serving
    heartbeat = "runs/qwen3-30b-a3b-vespo-off-N8/job.alive"
    assert f"# stops the servers when {heartbeat} is removed or unchanged for 300 s" in serving


def test_optimizer_cpu_offload_reaches_the_trainer():
    assert not _trainer_config(_train_argv(_dry_run(0))).optimizer_cpu_offload
    config = _trainer_config(
        _train_argv(_dry_run(0, OPTIMIZER_CPU_OFFLOAD="1", OPTIMIZER_OFFLOAD_FRACTION="0.5"))
    )
    assert config.optimizer_cpu_offload and config.optimizer_offload_fraction == 0.5
    assert config.optimizer_config().cpu_offload


def test_rerunning_the_same_command_resumes_and_the_first_run_starts_fresh(tmp_path):
    """--load is the --save folder: missing or empty means a fresh start, not an error."""
    from megatron_rl.train.run import resolve_load

    run_dir = tmp_path / "run"
    config = _trainer_config(_train_argv(_dry_run(0, RUN_DIR=str(run_dir))))
    assert config.load == config.save == f"{run_dir}/checkpoints"
    assert resolve_load(config) is None  # missing
    (run_dir / "checkpoints").mkdir(parents=True)
    assert resolve_load(config) is None  # empty


# ----------------------------------------------------------------------------- SLURM entry
def _fake_bin(tmp_path: Path, name: str, body: str) -> Path:
    folder = tmp_path / "bin"
    folder.mkdir(exist_ok=True)
    path = folder / name
    path.write_text(f"#!/usr/bin/env bash\n{body}")
    path.chmod(0o755)
    return folder


def _slurm_dry_run(tmp_path: Path, hosts: list[str], **env) -> subprocess.CompletedProcess:
    """The sbatch file's batch step with fake SLURM variables and a fake `scontrol`."""
    listing = "\\n".join(hosts)
    scontrol = f'[[ "$1 $2" == "show hostnames" ]] || exit 2\nprintf "{listing}\\n"\n'
    fake = _fake_bin(tmp_path, "scontrol", scontrol)
    environment = _base_env(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu[01-04]",
        SLURM_SUBMIT_DIR=str(ROOT),
        DRY_RUN="1",
        **env,
    )
    environment["PATH"] = f"{fake}:{environment['PATH']}"
    return subprocess.run(
        ["bash", str(SBATCH)], cwd=ROOT, env=environment, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def _per_node(out: str) -> tuple[str, dict[int, str]]:
    parts = re.split(r"^## node (\d) \(\S+\)$", out, flags=re.M)
    return parts[0], {int(n): text for n, text in zip(parts[1::2], parts[2::2], strict=True)}


def test_slurm_entry_gives_every_node_commands_that_pass_the_checks(tmp_path):
    hosts = ["gpu01", "gpu02", "gpu03", "gpu04"]
    result = _slurm_dry_run(tmp_path, hosts, REPLAY="r3", LOSS="epic")
    assert result.returncode == 0, result.stderr
    head, nodes = _per_node(result.stdout)
    srun = shlex.split(head.strip())
    assert srun[0] == "srun" and "--kill-on-bad-exit=1" in srun
    assert "--ntasks-per-node=1" in srun and "--nodes=4" in srun
    assert srun[-3:] == ["bash", str(SBATCH), "--node"]
    assert sorted(nodes) == [0, 1, 2, 3]
    for rank in (0, 1):
        out = nodes[rank]
        argv = _train_argv(out)
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--master-addr") + 1] == "gpu01"
        config = _trainer_config(argv)
        assert config.sglang_url == ("http://gpu03:30000", "http://gpu04:30000")
        assert config.loss == "epic" and config.routing_replay == "r3"
        assert config.data_parallel_size(16) == 8
        assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in out
        assert f".nodes/node{rank}: launch=4242 " in out
        assert ("# would wait up to 300 s" in out) == (rank == 0)
        assert ("job.alive every" in out) == (rank == 0)
    for rank in (2, 3):
        out = nodes[rank]
        assert "torchrun" not in out and "sglang.launch_server" in out
        assert "--enable-return-routed-experts" in out and "--tp-size 8" in out
        assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in out
        assert f".nodes/node{rank}: launch=4242 " in out
        assert "# stops the servers when" in out


def test_slurm_entry_refuses_a_wrong_allocation(tmp_path):
    result = _slurm_dry_run(tmp_path, ["gpu01", "gpu02", "gpu03"])
    assert result.returncode != 0
    assert "the allocation has 3 nodes (gpu01 gpu02 gpu03); this job needs 4" in result.stderr


# ------------------------------------------- the run script's failure handling, for real
FAKE_TORCHRUN = """
echo "$$" > "${FAKE_DIR}/torchrun.pid"
[[ -f "${RUN_DIR}/job.alive" ]] && echo yes > "${FAKE_DIR}/heartbeat_seen"
if [[ -n "${FAKE_EXIT:-}" ]]; then exit "${FAKE_EXIT}"; fi
trap 'echo term > "${FAKE_DIR}/torchrun.term"; kill "${child}"; exit 143' TERM
sleep 600 &
child=$!
wait "${child}"
"""


def _node0(tmp_path: Path, markers: tuple[int, ...], **env) -> subprocess.Popen:
    """Training node 0 for real (a fake torchrun); ``markers``: the other nodes already seen."""
    run_dir = tmp_path / "run"
    (run_dir / ".nodes").mkdir(parents=True)
    for rank in markers:
        (run_dir / ".nodes" / f"node{rank}").write_text(f"launch=L7 host=h{rank}\n")
    fake = _fake_bin(tmp_path, "torchrun", FAKE_TORCHRUN)
    environment = _base_env(
        MASTER_ADDR="h0",
        ROLLOUT_HOSTS="h2 h3",
        NODE_RANK="0",
        RUN_DIR=str(run_dir),
        LAUNCH_ID="L7",
        FAKE_DIR=str(tmp_path),
        HEARTBEAT_INTERVAL="1",
        **env,
    )
    environment["PATH"] = f"{fake}:{environment['PATH']}"
    return subprocess.Popen(
        ["bash", str(SCRIPT)], cwd=ROOT, env=environment, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


def test_node0_names_the_nodes_it_cannot_see(tmp_path):
    stale = tmp_path / "run" / ".nodes"
    process = _node0(tmp_path, markers=(1,), NODE_WAIT_S="1")
    (stale / "node3").write_text("launch=an-earlier-launch host=h3\n")  # not this launch's
    _, err = process.communicate(timeout=60)
    assert process.returncode != 0
    assert "still does not see the markers of node 2 (h2),node 3 (h3)" in err
    assert "filesystem every node sees" in err
    assert (stale / "node0").read_text().startswith("launch=L7 host=")
    assert not (tmp_path / "torchrun.pid").exists()  # training never started
    assert not (tmp_path / "run" / "job.alive").exists()  # the serving nodes stop at once


def test_a_failed_torchrun_ends_node0_with_its_status_and_removes_the_heartbeat(tmp_path):
    process = _node0(tmp_path, markers=(1, 2, 3), FAKE_EXIT="3")
    process.communicate(timeout=60)
    assert process.returncode == 3
    assert (tmp_path / "heartbeat_seen").exists()  # it beat while training ran
    assert not (tmp_path / "run" / "job.alive").exists()


def test_sigterm_stops_torchrun_and_removes_the_heartbeat(tmp_path):
    process = _node0(tmp_path, markers=(1, 2, 3))
    _wait_for_torchrun(tmp_path, process)
    assert (tmp_path / "run" / "job.alive").exists()
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err
    assert (tmp_path / "torchrun.term").read_text() == "term\n"  # torchrun got the signal
    assert not (tmp_path / "run" / "job.alive").exists()


def _wait_for_torchrun(tmp_path: Path, process: subprocess.Popen) -> int:
    pid_file = tmp_path / "torchrun.pid"
    deadline = time.monotonic() + 60
    while not pid_file.exists() or not pid_file.read_text().strip():
        assert time.monotonic() < deadline and process.poll() is None, process.stderr.read()
        time.sleep(0.05)
    return int(pid_file.read_text())


def test_the_heartbeat_beats_while_node0_lives_and_stops_with_it(tmp_path):
    """Even when node 0's script dies without its traps (SIGKILL), the beats stop, so the
    serving nodes' heartbeat timeout ends them."""
    process = _node0(tmp_path, markers=(1, 2, 3))
    torchrun = _wait_for_torchrun(tmp_path, process)
    heartbeat = tmp_path / "run" / "job.alive"
    try:
        first = heartbeat.read_text()
        time.sleep(2.5)
        assert heartbeat.read_text() != first  # rewritten every HEARTBEAT_INTERVAL=1 s
        process.kill()
        process.wait(timeout=30)  # its pipes stay open in its orphans: no communicate()
        time.sleep(2.5)  # a beat in flight may still land
        last = heartbeat.read_text()
        time.sleep(2.5)
        assert heartbeat.read_text() == last
    finally:
        os.kill(torchrun, signal.SIGTERM)  # the fake torchrun, orphaned by SIGKILL
        process.stdout.close()
        process.stderr.close()
