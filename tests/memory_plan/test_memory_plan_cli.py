"""tools/memory_plan.py: the table, the error exit, the pipeline and offload flags, the JSON."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest
from memory_plan_testing import ROOT, load_tool

from megatron_rl.memory_plan import GIB, PHASE_GRAD_CHECK


def test_cli_table_and_error_exit(capsys):
    tool = load_tool()
    argv = ["--model", "qwen3-30b-a3b", "--tp", "2", "--ep", "8", "--world-size", "16"]
    assert tool.main([*argv, "--micro-batch-tokens", "18432", "--gpu-gib", "80"]) == 0
    out = capsys.readouterr().out
    for expected in ("gradient buffers", "optimizer: experts", "FITS in 80 GiB", "estimate"):
        assert expected in out, expected
    assert tool.main([*argv[:4], "--ep", "3", "--world-size", "6"]) == 2
    assert "num_experts=128 is not divisible by expert parallel size 3" in capsys.readouterr().err


def test_cli_pipeline_flags_and_offload(capsys):
    tool = load_tool()
    argv = ["--model", "qwen3-235b-a22b", "--tp", "4", "--pp", "4", "--ep", "8"]
    argv += ["--world-size", "32", "--micro-batch-tokens", "18432", "--json"]
    uneven = ["--decoder-first-pipeline-num-layers", "23", "--decoder-last-pipeline-num-layers"]
    chunked = ["--optimizer-offload-fraction", "1", "--grad-check-chunk-elements", str(2**26)]
    assert tool.main([*argv, *uneven, "23", *chunked]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert plan["layout"]["pipeline_layers"] == [23, 24, 24, 23] and plan["fits"]
    whole = [*chunked[:3], "0"]  # the whole-buffer check (the trainer before it chunked)
    assert tool.main([*argv, *uneven, "23", *whole]) == 0
    plan = json.loads(capsys.readouterr().out)
    assert not plan["fits"] and plan["peak_phase"] == PHASE_GRAD_CHECK
    assert tool.main([*argv, "--pipeline-layers", "23,24,24,23", *chunked[2:]]) == 0
    assert not json.loads(capsys.readouterr().out)["fits"]  # no offload
    assert tool.main([*argv, *uneven, "22"]) == 2
    assert "do not split evenly" in capsys.readouterr().err
    assert tool.main([*argv, *uneven, "23", "--pipeline-layers", "23,24,24,23"]) == 2
    assert "not both" in capsys.readouterr().err
    assert tool.main([*argv[:-1], *uneven, "23", "--optimizer-offload-fraction", "1"]) == 0
    assert "host memory per GPU of this stage" in capsys.readouterr().out


@pytest.mark.slow
def test_cli_json_smoke():
    result = subprocess.run(
        [
            sys.executable,
            "tools/memory_plan.py",
            "--model",
            "tiny",
            "--world-size",
            "2",
            "--ep",
            "2",
            "--dtype",
            "fp32",
            "--routing-replay",
            "r2",
            "--routing-tokens",
            "100",
            "--reference",
            "cpu",
            "--gpu-gib",
            "1",
            "--json",
        ],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    plan = json.loads(result.stdout)
    assert plan["model"]["total_params"] == 189_824  # the tiny model's parameter count
    assert plan["layout"]["expert_data_parallel"] == 1
    stage = plan["stages"][0]
    terms = {term["name"]: term for term in stage["terms"]}
    assert terms["parameters: experts"]["bytes"] == 2 * 4 * 6144 * 4  # 2 layers x 4 experts
    assert not terms["reference model"]["on_gpu"]
    assert plan["total_bytes"] == sum(t["bytes"] for t in stage["terms"] if t["on_gpu"])
    assert plan["fits"] is (plan["total_bytes"] <= GIB)
