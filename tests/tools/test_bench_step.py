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
def test_bench_step_pairs_this_tree_with_each_baseline_of_this_tree(tmp_path):
    """The per-expert loop, torch's grouped matmul and megatron's unfused attention."""
    out = tmp_path / "table.md"
    command = [
        sys.executable, "tools/bench_step.py", "--setting", "main", "--repeats", "1",
        "--steps", "2", "--sequential", "--aten-grouped-mm", "--unfused-attention",
        "--out", str(out),
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-2000:] + result.stderr[-3000:]
    text = out.read_text()
    for baseline in ("sequential", "aten-grouped-mm", "unfused-attention"):
        head = f"main, baseline {baseline} (1 paired runs"
        assert head in text, text
        table = text.split(head, 1)[1].split("main, baseline", 1)[0]
        for part in PARTS:
            row = re.search(
                rf"\| {part} \| ([\d.]+) \| ([\d.]+) \| ([\d.]+) \[([\d.]+)-([\d.]+)\] \|",
                table,
            )
            assert row, (part, table)
            base, now, median, low, high = map(float, row.groups())
            assert base > 0 and now > 0 and low <= median <= high
