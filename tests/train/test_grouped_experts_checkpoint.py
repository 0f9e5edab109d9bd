"""torch_dist checkpoints move between grouped experts and megatron's SequentialMLP, both ways and
across expert-parallel layouts: the parameters load exactly and the next update (Adam moments
restored) equals the uninterrupted run's."""

from __future__ import annotations

import pytest
from reshard_testing import max_diff, run_phase

EP2 = ({"expert_parallel": 2}, 2)
WORLD1 = ({}, 1)
ATOL = 1e-6  # float noise of a resumed update (see test_dist_checkpoint.py)


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    ("saved_grouped", "saved_layout", "loaded_layout"),
    [(True, EP2, WORLD1), (False, WORLD1, EP2)],
    ids=["grouped-ep2-to-sequential-world1", "sequential-world1-to-grouped-ep2"],
)
def test_checkpoint_loads_across_expert_modules_and_layouts(
    tmp_path, saved_grouped, saved_layout, loaded_layout
):
    saved = run_phase(tmp_path, "save", saved_layout, grouped=saved_grouped)
    resumed = run_phase(tmp_path, "resumed", loaded_layout, grouped=not saved_grouped)
    assert resumed["rl_state"] == {"step": 2}
    assert max_diff(resumed["loaded"], saved["loaded"]) == 0.0  # parameters exactly
    assert max_diff(resumed["after"], saved["after"]) < ATOL
