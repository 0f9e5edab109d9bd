"""The DRY_RUN cases of the launchers (Qwen3-MoE, DeepSeek-V3, GLM-4.5) whose output is pinned
byte for byte in ``tests/examples/dry_run/`` (one file per case: exit status, stdout, stderr).

A case is a launcher (run script or SLURM entry), a node, and the environment variables the
launchers read. Paths of this checkout and of the interpreter are written as ``<repo>`` and
``<python>``, so the files hold no machine's paths; in stderr, bash's ``FILE: line N:`` prefix
loses its line number (moving code must not change a pinned message).

``python tests/examples/launcher_cases.py --write`` rewrites every file from the launchers as
they are; a change of a launcher's output is then a reviewed diff of these files.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXAMPLES = ROOT / "examples" / "qwen3_moe"
FIXTURES = Path(__file__).resolve().parent / "dry_run"
EVAL_DATA = "aime24=/shared/aime24.jsonl aime25=/shared/aime25.jsonl"

RUN_30B = "run_qwen3_30b_a3b.sh"
RUN_235B = "run_qwen3_235b_a22b.sh"
RUN_COLOCATED = "run_qwen3_30b_a3b_colocated.sh"
RUN_LORA = "run_qwen3_30b_a3b_lora.sh"
# the other families' launchers, relative to EXAMPLES (they reuse its common.sh and nodes.sh)
RUN_DEEPSEEK = "../deepseek_v3/run_deepseek_v3.sh"
RUN_GLM = "../glm4_moe/run_glm_4_5.sh"
HOSTS = {
    RUN_30B: {"MASTER_ADDR": "node0", "ROLLOUT_HOSTS": "node2 node3"},
    RUN_235B: {"MASTER_ADDR": "node0", "ROLLOUT_HOSTS": "node4 node5 node6 node7"},
    RUN_COLOCATED: {"NODE_HOSTS": "node0 node1 node2 node3"},
    RUN_LORA: {"MASTER_ADDR": "node0", "ROLLOUT_HOSTS": "node1"},
}
CKPT = {
    RUN_30B: "/shared/Qwen3-30B-A3B",
    RUN_235B: "/shared/Qwen3-235B-A22B",
    RUN_COLOCATED: "/shared/Qwen3-30B-A3B",
    RUN_LORA: "/shared/Qwen3-30B-A3B",
    RUN_DEEPSEEK: "/shared/DeepSeek-V3-bf16",
    RUN_GLM: "/shared/GLM-4.5",
}
DEEPSEEK_FP8 = {"SERVE_CKPT": "/shared/DeepSeek-V3"}
ASYNC_KNOBS = {
    "ASYNC": "2",
    "PARTIAL": "1",
    "CARRY_OVER": "16",
    "CARRY_OVER_ROUND_TOKENS": "2048",
    "MASK_STALE": "1",
}
EVERY_KNOB = {
    "RUN_DIR": "/shared/runs/a",
    "SGLANG_PORT": "31000",
    "MASTER_PORT": "29600",
    "WANDB_PROJECT": "p",
    "LAUNCH_ID": "L1",
    "NODE_WAIT_S": "60",
    "HEARTBEAT_INTERVAL": "5",
    "HEARTBEAT_TIMEOUT": "100",
}


def _run(script: str, rank: int, **env: str) -> tuple[str, str, int, dict]:
    return (script, "run", rank, env)


def _job(script: str, train_nodes: int, rank: int, **env: str) -> tuple[str, str, int, dict]:
    """A DeepSeek-V3 / GLM-4.5 job of ``train_nodes`` training and as many serving nodes."""
    hosts = " ".join(f"node{train_nodes + i}" for i in range(train_nodes))
    env = {"MASTER_ADDR": "node0", "ROLLOUT_HOSTS": hosts, "TRAIN_NODES": str(train_nodes), **env}
    return (script, "run", rank, env)


# name -> (launcher, kind "run" | "slurm", node rank or allocation size, environment)
CASES: dict[str, tuple[str, str, int, dict]] = {
    # --------------------------------------------------------------- 30B, disaggregated
    "30b_node0": _run(RUN_30B, 0),
    "30b_node1": _run(RUN_30B, 1),
    "30b_node2": _run(RUN_30B, 2),
    "30b_node3_r3": _run(RUN_30B, 3, REPLAY="r3"),
    # a serving node runs SGLang with its own interpreter (sglang pins torch / transformers)
    "30b_node2_sglang_python": _run(RUN_30B, 2, SGLANG_PYTHON="/opt/sglang/bin/python"),
    # the shape overrides (the one-machine rehearsal's): layout, GPUs, server shape and flags
    "30b_node0_shape_overrides": _run(
        RUN_30B,
        0,
        GPUS_PER_NODE="1",
        TRAIN_PARALLEL="--expert-model-parallel-size 2",
        TRAIN_EXTRA_ARGS="--device cpu --train-iters 6",
    ),
    "30b_node3_shape_overrides": _run(
        RUN_30B,
        3,
        SERVER_TP="1",
        SERVER_EP="1",
        SERVER_MEM_FRACTION="0.05",
        SERVER_BIND_HOST="127.0.0.3",
        SGLANG_EXTRA_ARGS="--device cpu --grammar-backend none",
    ),
    "30b_node0_epic_r3_n4": _run(RUN_30B, 0, LOSS="epic", REPLAY="r3", STALENESS="4"),
    "30b_node0_gspo": _run(RUN_30B, 0, LOSS="gspo"),
    "30b_node0_gspo_token_r2": _run(RUN_30B, 0, LOSS="gspo_token", REPLAY="r2"),
    "30b_node0_grpo": _run(RUN_30B, 0, LOSS="grpo"),
    "30b_node0_dapo": _run(RUN_30B, 0, LOSS="dapo"),
    "30b_node0_ctpo": _run(RUN_30B, 0, LOSS="ctpo"),
    "30b_node0_vespo_kl": _run(RUN_30B, 0, KL_COEF="0.01"),
    "30b_node0_epic_kl0": _run(RUN_30B, 0, LOSS="epic", KL_COEF="0"),
    "30b_node0_offload": _run(
        RUN_30B, 0, OPTIMIZER_CPU_OFFLOAD="1", OPTIMIZER_OFFLOAD_FRACTION="0.5"
    ),
    "30b_node0_offload_default": _run(RUN_30B, 0, OPTIMIZER_CPU_OFFLOAD="1"),
    "30b_node1_async": _run(RUN_30B, 1, **ASYNC_KNOBS),
    "30b_node1_async_only": _run(RUN_30B, 1, ASYNC="4"),
    "30b_node0_knobs": _run(RUN_30B, 0, **EVERY_KNOB),
    "30b_node2_knobs": _run(RUN_30B, 2, **EVERY_KNOB),
    "30b_node0_recipe_epic_ctpo": _run(
        RUN_30B, 0, RECIPE="epic-paper", ARM="ctpo", EVAL_DATA=EVAL_DATA
    ),
    "30b_node2_recipe_epic_grpo_r3": _run(
        RUN_30B, 2, RECIPE="epic-paper", ARM="grpo-r3", EVAL_DATA=EVAL_DATA
    ),
    "30b_node0_recipe_vespo_n32": _run(
        RUN_30B, 0, RECIPE="vespo-paper", ARM="vespo", EVAL_DATA=EVAL_DATA, STALENESS="32"
    ),
    "30b_node0_recipe_study_r3rec": _run(
        RUN_30B, 0, RECIPE="study", ARM="grpo-r3rec", EVAL_DATA=EVAL_DATA, KL_COEF="0.5"
    ),
    "30b_node4_refused": _run(RUN_30B, 4),
    "30b_recipe_without_arm": _run(RUN_30B, 0, RECIPE="epic-paper", EVAL_DATA=EVAL_DATA),
    # --------------------------------------------------------------- 30B LoRA, one training node
    "30b_lora_node0": _run(RUN_LORA, 0),
    "30b_lora_node1_r3": _run(RUN_LORA, 1, REPLAY="r3"),
    "30b_lora_node0_knobs": _run(
        RUN_LORA, 0, LORA_RANK="16", LORA_TARGETS="attention", LORA_LR="2e-5", LOSS="grpo"
    ),
    "30b_lora_node2_refused": _run(RUN_LORA, 2),
    # --------------------------------------------------------------- 235B, disaggregated
    "235b_node0": _run(RUN_235B, 0),
    "235b_node1": _run(RUN_235B, 1),
    "235b_node3_epic_r2": _run(RUN_235B, 3, LOSS="epic", REPLAY="r2"),
    "235b_node0_gspo_r2_n2": _run(RUN_235B, 0, LOSS="gspo", REPLAY="r2", STALENESS="2"),
    "235b_node4": _run(RUN_235B, 4),
    "235b_node7_r3": _run(RUN_235B, 7, REPLAY="r3"),
    "235b_node1_options": _run(
        RUN_235B, 1, OPTIMIZER_OFFLOAD_FRACTION="0.9", ASYNC_SAVE="1", KL_COEF="0.01"
    ),
    "235b_node1_async": _run(RUN_235B, 1, **ASYNC_KNOBS),
    "235b_node0_knobs": _run(RUN_235B, 0, **EVERY_KNOB),
    "235b_node5_knobs": _run(RUN_235B, 5, **EVERY_KNOB),
    "235b_node0_recipe_epic_ctpo": _run(
        RUN_235B, 0, RECIPE="epic-paper", ARM="ctpo", EVAL_DATA=EVAL_DATA
    ),
    "235b_node8_refused": _run(RUN_235B, 8),
    # --------------------------------------------------------------- 30B, colocated
    "colocated_node0": _run(RUN_COLOCATED, 0),
    "colocated_node2": _run(RUN_COLOCATED, 2),
    "colocated_node1_r3_h200": _run(RUN_COLOCATED, 1, REPLAY="r3", MEM_FRACTION="0.86"),
    "colocated_node0_epic": _run(RUN_COLOCATED, 0, LOSS="epic", STALENESS="4"),
    "colocated_node3_gspo_kl": _run(RUN_COLOCATED, 3, LOSS="gspo", KL_COEF="0.002"),
    "colocated_node0_knobs": _run(
        RUN_COLOCATED, 0, SERVER_WAIT_S="60", SGLANG_PYTHON="/opt/sglang/bin/python", **EVERY_KNOB
    ),
    "colocated_one_node": _run(RUN_COLOCATED, 0, NUM_NODES="1", NODE_HOSTS="h0"),
    "colocated_async_refused": _run(RUN_COLOCATED, 0, ASYNC="2"),
    "colocated_recipe_refused": _run(RUN_COLOCATED, 0, RECIPE="epic-paper"),
    "colocated_partial_refused": _run(RUN_COLOCATED, 0, PARTIAL="1"),
    "colocated_carry_over_refused": _run(RUN_COLOCATED, 0, CARRY_OVER="8"),
    "colocated_hosts_refused": _run(RUN_COLOCATED, 0, NODE_HOSTS="node0 node1"),
    "colocated_node4_refused": _run(RUN_COLOCATED, 4),
    "colocated_arm_refused": _run(RUN_COLOCATED, 0, ARM="ctpo"),
    "colocated_mask_stale_refused": _run(RUN_COLOCATED, 0, MASK_STALE="1"),
    # --------------------------------------------------------------- DeepSeek-V3, GLM-4.5
    "deepseek_v3_256_node0": _job(RUN_DEEPSEEK, 16, 0, **DEEPSEEK_FP8),
    "deepseek_v3_256_node16_r3": _job(RUN_DEEPSEEK, 16, 16, REPLAY="r3", **DEEPSEEK_FP8),
    "deepseek_v3_128_node0_epic_r2": _job(
        RUN_DEEPSEEK, 8, 0, LOSS="epic", REPLAY="r2", **DEEPSEEK_FP8
    ),
    "deepseek_v3_128_node7_async": _job(RUN_DEEPSEEK, 8, 7, **ASYNC_KNOBS, **DEEPSEEK_FP8),
    "deepseek_v3_128_node8": _job(RUN_DEEPSEEK, 8, 8, **DEEPSEEK_FP8),
    "deepseek_v3_without_serve_ckpt": _job(RUN_DEEPSEEK, 8, 0),
    "deepseek_v3_train_nodes_refused": _job(RUN_DEEPSEEK, 4, 0, **DEEPSEEK_FP8),
    "glm_4_5_128_node0": _job(RUN_GLM, 8, 0),
    "glm_4_5_128_node8_r3": _job(RUN_GLM, 8, 8, REPLAY="r3"),
    "glm_4_5_64_node0_epic_r2": _job(RUN_GLM, 4, 0, LOSS="epic", REPLAY="r2"),
    "glm_4_5_64_node3_recipe_epic_ctpo": _job(
        RUN_GLM, 4, 3, RECIPE="epic-paper", ARM="ctpo", EVAL_DATA=EVAL_DATA
    ),
    "glm_4_5_64_node4": _job(RUN_GLM, 4, 4),
    "glm_4_5_train_nodes_refused": _job(RUN_GLM, 2, 0),
    # --------------------------------------------------------------- SLURM entries
    "slurm_30b": ("slurm_qwen3_30b_a3b.sbatch", "slurm", 4, {"REPLAY": "r3", "LOSS": "epic"}),
    "slurm_30b_wrong_allocation": ("slurm_qwen3_30b_a3b.sbatch", "slurm", 3, {}),
    "slurm_235b": ("slurm_qwen3_235b_a22b.sbatch", "slurm", 8, {"LOSS": "gspo"}),
    "slurm_235b_wrong_allocation": ("slurm_qwen3_235b_a22b.sbatch", "slurm", 4, {}),
    "slurm_colocated": ("slurm_qwen3_30b_a3b_colocated.sbatch", "slurm", 4, {"REPLAY": "r3"}),
    "slurm_colocated_one_node": ("slurm_qwen3_30b_a3b_colocated.sbatch", "slurm", 1, {}),
    "slurm_colocated_two_nodes": ("slurm_qwen3_30b_a3b_colocated.sbatch", "slurm", 2, {}),
}

CLEARED = ("NODE_RANK", "MASTER_ADDR", "ROLLOUT_HOSTS", "NODE_HOSTS", "LAUNCH_ID", "PYTHON")


def _environment(script: str, **env: str) -> dict:
    """The test process's environment without launch variables (the case sets its own), the
    interpreter's folder first on PATH, and a fixed host name."""
    base = {k: v for k, v in os.environ.items() if k not in CLEARED and not k.startswith("SLURM_")}
    launcher_knobs = {*ASYNC_KNOBS, *EVERY_KNOB, "LOSS", "REPLAY", "STALENESS", "KL_COEF"}
    launcher_knobs |= {"TRAIN_NODES", "SERVE_CKPT"}
    base = {k: v for k, v in base.items() if k not in launcher_knobs}
    ckpt = CKPT.get(script, CKPT[RUN_30B])
    return {
        **base,
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HOSTNAME": "testhost",
        "HF_CKPT": ckpt,
        "PROMPTS": "/shared/dapo-math-17k.parquet",
        "DRY_RUN": "1",
        **env,
    }


