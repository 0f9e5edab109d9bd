"""tools/memory_plan.py -- TRAINER_COMMAND: the plan of the command a launcher runs, read by the
trainer's own parser, is the plan the tool's own flags gave for the same layout; a flag given
both ways, or a command the trainer refuses, is an error."""

from __future__ import annotations

import json
import os
import shlex
import subprocess
import sys
from pathlib import Path

import pytest
from memory_plan_testing import ROOT, load_tool

EXAMPLES = ROOT / "examples" / "qwen3_moe"


def _launcher_torchrun(script: str, **env: str) -> list[str]:
    """The torchrun line a launcher prints for node 0 (DRY_RUN=1)."""
    environment = {
        **{k: v for k, v in os.environ.items() if not k.startswith("SLURM_")},
        "PATH": f"{Path(sys.executable).parent}:{os.environ['PATH']}",
        "HF_CKPT": "/shared/checkpoint",
        "PROMPTS": "/shared/prompts.parquet",
        "NODE_RANK": "0",
        "DRY_RUN": "1",
        **env,
    }
    out = subprocess.run(
        ["bash", str(EXAMPLES / script)], cwd=ROOT, env=environment, capture_output=True,
        text=True, check=True, timeout=120,
    ).stdout  # fmt: skip
    (line,) = [line for line in out.splitlines() if line.startswith("torchrun ")]
    return shlex.split(line)


def _plan(capsys, argv: list[str]) -> dict:
    assert load_tool().main(["--json", *argv]) == 0
    return json.loads(capsys.readouterr().out)


def test_the_235b_launchers_command_plans_as_the_tools_own_flags(capsys):
    """The fullest arm (KL reference, R2 recordings of all 512 samples): TP4+SP PP4 24/24/24/22
    in 2 virtual stages each, EP8 on 4 x 8 GPUs, all of the Adam state offloaded, 18,432-token
    micro-batches, 32 of them per data-parallel rank and update."""
    torchrun = _launcher_torchrun(
        "run_qwen3_235b_a22b.sh",
        MASTER_ADDR="node0", ROLLOUT_HOSTS="node4 node5 node6 node7", LOSS="epic", REPLAY="r2",
    )  # fmt: skip
    from_command = _plan(capsys, ["--model", "qwen3-235b-a22b", "--gpu-gib", "80", "--", *torchrun])
    own = "--model qwen3-235b-a22b --tp 4 --pp 4 --ep 8 --world-size 32 --sp "
    own += "--decoder-first-pipeline-num-layers 24 --decoder-last-pipeline-num-layers 22 "
    own += "--virtual-pipeline-model-parallel-size 2 --micro-batches 32 "
    own += "--optimizer-offload-fraction 1 --micro-batch-tokens 18432 --routing-replay r2 "
    own += "--routing-responses 512 --routing-response-tokens 18432 --reference gpu --gpu-gib 80"
    own += " --sync-staging-buffers 2"  # the distributed transport's, on each stage's sender
    assert from_command == _plan(capsys, own.split())
    assert from_command["layout"]["pipeline_layers"] == [24, 24, 24, 22] and from_command["fits"]
    assert from_command["layout"]["virtual_pipeline"] == 2
    pipeline = from_command["pipeline"]
    assert pipeline["in_flight"] == [11, 9, 7, 5] and pipeline["bubble"] == 3 / 64
    # a change on the launcher's command line is a change of the plan: no offload, no fit
    at = torchrun.index("--optimizer-cpu-offload")
    no_offload = torchrun[:at] + torchrun[at + 3 :]
    assert not _plan(capsys, ["--model", "qwen3-235b-a22b", "--", *no_offload])["fits"]


@pytest.mark.parametrize(("gpu_gib", "fraction"), [("80", 0.76), ("141", 0.86)])
def test_the_colocated_launchers_command_gives_its_mem_fraction(capsys, gpu_gib, fraction):
    torchrun = _launcher_torchrun(
        "run_qwen3_30b_a3b_colocated.sh", NODE_HOSTS="node0 node1 node2 node3"
    )
    plan = _plan(capsys, ["--model", "qwen3-30b-a3b", "--gpu-gib", gpu_gib, "--", *torchrun])
    own = "--model qwen3-30b-a3b --tp 2 --ep 8 --world-size 32 --micro-batch-tokens 18432 "
    own += f"--gpu-gib {gpu_gib} --colocated --server-tp 8 --micro-batches 4"  # 64 / DP16
    assert plan == _plan(capsys, own.split())
    assert plan["colocated"]["mem_fraction_static"] == fraction


