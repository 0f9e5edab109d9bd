"""The step benchmark runs the real CLI in pairs and reports every part of the step, with its
paired ratio and spread, in a markdown table."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
PARTS = ("time/step", "time/rollout", "time/old_logprob", "time/update", "time/sync", "start-up")


@pytest.mark.slow
def test_bench_step_pairs_this_tree_with_the_sequential_experts(tmp_path):
    out = tmp_path / "table.md"
    command = [
        sys.executable, "tools/bench_step.py", "--setting", "main", "--repeats", "1",
        "--steps", "2", "--sequential", "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    table = out.read_text()
    assert "main, baseline sequential (1 paired runs" in table
    for part in PARTS:
        row = re.search(
            rf"\| {part} \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \[([\d.]+)-([\d.]+)\] \|", table
        )
        assert row, (part, table)
        base, now, median, low, high = map(float, row.groups())
        assert base > 0 and now > 0 and low <= median <= high
