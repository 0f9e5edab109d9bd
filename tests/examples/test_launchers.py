"""The Qwen3-MoE launchers (32-GPU Qwen3-30B-A3B, 64-GPU Qwen3-235B-A22B) and their SLURM
entries: valid bash, and the commands they would run (DRY_RUN=1) are accepted by the trainer's and
the server launcher's own argument checks (for 235B also megatron's `TransformerConfig` checks of
the pipeline split, and the memory plan of the layout the command asks for). The run scripts'
shared failure handling (common.sh: shared-filesystem check, heartbeat, torchrun under traps)
runs for real with a fake torchrun. Nothing here runs on a GPU: this proves the launchers' wiring,
not a cluster run."""

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
from ports import HeldPort

from megatron_rl.train.config import parse_args

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "qwen3_moe"
SCRIPT = EXAMPLES / "run_qwen3_30b_a3b.sh"
SBATCH = EXAMPLES / "slurm_qwen3_30b_a3b.sbatch"
SCRIPT_235B = EXAMPLES / "run_qwen3_235b_a22b.sh"
SBATCH_235B = EXAMPLES / "slurm_qwen3_235b_a22b.sbatch"
ROLLOUT_HOSTS_235B = "node4 node5 node6 node7"
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


def _dry_run(node_rank: int, script: Path = SCRIPT, **env) -> str:
    hosts = ROLLOUT_HOSTS_235B if script == SCRIPT_235B else "node2 node3"
    environment = _base_env(
        MASTER_ADDR="node0",
        ROLLOUT_HOSTS=hosts,
        NODE_RANK=str(node_rank),
        DRY_RUN="1",
        **env,
    )
    result = subprocess.run(
        ["bash", str(script)],
        cwd=ROOT,
        env=environment,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


LAUNCHER_FILES = sorted(p for p in EXAMPLES.rglob("*") if p.suffix in (".sh", ".sbatch"))


@pytest.mark.parametrize("script", LAUNCHER_FILES, ids=lambda p: str(p.relative_to(EXAMPLES)))
def test_launcher_is_valid_bash(script):
    subprocess.run(["bash", "-n", str(script)], check=True)


@pytest.mark.parametrize(("loss", "replay", "staleness"), [("vespo", "off", 8), ("epic", "r3", 4)])
def test_training_node_command_passes_the_trainer_checks(loss, replay, staleness):
    out = _dry_run(0, LOSS=loss, REPLAY=replay, STALENESS=str(staleness))
    argv = _train_argv(out)
    assert argv[0] == "torchrun" and "--nproc-per-node" in argv
    config = _trainer_config(argv)
    assert config.objective.loss == loss and config.replay.mode == replay
    assert config.updates_per_rollout == staleness
    assert config.data_parallel_size(16) == 8  # 2 nodes x 8 GPUs, TP 2
    assert len(config.engine.sglang_url) == 2 and config.engine.sglang_engine_ranks == 8


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
    assert config.objective.kl_coef == kl
    assert config.objective.reference_offload and config.optimizer.use_distributed_optimizer
    assert config.optimizer.overlap_grad_reduce


def test_training_nodes_get_cuda_device_max_connections_and_serving_nodes_the_heartbeat():
    assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in _dry_run(1).splitlines()
    serving = _dry_run(3)
    assert "CUDA_DEVICE_MAX_CONNECTIONS" not in serving
    heartbeat = "runs/qwen3-30b-a3b-vespo-off-N8/job.alive"
    assert f"# stops the servers when {heartbeat} is removed or unchanged for 300 s" in serving


def test_optimizer_cpu_offload_reaches_the_trainer():
    assert not _trainer_config(_train_argv(_dry_run(0))).optimizer.cpu_offload
    config = _trainer_config(
        _train_argv(_dry_run(0, OPTIMIZER_CPU_OFFLOAD="1", OPTIMIZER_OFFLOAD_FRACTION="0.5"))
    )
    assert config.optimizer.cpu_offload and config.optimizer.offload_fraction == 0.5
    assert config.optimizer.cpu_offload


def test_rerunning_the_same_command_resumes_and_the_first_run_starts_fresh(tmp_path):
    """--load is the --save folder: missing or empty means a fresh start, not an error."""
    from megatron_rl.train.run import resolve_load

    run_dir = tmp_path / "run"
    config = _trainer_config(_train_argv(_dry_run(0, RUN_DIR=str(run_dir))))
    assert config.checkpoint.load == config.checkpoint.save == f"{run_dir}/checkpoints"
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


def _slurm_dry_run(
    tmp_path: Path, hosts: list[str], sbatch: Path = SBATCH, **env
) -> subprocess.CompletedProcess:
    """The sbatch file's batch step with fake SLURM variables and a fake `scontrol`."""
    listing = "\\n".join(hosts)
    scontrol = f'[[ "$1 $2" == "show hostnames" ]] || exit 2\nprintf "{listing}\\n"\n'
    fake = _fake_bin(tmp_path, "scontrol", scontrol)
    environment = _base_env(
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST="gpu[01-04]",
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_CPUS_ON_NODE="96",
        DRY_RUN="1",
        **env,
    )
    environment["PATH"] = f"{fake}:{environment['PATH']}"
    return subprocess.run(
        ["bash", str(sbatch)], cwd=ROOT, env=environment, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip


def _per_node(out: str) -> tuple[str, dict[int, str]]:
    parts = re.split(r"^## node (\d+) \(\S+\)$", out, flags=re.M)
    return parts[0], {int(n): text for n, text in zip(parts[1::2], parts[2::2], strict=True)}


def test_slurm_entry_gives_every_node_commands_that_pass_the_checks(tmp_path):
    hosts = ["gpu01", "gpu02", "gpu03", "gpu04"]
    result = _slurm_dry_run(tmp_path, hosts, REPLAY="r3", LOSS="epic")
    assert result.returncode == 0, result.stderr
    head, nodes = _per_node(result.stdout)
    srun = shlex.split(head.strip())
    assert srun[0] == "srun" and "--kill-on-bad-exit=1" in srun
    assert "--ntasks-per-node=1" in srun and "--nodes=4" in srun
    # every core of the node to its one task, unbound (not one CPU for 8 ranks + servers)
    assert "--cpus-per-task=96" in srun and "--cpu-bind=none" in srun
    assert srun[-3:] == ["bash", str(SBATCH), "--node"]
    assert sorted(nodes) == [0, 1, 2, 3]
    for rank in (0, 1):
        out = nodes[rank]
        argv = _train_argv(out)
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--master-addr") + 1] == "gpu01"
        config = _trainer_config(argv)
        assert config.engine.sglang_url == ("http://gpu03:30000", "http://gpu04:30000")
        assert config.objective.loss == "epic" and config.replay.mode == "r3"
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
[[ -f "${RUN_DIR}/job.alive" ]] && echo yes > "${FAKE_DIR}/heartbeat_seen"
if [[ -n "${FAKE_EXIT:-}" ]]; then echo "$$" > "${FAKE_DIR}/torchrun.pid"; exit "${FAKE_EXIT}"; fi
trap 'echo term > "${FAKE_DIR}/torchrun.term"; kill "${child}"; exit 143' TERM
sleep 600 &
child=$!
echo "$$" > "${FAKE_DIR}/torchrun.pid"  # only once the trap is set: a test signals after this
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


@pytest.mark.slow
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


@pytest.mark.slow
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


# ----------------------------------------------------------------------------- Qwen3-235B-A22B
ARMS_235B = [("vespo", "off", 8), ("epic", "r3", 4), ("grpo", "r2", 8), ("gspo", "r2", 2)]


def _env_235b(**env) -> dict:
    return {"HF_CKPT": "/shared/Qwen3-235B-A22B", **env}


def _megatron_config(config, monkeypatch):
    """megatron-core's `TransformerConfig` of the 235B preset under ``config``'s parallel sizes:
    its own checks of heads / TP, the uneven pipeline split, experts / EP."""
    from megatron.core import parallel_state

    from megatron_rl.model.config import to_transformer_config
    from megatron_rl.model.presets import preset_config

    sizes = {
        "tensor_model_parallel": config.parallel.tensor_parallel,
        "pipeline_model_parallel": config.parallel.pipeline_parallel,
        "context_parallel": config.parallel.context_parallel,
        "expert_model_parallel": config.parallel.expert_parallel,
        "expert_tensor_parallel": 1,
    }
    for name, size in sizes.items():
        monkeypatch.setattr(parallel_state, f"get_{name}_world_size", lambda size=size: size)
    return to_transformer_config(preset_config("qwen3-235b-a22b"), config.model, use_te=False)


@pytest.mark.parametrize(("loss", "replay", "staleness"), ARMS_235B)
def test_235b_every_training_node_passes_the_trainer_and_megatron_checks(
    loss, replay, staleness, monkeypatch
):
    for rank in range(4):
        env = _env_235b(LOSS=loss, REPLAY=replay, STALENESS=str(staleness))
        out = _dry_run(rank, SCRIPT_235B, **env)
        assert "export CUDA_DEVICE_MAX_CONNECTIONS=1" in out.splitlines()
        assert ("# would wait up to 300 s" in out) == (rank == 0)
        argv = _train_argv(out)
        assert argv[argv.index("--nnodes") + 1] == "4"
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        config = _trainer_config(argv)
        assert config.objective.loss == loss and config.replay.mode == replay
        assert config.updates_per_rollout == staleness
        assert (config.parallel.tensor_parallel, config.parallel.pipeline_parallel) == (4, 4)
        assert config.parallel.expert_parallel == 8 and config.parallel.sequence_parallel
        assert config.parallel.context_parallel == 1
        assert config.data_parallel_size(32) == 2  # 4 nodes x 8 GPUs / (TP 4 x PP 4)
        assert len(config.engine.sglang_url) == 4 and config.engine.sglang_engine_ranks == 8
        assert config.optimizer.use_distributed_optimizer and config.optimizer.cpu_offload
        assert config.optimizer.offload_fraction == 1.0
        assert config.optimizer.cpu_offload
        assert config.checkpoint.ckpt_format == "torch_dist" and not config.checkpoint.async_save
        assert config.checkpoint.load == config.checkpoint.save
        assert config.objective.kl_coef == (1e-3 if loss in ("epic", "grpo", "gspo") else 0.0)
    # interleaved 1F1B: 2 chunks per stage of 24/24/24/22 layers, >= PP micro-batches per rank
    assert config.model.virtual_stages == 2
    assert config.schedule.global_batch_size // (2 * config.schedule.micro_batch_size) >= 4
    megatron = _megatron_config(config, monkeypatch)
    assert megatron.num_layers_in_first_pipeline_stage == 24
    assert megatron.num_layers_in_last_pipeline_stage == 22
    assert megatron.virtual_pipeline_model_parallel_size == 2
    assert megatron.pipeline_model_parallel_size == 4 and megatron.sequence_parallel
    assert megatron.recompute_granularity == "full"


def test_235b_serving_nodes_start_one_sglang_server_each():
    for rank in range(4, 8):
        out = _dry_run(rank, SCRIPT_235B, **_env_235b(REPLAY="r3"))
        assert "torchrun" not in out and "CUDA_DEVICE_MAX_CONNECTIONS" not in out
        assert "sglang.launch_server" in out and "--model-path /shared/Qwen3-235B-A22B" in out
        assert "--tp-size 8" in out and "--ep-size 8" in out
        assert "--mem-fraction-static 0.85" in out and "--enable-return-routed-experts" in out
        assert "CUDA_VISIBLE_DEVICES=0,1,2,3,4,5,6,7" in out
        heartbeat = "runs/qwen3-235b-a22b-vespo-r3-N8/job.alive"
        assert f"# stops the servers when {heartbeat} is removed or unchanged for 300 s" in out
        assert f".nodes/node{rank}: launch=" in out
    assert "--enable-return-routed-experts" not in _dry_run(4, SCRIPT_235B, **_env_235b())


def test_235b_options_reach_the_trainer():
    env = _env_235b(OPTIMIZER_OFFLOAD_FRACTION="0.9", ASYNC_SAVE="1", KL_COEF="0.01")
    config = _trainer_config(_train_argv(_dry_run(1, SCRIPT_235B, **env)))
    assert config.optimizer.offload_fraction == 0.9 and config.optimizer.cpu_offload
    assert config.checkpoint.async_save and config.checkpoint.ckpt_format == "torch_dist"
    assert config.objective.kl_coef == 0.01


def test_235b_node_rank_out_of_range_is_refused():
    environment = _base_env(
        **_env_235b(MASTER_ADDR="n0", ROLLOUT_HOSTS=ROLLOUT_HOSTS_235B, NODE_RANK="8", DRY_RUN="1")
    )
    result = subprocess.run(
        ["bash", str(SCRIPT_235B)], cwd=ROOT, env=environment, capture_output=True, text=True,
        timeout=120,
    )  # fmt: skip
    assert result.returncode == 1 and "NODE_RANK=8: must be 0..7" in result.stderr


@pytest.mark.slow
def test_235b_slurm_entry_derives_every_node_role_from_slurm(tmp_path):
    hosts = [f"gpu{i:02d}" for i in range(1, 9)]
    result = _slurm_dry_run(tmp_path, hosts, SBATCH_235B, **_env_235b(REPLAY="r3", LOSS="epic"))
    assert result.returncode == 0, result.stderr
    head, nodes = _per_node(result.stdout)
    srun = shlex.split(head.strip())
    assert srun[0] == "srun" and "--kill-on-bad-exit=1" in srun
    assert "--nodes=8" in srun and "--ntasks=8" in srun and "--ntasks-per-node=1" in srun
    assert "--cpus-per-task=96" in srun and "--cpu-bind=none" in srun
    assert srun[-3:] == ["bash", str(SBATCH_235B), "--node"]
    assert sorted(nodes) == list(range(8))
    urls = tuple(f"http://gpu{i:02d}:30000" for i in range(5, 9))
    for rank in range(4):
        out = nodes[rank]
        argv = _train_argv(out)
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--master-addr") + 1] == "gpu01"
        config = _trainer_config(argv)
        assert config.engine.sglang_url == urls and config.replay.mode == "r3"
        assert config.data_parallel_size(32) == 2
        assert f".nodes/node{rank}: launch=4242 " in out
        assert ("# would wait up to 300 s for RUN_DIR/.nodes/node0 .. node7" in out) == (rank == 0)
    for rank in range(4, 8):
        out = nodes[rank]
        assert "torchrun" not in out and "sglang.launch_server" in out
        assert "--enable-return-routed-experts" in out
        assert f".nodes/node{rank}: launch=4242 " in out


def test_235b_slurm_entry_refuses_a_wrong_allocation(tmp_path):
    result = _slurm_dry_run(tmp_path, ["gpu01", "gpu02", "gpu03", "gpu04"], SBATCH_235B)
    assert result.returncode != 0
    assert "the allocation has 4 nodes (gpu01 gpu02 gpu03 gpu04); this job needs 8" in result.stderr


def _plan_of(config, world_size: int, **overrides):
    """The memory plan of the layout and batch a trainer config asks for (KL arms: the reference
    counted on the GPU, as during its pass)."""
    from megatron_rl.memory_plan import Layout, PlanOptions, load_model_config, plan_memory
    from megatron_rl.model.stages import megatron_stage_layers
    from megatron_rl.parallel import ParallelConfig

    sizes = {
        "tp": config.parallel.tensor_parallel,
        "pp": config.parallel.pipeline_parallel,
        "ep": config.parallel.expert_parallel,
        "first": config.model.first_stage_layers,
        "last": config.model.last_stage_layers,
        "vp": config.model.virtual_stages or 1,
        "offload": config.optimizer.offload_fraction if config.optimizer.cpu_offload else 0.0,
        **overrides,
    }
    hf = load_model_config("qwen3-235b-a22b")
    parallel = ParallelConfig(
        tensor_parallel=sizes["tp"],
        pipeline_parallel=sizes["pp"],
        expert_parallel=sizes["ep"],
        sequence_parallel=config.parallel.sequence_parallel,
    )
    stages = megatron_stage_layers(hf.num_hidden_layers, sizes["pp"], sizes["first"], sizes["last"])
    length = config.task.max_prompt_length + config.rollout.max_response_length
    tokens = config.schedule.micro_batch_size * length
    dense = sizes["tp"] * sizes["pp"] * config.parallel.context_parallel
    options = PlanOptions(
        micro_batches=config.schedule.global_batch_size
        // (world_size // dense * config.schedule.micro_batch_size),
        params_dtype=config.model.dtype,
        distributed_optimizer=config.optimizer.use_distributed_optimizer,
        recompute="full" if config.model.recompute else "none",
        micro_batch_tokens=tokens,
        routing_replay=config.replay.mode,
        routing_responses=config.samples_per_rollout if config.replay.mode != "off" else None,
        routing_response_tokens=tokens if config.replay.mode != "off" else None,
        reference="gpu" if config.objective.kl_coef > 0 else "off",
        optimizer_offload_fraction=sizes["offload"],
    )
    layout = Layout.from_world_size(parallel, world_size, stages, sizes["vp"])
    return plan_memory(hf, layout, options, gpu_gib=80)


def test_235b_memory_plan_of_the_launched_layout_fits_and_no_pipeline_does_not():
    config = _trainer_config(
        _train_argv(_dry_run(0, SCRIPT_235B, **_env_235b(LOSS="epic", REPLAY="r2")))
    )
    assert config.objective.kl_coef > 0 and config.replay.mode == "r2"  # the fullest arm
    plan = _plan_of(config, 32)
    assert plan.layout.stage_layers(94) == (24, 24, 24, 22)
    assert plan.layout.chunk_layers(94)[3] == ((36, 11), (83, 11))  # virtual stages 3 and 7
    assert plan.fits, plan.total_bytes / 2**30
    # the run script's comment: 69.7 GiB on stage 0 (with the weight sync's 1 GiB of staging,
    # which this plan leaves out); 11 (chunk, micro-batch) pairs in flight there, 3/64 bubble
    assert 64 < plan.total_bytes / 2**30 < 74 and plan.peak.params.stage == 0
    assert plan.pipeline.in_flight == (11, 9, 7, 5) and plan.pipeline.bubble == 3 / 64
    plain = _plan_of(config, 32, vp=1, first=23, last=23)
    assert plain.pipeline.in_flight == (4, 3, 2, 1) and plain.pipeline.bubble == 3 / 32
    assert plain.stages[0].stored.end < plan.stages[0].stored.end
    assert plan.peak.term("reference model").on_gpu
    host = plan.peak.term("optimizer: offloaded to host")
    assert not host.on_gpu and 100 * 2**30 < host.nbytes < 115 * 2**30
    # the optimizer offload is what makes it fit, and 0.9 of it is enough, 0.8 is not
    assert not _plan_of(config, 32, offload=0.0).fits
    assert _plan_of(config, 32, offload=0.9).fits
    assert not _plan_of(config, 32, offload=0.8).fits
    # without pipeline parallelism on the same 32 GPUs: EP8 and EP16 do not fit this arm, EP32
    # only just (the plan's peak-phase timeline, chunked gradient check: < 2 GiB to spare)
    no_pipeline = {"pp": 1, "first": None, "last": None, "vp": 1}
    for ep in (8, 16):
        assert not _plan_of(config, 32, ep=ep, **no_pipeline).fits, ep
    ep32 = _plan_of(config, 32, ep=32, **no_pipeline)
    assert ep32.fits and 78 < ep32.total_bytes / 2**30 < 80, ep32.total_bytes / 2**30
    no_pp = _plan_of(config, 32, ep=16, **no_pipeline).peak
    params_and_grads = sum(
        no_pp.term(name).nbytes
        for name in ("parameters: dense", "parameters: experts", "gradient buffers")
    )
    assert params_and_grads > 90 * 2**30  # the figure at EP16
    # nor do 16 GPUs with pipeline parallelism
    assert not _plan_of(config, 16, ep=4, vp=1, first=23, last=23).fits


@pytest.mark.parametrize("script, env", [(SCRIPT, {}), (SCRIPT_235B, "235b")])
def test_asynchrony_knobs_reach_the_trainer(script, env):
    """ASYNC / PARTIAL / CARRY_OVER / MASK_STALE become the trainer's flags, and the trainer's
    checks accept them (the engine's log-probs as behaviour, retract pauses)."""
    base = _env_235b() if env == "235b" else {}
    node = 1
    plain = _trainer_config(_train_argv(_dry_run(node, script, **base)))
    assert not plain.rollout.async_rollout and not plain.rollout.carry_over_groups
    knobs = dict(ASYNC="2", PARTIAL="1", CARRY_OVER="16", CARRY_OVER_ROUND_TOKENS="2048")
    config = _trainer_config(_train_argv(_dry_run(node, script, **base, **knobs, MASK_STALE="1")))
    rollout = config.rollout
    assert rollout.async_rollout and rollout.max_staleness == 2 and rollout.partial_rollout
    assert rollout.carry_over_groups == 16 and rollout.round_tokens == 2048
    assert rollout.mask_stale_tokens and config.objective.behavior_logprobs == "rollout"
    assert config.engine.sglang_pause_mode == "retract"


# ----------------------------------------------------------------------------- colocated 30B
SCRIPT_COLOCATED = EXAMPLES / "run_qwen3_30b_a3b_colocated.sh"
SBATCH_COLOCATED = EXAMPLES / "slurm_qwen3_30b_a3b_colocated.sbatch"
COLOCATED_HOSTS = "node0 node1 node2 node3"


def _colocated(node_rank: int, **env) -> subprocess.CompletedProcess:
    variables = {"NODE_HOSTS": COLOCATED_HOSTS, "NODE_RANK": str(node_rank), "DRY_RUN": "1"}
    return subprocess.run(
        ["bash", str(SCRIPT_COLOCATED)], cwd=ROOT, env=_base_env(**{**variables, **env}),
        capture_output=True, text=True, timeout=120,
    )  # fmt: skip


def _server_env_and_argv(out: str) -> tuple[dict[str, str], list[str]]:
    """The SGLang server command of a colocated node's DRY_RUN output (as
    `megatron_rl.rollout.serve --dry-run` prints it: ``NAME=VALUE ... python -m ...``)."""
    (line,) = [line for line in out.splitlines() if "sglang.launch_server" in line]
    words = shlex.split(line)
    env = dict(word.split("=", 1) for word in words if "=" in word and not word.startswith("-"))
    return env, [word for word in words if word.split("=", 1)[0] not in env]


def _server_argv(out: str) -> list[str]:
    return _server_env_and_argv(out)[1]


def test_colocated_every_node_trains_and_serves_on_its_own_gpus():
    urls = tuple(f"http://node{i}:30000" for i in range(4))
    for rank in range(4):
        result = _colocated(rank)
        assert result.returncode == 0, result.stderr
        out = result.stdout
        lines = out.splitlines()
        server = next(i for i, line in enumerate(lines) if "sglang.launch_server" in line)
        train = next(i for i, line in enumerate(lines) if line.startswith("torchrun "))
        assert server < train  # the server sizes its KV pool before the trainer allocates
        assert (
            "# would start it in the background, wait up to 900 s until it answers /health" in out
        )
        env, argv = _server_env_and_argv(out)
        assert "--enable-memory-saver" in argv and "--disable-prefill-cuda-graph" in argv
        assert env["SGLANG_MEMORY_SAVER_CUDA_GRAPH"] == "1"  # the cuda_graph tag frees memory
        for flag, value in (("--tp-size", "8"), ("--ep-size", "8"), ("--host", "0.0.0.0")):
            assert argv[argv.index(flag) + 1] == value
        assert argv[argv.index("--mem-fraction-static") + 1] == "0.76"  # the plan's, 80 GiB
        torchrun = _train_argv(out)
        assert torchrun[torchrun.index("--nnodes") + 1] == "4"
        assert torchrun[torchrun.index("--node-rank") + 1] == str(rank)
        assert torchrun[torchrun.index("--master-addr") + 1] == "node0"
        config = _trainer_config(torchrun)
        engine = config.engine
        assert engine.colocate and engine.weight_sync_transport == "tensor"
        assert engine.sglang_engine_ranks == 8 and engine.sglang_url == urls
        assert config.data_parallel_size(32) == 16  # 4 nodes x 8 GPUs, TP 2
        assert ("# would wait up to 300 s" in out) == (rank == 0)


@pytest.mark.parametrize("replay", ["off", "r3"])
def test_colocated_server_command_is_the_server_launchers_plus_the_memory_saver(replay):
    from megatron_rl.rollout.launch import SGLangServerConfig, server_command

    argv = _server_argv(_colocated(2, REPLAY=replay, MEM_FRACTION="0.86").stdout)
    config = SGLangServerConfig(
        model_path="/shared/Qwen3-30B-A3B",
        port=30000,
        host="0.0.0.0",
        tp_size=8,
        ep_size=8,
        mem_fraction_static=0.86,
        return_routed_experts=replay == "r3",
        extra_args=("--enable-memory-saver", "--disable-prefill-cuda-graph"),
    )
    assert argv[1:] == server_command(config)[1:]  # all but the interpreter's path
    trainer = _trainer_config(_train_argv(_colocated(0, REPLAY=replay).stdout))
    assert trainer.replay.mode == replay


def _sglang_sources() -> list[Path]:
    """The ``sglang/srt`` folders of the installed SGLang: the lean server venv's and this
    interpreter's (located without importing sglang, which needs its server's packages)."""
    import importlib.util

    folders = sorted(ROOT.glob(".venv-sglang/lib/python*/site-packages/sglang/srt"))
    spec = importlib.util.find_spec("sglang")
    if spec is not None and spec.origin is not None:
        folders.append(Path(spec.origin).parent / "srt")
    return [folder for folder in folders if (folder / "arg_groups" / "fields").is_dir()]


def _server_arg_fields(srt: Path) -> set[str]:
    """The field names of SGLang's `ServerArgs` (its ``arg_groups/fields`` dataclasses, whose
    names become the flags: ``enable_memory_saver`` is ``--enable-memory-saver``)."""
    import ast

    names = set()
    for path in (srt / "arg_groups" / "fields").glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.AnnAssign) and isinstance(node.target, ast.Name):
                names.add(node.target.id)
    return names


def test_colocated_sglang_flags_and_environment_exist_in_the_installed_sglang():
    """Every SGLang flag and variable the colocated server gets is SGLang's own (0.5.23): the
    memory saver, the switch that keeps the breakable prefill CUDA-graph backend (which refuses
    the memory saver's graph pool) off, the KV fraction, and ``SGLANG_MEMORY_SAVER_CUDA_GRAPH``
    (without it the ``cuda_graph`` release tag frees nothing)."""
    from megatron_rl.rollout.serve import MEMORY_SAVER_ARGS, MEMORY_SAVER_ENV

    sources = _sglang_sources()
    if not sources:
        pytest.skip("no installed sglang sources (make sglang-env)")
    env, argv = _server_env_and_argv(_colocated(0).stdout)
    flags = [word for word in argv if word.startswith("--")]
    assert set(MEMORY_SAVER_ARGS) <= set(flags) and MEMORY_SAVER_ENV.items() <= env.items()
    for srt in sources:
        fields = _server_arg_fields(srt)
        for flag in flags:
            assert flag.removeprefix("--").replace("-", "_") in fields, (srt, flag)
        environ = (srt / "environ.py").read_text()
        for name in MEMORY_SAVER_ENV:
            assert f"\n    {name} = EnvBool(" in environ, (srt, name)
        breakable = srt / "model_executor/runner_backend/breakable_cuda_graph_backend.py"
        assert "not compatible with memory saver" in breakable.read_text()


@pytest.mark.parametrize(
    ("env", "message"),
    [
        ({"ASYNC": "2"}, "ASYNC=2: colocated mode is synchronous"),
        ({"ARM": "ctpo"}, "ARM=ctpo: colocated mode is synchronous"),
        ({"MASK_STALE": "1"}, "MASK_STALE=1: colocated mode is synchronous"),
        ({"RECIPE": "epic-paper"}, "RECIPE=epic-paper: colocated mode is synchronous"),
        ({"PARTIAL": "1"}, "PARTIAL=1: colocated mode is synchronous"),
        ({"NODE_HOSTS": "node0 node1"}, "NODE_HOSTS has 2 hosts (node0 node1); this job needs 4"),
        ({"NODE_RANK": "4"}, "NODE_RANK=4: must be 0..3"),
    ],
)
def test_colocated_refuses_what_it_cannot_run(env, message):
    result = _colocated(0, **env)
    assert result.returncode != 0 and message in result.stderr


def test_colocated_memory_plan_gives_the_launchers_mem_fraction():
    """The run script's numbers: the plan of the trainer's own layout on 32 GPUs. The trainer
    releases the servers' KV cache and CUDA graphs before it builds, so the rollout-optimal
    fraction is the default: start-up holds the servers' weights only, below the sync phase."""
    from megatron_rl.memory_plan import (
        GIB,
        Layout,
        PlanOptions,
        load_model_config,
        plan_colocated,
        plan_memory,
    )
    from megatron_rl.memory_plan.colocate import PHASE_STARTUP, PHASE_SYNC
    from megatron_rl.parallel import ParallelConfig

    out = _colocated(0).stdout
    config = _trainer_config(_train_argv(out))
    p = config.parallel
    parallel = ParallelConfig(
        tensor_parallel=p.tensor_parallel,
        expert_parallel=p.expert_parallel,
        sequence_parallel=p.sequence_parallel,
    )
    tokens = config.task.max_prompt_length + config.rollout.max_response_length
    options = PlanOptions(micro_batch_tokens=tokens)
    hf = load_model_config("qwen3-30b-a3b")
    by_gpu = {}
    for gpu in (80, 141):
        plan = plan_memory(hf, Layout.from_world_size(parallel, 32), options, gpu_gib=gpu)
        by_gpu[gpu] = plan_colocated(plan)
    h100, h200 = by_gpu[80], by_gpu[141]
    assert h100.fits and h200.fits
    assert (h100.mem_fraction_static, h200.mem_fraction_static) == (0.76, 0.86)
    server = _server_argv(out)
    assert float(server[server.index("--mem-fraction-static") + 1]) == h100.mem_fraction_static
    assert h100.kv_tokens == 2_345_803 and h200.kv_tokens == 4_987_341
    assert h100.kv_bytes_per_token == 48 * 2 * 1 * 128 * 2
    for colocated in (h100, h200):
        startup, sync = (colocated.phase(name).nbytes for name in (PHASE_STARTUP, PHASE_SYNC))
        assert startup == sync - 512 * 1024**2 < 50 * GIB  # no KV cache, no CUDA graphs
    assert 280 * GIB < h100.host_bytes_per_node < 285 * GIB  # of 2 TiB
    script = SCRIPT_COLOCATED.read_text()
    assert f"MEM_FRACTION=${{MEM_FRACTION:-{h100.mem_fraction_static}}}" in script
    assert f"MEM_FRACTION={h200.mem_fraction_static}" in script  # the 141-GiB advice
    assert f"{h100.kv_tokens:,} tokens" in script and f"{h200.kv_tokens:,}" in script
    assert "start-up-safe" not in script


def test_colocated_slurm_entry_runs_every_node_as_trainer_and_server(tmp_path):
    hosts = ["gpu01", "gpu02", "gpu03", "gpu04"]
    result = _slurm_dry_run(tmp_path, hosts, SBATCH_COLOCATED)
    assert result.returncode == 0, result.stderr
    head, nodes = _per_node(result.stdout)
    srun = shlex.split(head.strip())
    assert "--nodes=4" in srun and "--kill-on-bad-exit=1" in srun
    assert srun[-3:] == ["bash", str(SBATCH_COLOCATED), "--node"]
    assert sorted(nodes) == [0, 1, 2, 3]
    for rank, out in nodes.items():
        assert "--enable-memory-saver" in _server_argv(out)
        assert "torchrun --nnodes 4 " in out
        argv = _train_argv(out)
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        assert argv[argv.index("--master-addr") + 1] == "gpu01"
        urls = _trainer_config(argv).engine.sglang_url
        assert urls == tuple(f"http://{host}:30000" for host in hosts)


@pytest.mark.parametrize("count", [1, 2])
def test_colocated_slurm_entry_takes_any_number_of_nodes(tmp_path, count):
    hosts = [f"gpu{i:02d}" for i in range(1, count + 1)]
    result = _slurm_dry_run(tmp_path, hosts, SBATCH_COLOCATED)
    assert result.returncode == 0, result.stderr
    head, nodes = _per_node(result.stdout)
    assert f"--nodes={count}" in shlex.split(head.strip()) and sorted(nodes) == list(range(count))
    for rank, out in nodes.items():
        argv = _train_argv(out)
        assert argv[argv.index("--nnodes") + 1] == str(count)
        assert argv[argv.index("--node-rank") + 1] == str(rank)
        config = _trainer_config(argv)
        assert config.engine.sglang_url == tuple(f"http://{host}:30000" for host in hosts)
        assert config.data_parallel_size(8 * count) == 4 * count  # TP 2


FAKE_SERVER = """
echo "$$" > "${FAKE_DIR}/server.pid"
exec python3 -m http.server "${FAKE_PORT}" --bind 127.0.0.1 --directory "${FAKE_DIR}/www"
"""


@pytest.fixture
def server_port():
    """The fake server's port, held by the test until the server (``http.server`` binds with
    ``SO_REUSEADDR``) has it: no other process can be given it in between."""
    with HeldPort() as port:
        yield port


def _colocated_node(tmp_path: Path, server: str, port: int, **env) -> subprocess.Popen:
    """One colocated node for real, started: ``server`` is the fake SGLang interpreter's script,
    ``port`` its SGLANG_PORT; the fake torchrun exits FAKE_EXIT (3) or waits for SIGTERM
    (``FAKE_EXIT=""``)."""
    fake = _fake_bin(tmp_path, "torchrun", FAKE_TORCHRUN)
    python = _fake_bin(tmp_path, "fake-sglang-python", server) / "fake-sglang-python"
    run_dir = tmp_path / "run"
    (run_dir / ".nodes").mkdir(parents=True)
    environment = _base_env(
        NODE_HOSTS="h0", NUM_NODES="1", NODE_RANK="0", RUN_DIR=str(run_dir), LAUNCH_ID="L7",
        SGLANG_PORT=str(port), FAKE_PORT=str(port), FAKE_DIR=str(tmp_path),
        SGLANG_PYTHON=str(python), HEARTBEAT_INTERVAL="1", **{"FAKE_EXIT": "3", **env},
    )  # fmt: skip
    environment["PATH"] = f"{fake}:{environment['PATH']}"
    return subprocess.Popen(
        ["bash", str(SCRIPT_COLOCATED)], cwd=ROOT, env=environment, text=True,
        stdout=subprocess.PIPE, stderr=subprocess.PIPE,
    )  # fmt: skip


@pytest.mark.slow  # ~3 s: waits on real processes
def test_colocated_node_starts_its_server_first_and_stops_it_when_training_fails(
    tmp_path, server_port
):
    """For real, with a fake server (answers /health) and a fake torchrun that exits 3: the
    node exits 3 and its server's process group is gone."""
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("ok")
    process = _colocated_node(tmp_path, FAKE_SERVER, server_port)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 3, err
    assert (tmp_path / "torchrun.pid").exists()  # training started after /health answered
    server_pid = int((tmp_path / "server.pid").read_text())
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)
    assert (tmp_path / "run" / "sglang-node0.log").exists()