def _staging_gib(plan: dict) -> list[float]:
    """Per pipeline stage, the weight sync's staging GiB on its fullest GPU (0: no such term)."""
    return [
        sum(t["gib"] for t in stage["terms"] if t["name"] == "weight-sync staging")
        for stage in plan["stages"]
    ]


@pytest.mark.parametrize(
    ("sync_flags", "expected"),
    [
        ([], [1.0, 1.0]),  # distributed: 2 x 512 MiB on each stage's sender
        (["--weight-sync-from-rank-0"], [1.0, 0.0]),  # rank 0 sends the whole model
        (["--weight-sync-transport", "tensor"], [0.5, 0.5]),  # CUDA IPC: 1 per rank
        (["--weight-sync-transport", "disk"], [0.0, 0.0]),
    ],
    ids=["per-stage", "rank-0", "tensor", "disk"],
)
def test_the_weight_syncs_staging_buffers_are_planned_where_they_stay(capsys, sync_flags, expected):
    flags = "--pipeline-model-parallel-size 2 --expert-model-parallel-size 2 --bf16 "
    flags += "--micro-batch-size 1 --max-prompt-length 1024 --max-response-length 1024 "
    flags += "--rollout-engine sglang --sglang-url http://node2:30000"
    argv = ["--model", "qwen3-30b-a3b", "--world-size", "4", "--", *flags.split(), *sync_flags]
    assert _staging_gib(_plan(capsys, argv)) == expected
    local = "--pipeline-model-parallel-size 2 --micro-batch-size 1 --max-prompt-length 1024"
    in_process = ["--model", "qwen3-30b-a3b", "--world-size", "2", "--", *local.split()]
    assert _staging_gib(_plan(capsys, in_process)) == [0.0, 0.0]  # the in-process engine


def test_bare_trainer_flags_take_the_world_size_from_the_tool(capsys):
    flags = "--tensor-model-parallel-size 2 --sequence-parallel --expert-model-parallel-size 8 "
    flags += "--bf16 --recompute-granularity full --micro-batch-size 2 --max-prompt-length 1024 "
    flags += "--max-response-length 3072 --global-batch-size 64 --rollout-batch-size 16"
    plan = _plan(capsys, ["--model", "qwen3-30b-a3b", "--world-size", "16", "--", *flags.split()])
    assert plan["layout"]["data_parallel"] == 8
    assert plan["options"]["micro_batch_tokens"] == 2 * (1024 + 3072)
    assert plan["options"]["micro_batches"] == 64 // (8 * 2)
    assert plan["pipeline"]["bubble"] == 0.0  # no pipeline


@pytest.mark.parametrize(
    ("own", "message"),
    [
        (["--tp", "4"], "--tp: the trainer's command after -- decides this"),
        (["--world-size", "16"], "--world-size: the trainer's command after -- decides this"),
    ],
)
def test_a_value_given_both_ways_is_refused(capsys, own, message):
    torchrun = _launcher_torchrun("run_qwen3_30b_a3b.sh", MASTER_ADDR="n0", ROLLOUT_HOSTS="a b")
    assert load_tool().main(["--model", "qwen3-30b-a3b", *own, "--", *torchrun]) == 2
    assert message in capsys.readouterr().err


def test_a_command_the_trainer_refuses_is_refused(capsys):
    with pytest.raises(SystemExit) as exit_info:  # the trainer's own argparse error
        load_tool().main(["--model", "qwen3-30b-a3b", "--", "--no-such-flag"])
    assert exit_info.value.code == 2
    assert "--no-such-flag" in capsys.readouterr().err
    flags = ["--max-prompt-length", "8", "--global-batch-size", "7"]  # not a multiple of 32
    assert load_tool().main(["--model", "tiny", "--", *flags]) == 2
    assert "--global-batch-size" in capsys.readouterr().err


