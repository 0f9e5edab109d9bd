"""The weight-sync benchmark runs end to end at a small size: every transport and every limit is
timed in the same process, and the summary pairs each transport with its limit."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_weight_sync_times_every_transport_against_its_limit(tmp_path):
    out = tmp_path / "rows.json"
    command = [sys.executable, "tools/bench_weight_sync.py", "--hidden", "128", "--repeats", "2"]
    command += ["--bucket-mb", "1", "--disk-root", str(tmp_path), "--json", str(out)]
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=600)
    assert result.returncode == 0, result.stderr[-3000:]
    import json

    (row,) = json.loads(out.read_text())
    assert row["tree"] == "now" and row["mb"] > 1
    for arm in ("distributed", "gloo", "disk", "safetensors", "tensor", "memcpy"):
        assert row[f"{arm}_mb_s"] > 0
    for key in ("distributed/gloo", "disk/safetensors", "tensor/gloo"):
        median, low, high = row[key]
        assert 0 < low <= median <= high
    assert "time/limit distributed/gloo" in result.stdout
    assert not list(tmp_path.glob("tmp*"))  # the run's folder is removed
