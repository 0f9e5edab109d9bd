"""Colocated weight sync hands each server's TP rank the buffer of the trainer rank on its own
GPU, through the real CLI under torchrun (2 gloo ranks, one loopback server playing TP 2).

On CPU a handle names a shared-memory file, so the server can open every rank's entry; on GPU
only its own GPU's would open (SGLang's ``patch_torch``: "Invalid device_uuid"). The stand-in
reads each TP rank's own entry, as SGLang's ``deserialize_own_rank`` does, and refuses a rank
whose bytes differ from rank 0's.
"""

from __future__ import annotations

import pytest
from real_sglang.servers import write_tiny_checkpoint
from torchrun_cli import torchrun_train

from megatron_rl.model.presets import load_hf_config
from megatron_rl.rollout import InProcessEngine
from megatron_rl.testing.loopback_server import LoopbackServer

pytestmark = [pytest.mark.slow, pytest.mark.distributed]
STEPS = 2
LAYOUTS = {"dp2": (), "pp2": ("--pipeline-model-parallel-size", "2")}


@pytest.fixture(scope="module")
def four_layers(tmp_path_factory):
    return write_tiny_checkpoint(tmp_path_factory.mktemp("colocated") / "hf", num_hidden_layers=4)


@pytest.mark.parametrize("layout", LAYOUTS)
def test_each_server_rank_reads_the_bucket_of_its_own_trainer_rank(four_layers, tmp_path, layout):
    """Every bucket's two entries come from the two trainer processes (their handles differ),
    hold the same bytes, and after each sync the server's log-probs are the trainer's; under
    pipeline parallelism too, where each rank first receives the other stage's tensors."""
    server = LoopbackServer(InProcessEngine.from_hf_config(load_hf_config(four_layers), seed=9))
    server.tp_size = 2
    server.start()
    try:
        rows = torchrun_train(
            four_layers,
            tmp_path / "run",
            *LAYOUTS[layout],
            "--rollout-engine", "sglang", "--sglang-url", server.url, "--colocate",
            "--weight-sync-transport", "tensor", "--sglang-engine-ranks", "2",
            steps=STEPS,
        )  # fmt: skip
    finally:
        server.stop()
    assert server.engine.weight_version == STEPS and len(rows) == STEPS
    assert server.tensor_entries and all(
        len(entries) == 2 and entries[0] != entries[1] for entries in server.tensor_entries
    )
    for row in rows:
        assert row["colocate/trainer_resident_bytes_during_rollout"] == 0.0
        assert row["mismatch/train_rollout_logprob_abs_gap"] < 1e-4