# the DeepSeek-V3 and GLM-4.5 launchers: (run script, preset, TRAIN_NODES, own flags, offloaded,
# the bubble (PP-1)/(V M) of the ideal time: 64 samples per update over DP ranks)
GLM_VP = "--pipeline-layers 22,24,24,22 --virtual-pipeline-model-parallel-size 2"
LARGE_LAUNCHERS = {
    "deepseek-v3-256": (
        "../deepseek_v3/run_deepseek_v3.sh", "deepseek-v3", 16,
        "--tp 8 --pp 8 --ep 16 --world-size 128 --pipeline-layers 7,8,8,8,8,8,8,6 "
        "--micro-batches 32", False, 7 / 32,
    ),
    "deepseek-v3-128": (
        "../deepseek_v3/run_deepseek_v3.sh", "deepseek-v3", 8,
        "--tp 8 --pp 8 --ep 8 --world-size 64 --pipeline-layers 7,8,8,8,8,8,8,6 "
        "--micro-batches 64", True, 7 / 64,
    ),
    "glm-4.5-128": (
        "../glm4_moe/run_glm_4_5.sh", "glm-4.5", 8,
        f"--tp 8 --pp 4 --ep 16 --world-size 64 {GLM_VP} --micro-batches 32", False, 3 / 64,
    ),
    "glm-4.5-64": (
        "../glm4_moe/run_glm_4_5.sh", "glm-4.5", 4,
        f"--tp 8 --pp 4 --ep 8 --world-size 32 {GLM_VP} --micro-batches 64", True, 3 / 128,
    ),
}  # fmt: skip


@pytest.mark.parametrize("case", list(LARGE_LAUNCHERS))
def test_the_large_family_launchers_commands_fit_h200_and_plan_as_the_tools_own_flags(capsys, case):
    """The fullest arm (KL reference on the GPU, R2 recordings of all 512 samples) of each
    DeepSeek-V3 / GLM-4.5 layout fits a 141-GiB H200; the layouts that keep the Adam state in host
    memory do not fit without it. Routing state: uint8 routes (256 / 160 experts fit a byte) of
    the MoE layers only, the EPIC paper's M = N T L_MoE K b per rank."""
    script, model, nodes, layout, offloaded, bubble = LARGE_LAUNCHERS[case]
    hosts = " ".join(f"node{nodes + i}" for i in range(nodes))
    torchrun = _launcher_torchrun(
        script, MASTER_ADDR="node0", ROLLOUT_HOSTS=hosts, TRAIN_NODES=str(nodes),
        SERVE_CKPT="/shared/fp8", LOSS="epic", REPLAY="r2",
    )  # fmt: skip
    plan = _plan(capsys, ["--model", model, "--gpu-gib", "141", "--", *torchrun])
    own = f"--model {model} {layout} --sp --micro-batch-tokens 18432 --routing-replay r2 "
    own += "--routing-responses 512 --routing-response-tokens 18432 --reference gpu "
    own += "--gpu-gib 141 --sync-staging-buffers 2"
    own += " --optimizer-offload-fraction 1" if offloaded else ""
    assert plan == _plan(capsys, own.split())
    assert plan["fits"], plan["total_gib"]
    assert plan["pipeline"]["bubble"] == bubble
    first_k_dense = 3
    moe_layers = [stage["moe_layers"] for stage in plan["stages"]]
    assert sum(moe_layers) == plan["model"]["num_layers"] - first_k_dense
    dp, tp = plan["layout"]["data_parallel"], plan["layout"]["tensor_parallel"]
    tokens = 512 * 18432 // (dp * tp)  # this rank's share of N T (SP splits it over TP)
    for stage, count in zip(plan["stages"], moe_layers, strict=True):
        (term,) = [t for t in stage["terms"] if t["name"] == "routing state"]
        assert term["bytes"] == tokens * count * 8 * 1  # K = 8 routes of b = 1 byte (uint8)
        assert "uint8" in term["note"]
    if offloaded:  # the offload is what makes it fit
        at = torchrun.index("--optimizer-cpu-offload")
        no_offload = torchrun[:at] + torchrun[at + 3 :]
        without = _plan(capsys, ["--model", model, "--gpu-gib", "141", "--", *no_offload])
        assert not without["fits"], without["total_gib"]
