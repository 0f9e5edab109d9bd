"""torch_dist checkpoints move between grouped experts and megatron's SequentialMLP, both ways and
across expert-parallel layouts: the parameters load exactly and the next update (Adam moments
restored) equals the uninterrupted run's."""

from __future__ import annotations

import pytest
import torch
from qwen3_moe_testing import spawn_ranks
from reshard_testing import reshard_worker

EP2 = ({"expert_parallel": 2}, 2)
WORLD1 = ({}, 1)
ATOL = 1e-6  # float noise of a resumed update (see test_dist_checkpoint.py)


def _run(tmp_path, phase: str, layout, grouped: bool) -> dict:
    kwargs, world_size = layout
    folder = tmp_path / phase
    folder.mkdir()
    spawn_ranks(reshard_worker, folder, world_size, phase, kwargs, "torch_dist", grouped)
    return torch.load(folder / f"{phase}.pt")


def _max_diff(a: dict, b: dict) -> float:
    assert a.keys() == b.keys()
    return max((a[k] - b[k]).abs().max().item() for k in a)


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
    saved = _run(tmp_path, "save", saved_layout, saved_grouped)
    resumed = _run(tmp_path, "resumed", loaded_layout, not saved_grouped)
    assert resumed["rl_state"] == {"step": 2}
    assert _max_diff(resumed["loaded"], saved["loaded"]) == 0.0  # parameters exactly
    assert _max_diff(resumed["after"], saved["after"]) < ATOL
