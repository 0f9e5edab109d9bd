"""The launchers rehearsed on this machine (`tools/rehearse_launchers.py`, `make rehearsal`).

Each launcher script runs unchanged on every node it defines: the 30B job's 2 training and 2
serving nodes, its colocated variant's 2 nodes (each trains and serves), and GLM-4.5's 4
training nodes and a serving node. Real torchrun across the training "nodes", the real SGLang
0.5.23 server on CPU behind `megatron_rl.rollout.serve` on every node that serves, R3 on. Each
run trains past a checkpoint, node 0's script gets SIGTERM, every process must end, and rerunning
the same commands must resume and finish; the servers must have loaded every weight version
and generated with the trainer's weights. A stand-in replaces one thing only: the colocated
servers' ``torch_memory_saver`` (CUDA only; `tests/real_sglang/memory_saver`).
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path

import pytest
from real_sglang.servers import require

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "rehearse_launchers", ROOT / "tools" / "rehearse_launchers.py"
)
rehearse_launchers = importlib.util.module_from_spec(spec)
sys.modules[spec.name] = rehearse_launchers  # its dataclasses look their module up there
spec.loader.exec_module(rehearse_launchers)

# one rehearsal at a time (one xdist worker): two at once put 6-8 ranks and 3-4 servers on two
# cores, where a loaded server's /server_info outlasted the trainer's 30-s control timeout
pytestmark = [
    pytest.mark.slow,
    pytest.mark.distributed,
    pytest.mark.real_sglang,
    pytest.mark.xdist_group("launcher_rehearsal"),
]
STEPS, SAVE_INTERVAL = 5, 3


@pytest.mark.parametrize("name", sorted(rehearse_launchers.LAUNCHERS))
def test_every_node_starts_trains_is_stopped_by_sigterm_and_resumes(name, tmp_path):
    require()
    launcher = rehearse_launchers.LAUNCHERS[name]
    rehearsal = rehearse_launchers.Rehearsal(
        launcher, tmp_path / name, steps=STEPS, save_interval=SAVE_INTERVAL
    )
    report = rehearsal.rehearse()  # RehearsalFailed names the step and the node's log

    assert report["first_exit_codes"][0] == 143  # node 0's trap: torchrun stopped, then exit
    serving_only = range(launcher.train_nodes, launcher.nodes)
    assert all(report["first_exit_codes"][r] == 0 for r in serving_only)  # heartbeat removed
    assert report["first_run"]["saved_iteration"] >= SAVE_INTERVAL
    assert set(report["resume_exit_codes"].values()) == {0}
    assert report["steps"] == list(range(1, STEPS + 1))
    assert report["max_logprob_gap"] <= rehearse_launchers.GAP_LIMIT
    for versions in report["server_weight_versions"].values():
        assert set(range(1, STEPS + 1)) <= set(versions)
    assert len(report["server_weight_versions"]) == len(launcher.serving_ranks())
    if launcher.colocated:
        assert all(p >= STEPS and r >= STEPS for p, r in report["server_pauses_resumes"].values())
    assert rehearsal.leftovers() == []
