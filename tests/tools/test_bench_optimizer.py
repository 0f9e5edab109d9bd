"""The optimizer benchmark runs end to end at two repeats: every arm is timed and paired with
the old path, and the fused arm's distance from foreach is reported."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_bench_optimizer_pairs_every_arm_with_the_old_step():
    command = [sys.executable, "tools/bench_optimizer.py", "--repeats", "2", "--fused"]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    for arm in ("new", "fused"):
        match = re.search(rf"{arm}: .* old/{arm} ([\d.]+)x \[([\d.]+)-([\d.]+)\]", result.stdout)
        assert match, result.stdout
        median, low, high = map(float, match.groups())
        assert 0 < low <= median <= high
    difference = re.search(r"max \|diff\| / max \|param\| = (\S+)", result.stdout)
    assert difference and float(difference.group(1)) < 1e-6, result.stdout  # 0 on AVX2
