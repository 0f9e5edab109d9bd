"""The routing benchmark runs end to end (quick sizes) and reports every measurement; its R3
memory measurement (read back from ``--memory-json``) tells a rank holding its own shard from one
holding the whole batch."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
@pytest.mark.distributed
def test_bench_routing_quick_reports_codecs_step_time_and_memory_arms_told_apart(tmp_path):
    memory_json = tmp_path / "memory.json"
    result = subprocess.run(
        [sys.executable, "tools/bench_routing.py", "--quick", "--memory-json", str(memory_json)],
        cwd=ROOT,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert result.returncode == 0, result.stderr[-3000:]
    out = result.stdout
    for expected in (
        "packed",
        "5.125",
        "R2 replay",
        "no replay",
        "paired ratio",
        "own shard",
        "whole batch",
        "in use",
        "claim",
    ):
        assert expected in out, expected
    assert "claim (rank holds its own shard, never the whole batch): PASS" in out
    _check_memory_arms(json.loads(memory_json.read_text()))


def _check_memory_arms(rows: list[dict]) -> None:
    """Bytes in use: own shard (+ one decoded micro-batch) < 0.75 x whole batch, on each rank
    (the quick sizes: 64 samples per rank x 128 tokens)."""
    results = {(row["arm"], row["rank"]): row for row in rows}
    samples, length = 64, 128
    for rank in range(2):
        none = results[("no replay", rank)]
        own = results[("R3 own shard", rank)]
        whole = results[("R3 whole batch", rank)]
        # computed: each rank's blobs are half the batch, the whole-batch arm holds both halves
        assert own["held"] == own["own"] == samples * (length - 1) * 8 * 8
        assert whole["held"] == own["own"] + results[("R3 own shard", 1 - rank)]["own"]
        assert none["held"] == 0 and own["decoded"] > 0
        # measured: the arms in order, the own-shard arm within its bound
        assert none["peak_delta"] < own["own"] / 4
        assert own["own"] <= own["peak_delta"] <= 1.2 * (own["own"] + own["decoded"])
        assert own["peak_delta"] < 0.75 * whole["peak_delta"]
        assert whole["state_delta"] >= whole["held"]
