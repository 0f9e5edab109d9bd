"""Every launcher's DRY_RUN output is byte-identical to the pinned one (``tests/examples/dry_run``,
cases in ``launcher_cases.py``): restructuring the launchers (common.sh, the per-model files, the
KL default from ``megatron_rl.recipes``) changes no command a node would run. An intended change
rewrites the files (``python tests/examples/launcher_cases.py --write``) and shows as their diff."""

from __future__ import annotations

import pytest
from launcher_cases import CASES, fixture, run_case

# the fast lane keeps one node of each launcher and one SLURM entry; the full suite runs them all
FAST = {
    "30b_node0",
    "235b_node0",
    "colocated_node0",
    "slurm_30b",
    "deepseek_v3_128_node0_epic_r2",
    "glm_4_5_64_node0_epic_r2",
}


@pytest.mark.parametrize(
    "name",
    [pytest.param(n, marks=[] if n in FAST else [pytest.mark.slow]) for n in sorted(CASES)],
)
def test_dry_run_output_matches_the_pinned_output(name):
    assert run_case(name) == fixture(name).read_text()


def test_every_pinned_file_is_a_case():
    """A stale file (a case renamed or removed) would pin nothing."""
    assert sorted(path.stem for path in fixture("x").parent.glob("*.txt")) == sorted(CASES)
