"""The routing benchmark runs end to end (quick sizes) and reports every measurement."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_routing_quick_reports_codecs_step_time_and_memory():
    result = subprocess.run(
        [sys.executable, "tools/bench_routing.py", "--quick"],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for expected in ("packed", "5.125", "R2 replay", "no replay", "own shard", "whole batch"):
        assert expected in out, expected
