"""A later pipeline stage waits for its turn in a weight sync at most the sync's own timeout.

Before, the stage senders' gloo group took torch's default timeout (30 minutes), so a stage whose
leader (global rank 0) had died or hung sat there for half an hour, whatever the sync's own
timeout said. Two gloo ranks: rank 1 serves as stage 1 and waits for rank 0, which never asks;
rank 1's wait ends with a `WeightSyncError` naming the timeout.
"""

from __future__ import annotations

import json
import os

import pytest
from qwen3_moe_testing import spawn_ranks

TIMEOUT_S = 3.0


def _worker(rank, world_size, init_method, tmp_dir) -> None:
    import torch.distributed as dist

    from megatron_rl.rollout.weight_sync.common import WeightSyncError
    from megatron_rl.rollout.weight_sync.stages import StageLink

    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    link = StageLink([0, 1], timeout_s=TIMEOUT_S)
    outcome = {}
    if rank == 1:
        try:
            link.recv(0)
            outcome["error"] = None
        except WeightSyncError as err:
            outcome["error"] = str(err)
        with open(os.path.join(tmp_dir, "rank1.json"), "w") as f:
            json.dump(outcome, f)
    # rank 0 sends nothing; both meet here on the default group once rank 1 has given up
    dist.barrier()


@pytest.mark.slow
@pytest.mark.distributed
def test_a_stage_waiting_for_its_turn_gives_up_at_the_syncs_timeout(tmp_path):
    spawn_ranks(_worker, tmp_path, 2)
    error = json.loads((tmp_path / "rank1.json").read_text())["error"]
    assert error is not None, "rank 1 received a message nobody sent"
    assert f"more than {TIMEOUT_S:.0f} s for rank 0" in error and "--weight-sync-min-gbps" in error