def test_colocated_node_fails_without_training_when_its_server_dies_at_start(tmp_path, server_port):
    process = _colocated_node(tmp_path, 'echo "no GPU" >&2; exit 1\n', server_port)
    _, err = process.communicate(timeout=120)
    assert process.returncode == 1
    assert "node 0's SGLang server exited before answering /health; see " in err
    assert not (tmp_path / "torchrun.pid").exists()
    assert "no GPU" in (tmp_path / "run" / "sglang-node0.log").read_text()


@pytest.mark.slow  # ~3 s: waits on real processes
def test_sigterm_stops_the_colocated_nodes_training_then_its_server(tmp_path, server_port):
    (tmp_path / "www").mkdir()
    (tmp_path / "www" / "health").write_text("ok")
    process = _colocated_node(tmp_path, FAKE_SERVER, server_port, FAKE_EXIT="")
    _wait_for_torchrun(tmp_path, process)
    server_pid = int((tmp_path / "server.pid").read_text())
    process.send_signal(signal.SIGTERM)
    _, err = process.communicate(timeout=60)
    assert process.returncode == 143, err
    assert (tmp_path / "torchrun.term").read_text() == "term\n"  # torchrun got the signal
    with pytest.raises(ProcessLookupError):
        os.kill(server_pid, 0)
