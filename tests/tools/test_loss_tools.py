"""The loss-kernel report and the loss benchmark run end to end and write what they promise."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
from paper_losses import PAPER_LOSSES

ROOT = Path(__file__).resolve().parents[2]


def _run(*args: str) -> str:
    result = subprocess.run(
        [sys.executable, *args], cwd=ROOT, capture_output=True, text=True, timeout=300
    )
    assert result.returncode == 0, result.stderr
    return result.stdout


@pytest.mark.slow
def test_loss_report_writes_a_picture_per_loss_and_the_table(tmp_path):
    stdout = _run("tools/loss_report.py", "--out", str(tmp_path))
    for name in PAPER_LOSSES:
        png = tmp_path / f"{name}.png"
        assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n", name
        assert name in stdout
    assert (tmp_path / "epic_bounds.png").stat().st_size > 10_000
    table = (tmp_path / "report.txt").read_text()
    assert all(name in table for name in PAPER_LOSSES)
    # on-policy every loss weights a token by exactly 1
    assert table.count("1.000 / 1.000") >= len(PAPER_LOSSES)


@pytest.mark.slow
def test_bench_losses_times_every_registered_loss():
    stdout = _run("tools/bench_losses.py", "--batch", "4", "--seq-len", "256", "--repeats", "3")
    for name in PAPER_LOSSES:
        assert name in stdout
    assert "x grpo" in stdout
