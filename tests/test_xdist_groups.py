"""`make test` runs `pytest -n 2 --dist loadgroup`: tests marked ``xdist_group`` share one worker.

The suite relies on it to start each real SGLang server once (tests/rollout/test_real_sglang.py
and the other ``real_sglang*`` groups) and to keep tests that share files on one worker. pytest
9.2 stores node ids where pytest-xdist 3.8 cannot add its ``@group`` suffix, and the marks were
ignored without a word (the real server started on every worker); setup.py keeps pytest below
9.2, and this test fails if a release pair breaks the grouping again.
"""

from __future__ import annotations

import subprocess
import sys


def test_an_xdist_group_runs_on_one_worker(tmp_path):
    (tmp_path / "test_grouped.py").write_text(
        "import os\n\nimport pytest\n\n"
        'pytestmark = pytest.mark.xdist_group("together")\n\n\n'
        '@pytest.mark.parametrize("i", range(8))\n'
        "def test_grouped(i):\n"
        '    with open("workers.txt", "a") as f:\n'
        '        f.write(os.environ["PYTEST_XDIST_WORKER"] + "\\n")\n'
    )
    (tmp_path / "test_free.py").write_text(
        'import pytest\n\n\n@pytest.mark.parametrize("i", range(8))\ndef test_free(i):\n    pass\n'
    )
    (tmp_path / "pytest.ini").write_text("[pytest]\nmarkers =\n    xdist_group: one worker\n")
    command = [sys.executable, "-m", "pytest", "-n", "2", "--dist", "loadgroup", "-q"]
    command += ["-p", "no:cacheprovider"]
    result = subprocess.run(command, cwd=tmp_path, capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]
    workers = (tmp_path / "workers.txt").read_text().split()
    assert len(workers) == 8 and len(set(workers)) == 1, workers