def _slurm(script: str, nodes: int, env: dict, tmp: Path) -> subprocess.CompletedProcess:
    hosts = "\\n".join(f"gpu{i:02d}" for i in range(1, nodes + 1))
    scontrol = tmp / "scontrol"
    scontrol.write_text(
        f'#!/usr/bin/env bash\n[[ "$1 $2" == "show hostnames" ]] || exit 2\nprintf "{hosts}\\n"\n'
    )
    scontrol.chmod(0o755)
    environment = _environment(
        script,
        SLURM_JOB_ID="4242",
        SLURM_JOB_NODELIST=f"gpu[01-{nodes:02d}]",
        SLURM_SUBMIT_DIR=str(ROOT),
        SLURM_CPUS_ON_NODE="96",
        **env,
    )
    environment["PATH"] = f"{tmp}:{environment['PATH']}"
    return subprocess.run(
        ["bash", str(EXAMPLES / script)], cwd=ROOT, env=environment, capture_output=True,
        text=True, timeout=120,
    )  # fmt: skip


def run_case(name: str) -> str:
    """The case's exit status, stdout and stderr as the fixture file holds them."""
    script, kind, number, env = CASES[name]
    if kind == "slurm":
        with tempfile.TemporaryDirectory() as tmp:
            result = _slurm(script, number, env, Path(tmp))
    else:
        variables = {**HOSTS.get(script, {}), "NODE_RANK": str(number), **env}
        environment = _environment(script, **variables)
        result = subprocess.run(
            ["bash", str(EXAMPLES / script)], cwd=ROOT, env=environment, capture_output=True,
            text=True, timeout=120,
        )  # fmt: skip
    # bash's own messages (``${VAR:?...}``) name the file and line: the line is not pinned
    stderr = re.sub(r"^(\S+): line \d+: ", r"\1: ", result.stderr, flags=re.M)
    text = f"## exit {result.returncode}\n## stdout\n{result.stdout}## stderr\n{stderr}"
    return text.replace(sys.executable, "<python>").replace(str(ROOT), "<repo>")


def fixture(name: str) -> Path:
    return FIXTURES / f"{name}.txt"


def main(argv: list[str]) -> int:
    if argv != ["--write"]:
        sys.stderr.write("usage: python tests/examples/launcher_cases.py --write\n")
        return 2
    FIXTURES.mkdir(exist_ok=True)
    for name in CASES:
        fixture(name).write_text(run_case(name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main(sys.argv[1:]))
