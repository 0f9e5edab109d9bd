"""tools/bench_engine.py at tiny sizes: the arms run, draw the same tokens, and report ratios."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.slow
def test_the_rows_comparison_draws_the_same_tokens_in_both_arms(tmp_path):
    out = tmp_path / "bench.json"
    argv = [
        "--compare", "rows", "--preset", "tiny", "--task", "successor", "--dtype", "float32",
        "--prompts", "4", "--n", "4", "--new-tokens", "6", "--repeats", "2", "--json", str(out),
    ]  # fmt: skip
    result = subprocess.run(
        [sys.executable, str(ROOT / "tools" / "bench_engine.py"), *argv],
        cwd=ROOT, capture_output=True, text=True, timeout=600,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert result.returncode == 0, result.stderr[-3000:]
    rows = json.loads(out.read_text())["results"]["float32/rows"]
    assert set(rows) == {"keep", "drop"}
    assert rows["drop"]["same_tokens"] is True and rows["drop"]["max_logprob_gap"] < 1e-5
    assert rows["drop"]["cpu"]["ratio_median"] > 0 and rows["keep"]["cpu"]["us_per_token"] > 0
    assert "ratio" in result.stdout
