"""Reshardable checkpoints (``torch_dist``): resume at another TP/EP/DP layout, atomic commit,
verification, format detection.

Measured while writing these tests (megatron-core 0.16.1, CPU, gloo): one update of the tiny MoE
model at TP2 (sequence parallel) differs from the same update at world size 1 or EP2 in the
*expert* weight gradients (signs of a quarter of the elements) although the loss matches; EP2
and DP2 reproduce world size 1 exactly. So a TP2 checkpoint's resumed update is compared across
the resumed layouts (which must agree) and its Adam moments are checked by the EP2 -> world 1/DP2
test against the uninterrupted run, where that run is itself correct.
"""

from __future__ import annotations

import json
import os

import pytest
import torch
from reshard_testing import max_diff, run_phase
from train_state_testing import build_tiny, same_tensors, train_steps, weights

from megatron_rl.train.checkpoint.folders import latest_step
from megatron_rl.train.checkpoint.load import load_training_state
from megatron_rl.train.checkpoint.save import save_training_state

TP2 = ({"tensor_parallel": 2, "sequence_parallel": True}, 2)
EP2 = ({"expert_parallel": 2}, 2)
DP2 = ({}, 2)
WORLD1 = ({}, 1)
ATOL = 1e-6  # float noise of a resumed update; Adam moves every weight by about lr = 3e-3


@pytest.mark.slow
@pytest.mark.distributed
def test_ep2_checkpoint_resumes_at_world_1_and_dp2_like_the_uninterrupted_run(tmp_path):
    saved = run_phase(tmp_path, "save", EP2)
    for phase, layout in (("world1_control", WORLD1), ("dp2", DP2)):
        resumed = run_phase(tmp_path, phase, layout)
        assert resumed["rl_state"] == {"step": 2}
        assert max_diff(resumed["loaded"], saved["loaded"]) == 0.0  # parameters exactly
        assert max_diff(resumed["after"], saved["after"]) < ATOL, phase
    # the same update without the restored first moments is far off: the test sees them
    control = torch.load(tmp_path / "world1_control" / "world1_control.pt")
    assert max_diff(control["after_without_exp_avg"], saved["after"]) > 100 * ATOL


@pytest.mark.slow
@pytest.mark.distributed
def test_tp2_checkpoint_resumes_at_ep2_and_world_1(tmp_path):
    saved = run_phase(tmp_path, "save", TP2)
    ep2 = run_phase(tmp_path, "ep2_control", EP2)
    world1 = run_phase(tmp_path, "world1", WORLD1)
    for resumed in (ep2, world1):
        assert resumed["rl_state"] == {"step": 2}
        assert max_diff(resumed["loaded"], saved["loaded"]) == 0.0
    # TP2's own update differs from EP2/world 1 (see the module docstring); these two agree
    assert max_diff(ep2["after"], world1["after"]) < ATOL
    assert max_diff(ep2["after_without_exp_avg"], ep2["after"]) > 100 * ATOL


@pytest.mark.slow
def test_torch_dist_round_trip_and_format_detection(ws1, tmp_path):
    config, model, optimizer = build_tiny(seed=0)
    train_steps(model, optimizer, config.vocab_size, 1)
    save_dir = str(tmp_path / "ckpt")
    save_training_state(save_dir, 1, model=model, optimizer=optimizer, rl_state={"step": 1})
    folder = save_training_state(
        save_dir, 2, model=model, optimizer=optimizer, rl_state={"step": 2}, fmt="torch_dist"
    )
    saved = weights(model)
    with open(os.path.join(folder, "checkpoint.json")) as handle:
        meta = json.load(handle)
    assert meta["format"] == "torch_dist"
    assert set(meta["files"]) == set(os.listdir(folder)) - {"checkpoint.json"}
    assert any(name.endswith(".distcp") for name in meta["files"])
    train_steps(model, optimizer, config.vocab_size, 1)
    expected = weights(model)

    _, model2, optimizer2 = build_tiny(seed=5)
    assert load_training_state(save_dir, model=model2, optimizer=optimizer2) == {"step": 2}
    assert same_tensors(weights(model2), saved)
    train_steps(model2, optimizer2, config.vocab_size, 1)  # RNG restored: the same batch
    assert same_tensors(weights(model2), expected)
    # the older step, in the per-rank format, still loads
    assert load_training_state(save_dir, model=model2, optimizer=optimizer2, step=1) == {"step": 1}


@pytest.mark.slow
def test_torch_dist_save_killed_before_commit_leaves_no_loadable_step(ws1, tmp_path, monkeypatch):
    from megatron_rl.train.checkpoint import save

    _, model, optimizer = build_tiny(seed=0)
    save_dir = tmp_path / "ckpt"
    save_training_state(str(save_dir), 1, model=model, optimizer=optimizer, rl_state={"step": 1})

    def killed(*args, **kwargs):  # every data file is written, nothing is committed yet
        raise OSError("killed (simulated)")

    monkeypatch.setattr(save, "hash_share", killed)
    with pytest.raises(OSError, match="simulated"):
        save_training_state(
            str(save_dir), 2, model=model, optimizer=optimizer, rl_state={}, fmt="torch_dist"
        )
    monkeypatch.undo()
    staging = save_dir / ".tmp_step_00000002"
    assert any(name.endswith(".distcp") for name in os.listdir(staging))
    assert latest_step(str(save_dir)) == 1
    assert not (save_dir / "step_00000002").exists()
    with pytest.raises(ValueError, match="step=2: no complete checkpoint"):
        load_training_state(str(save_dir), model=model, optimizer=optimizer, step=2)
    save_training_state(
        str(save_dir), 2, model=model, optimizer=optimizer, rl_state={}, fmt="torch_dist"
    )
    assert sorted(os.listdir(save_dir)) == ["latest", "step_00000001", "step_00000002"]


def test_torch_dist_flipped_byte_is_a_named_error(ws1, tmp_path):
    _, model, optimizer = build_tiny(seed=0)
    save_dir = tmp_path / "ckpt"
    folder = save_training_state(
        str(save_dir), 3, model=model, optimizer=optimizer, rl_state={}, fmt="torch_dist"
    )
    name = next(n for n in sorted(os.listdir(folder)) if n.endswith(".distcp"))
    path = tmp_path / "ckpt" / "step_00000003" / name
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))
    with pytest.raises(ValueError, match=rf"{name} is corrupted"):
        load_training_state(str(save_dir), model=model, optimizer=optimizer)


def test_torch_dist_round_trip_with_the_non_distributed_optimizer(ws1, tmp_path):
    """The trainer's default: megatron's plain (not distributed) optimizer."""
    from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
    from megatron_rl.model import build_model, preset_config

    def build(seed: int):
        torch.manual_seed(seed)
        model = wrap_for_training(build_model(config), use_distributed_optimizer=False)
        optimizer = build_optimizer(
            model, OptimizerConfig(lr=3e-3, use_distributed_optimizer=False)
        )
        return model, optimizer

    config = preset_config("tiny")
    model, optimizer = build(0)
    train_steps(model, optimizer, config.vocab_size, 2)
    save_dir = str(tmp_path / "ckpt")
    save_training_state(
        save_dir, 2, model=model, optimizer=optimizer, rl_state={"step": 2}, fmt="torch_dist"
    )
    saved = weights(model)
    train_steps(model, optimizer, config.vocab_size, 1)
    expected = weights(model)

    model2, optimizer2 = build(5)
    assert load_training_state(save_dir, model=model2, optimizer=optimizer2) == {"step": 2}
    assert same_tensors(weights(model2), saved)
    train_steps(model2, optimizer2, config.vocab_size, 1)
    resumed = weights(model2)
    assert max((resumed[k] - expected[k]).abs().max().item() for k in expected) < 1e-6


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer",
    [{}, {"use_distributed_optimizer": True, "bf16": True}],
    ids=["adam_fp32", "distributed_adam_bf16"],
)
def test_trainer_resumes_a_torch_dist_checkpoint_like_an_uninterrupted_run(tmp_path, optimizer):
    """``--ckpt-format torch_dist`` through `run`: the resumed run saves per-rank files again."""

    from trainer_testing import rendezvous, small_config

    from megatron_rl.train.run import run

    straight = small_config(
        tmp_path / "a", train_iters=4, save=str(tmp_path / "a" / "ckpt"), **optimizer
    )
    run(straight, **rendezvous(tmp_path, "rdzv_a"))
    first = small_config(
        tmp_path / "b",
        train_iters=2,
        save=str(tmp_path / "b" / "ckpt"),
        ckpt_format="torch_dist",
        **optimizer,
    )
    run(first, **rendezvous(tmp_path, "rdzv_b1"))
    resumed = first.with_flags(train_iters=4, load=first.checkpoint.save, ckpt_format="torch")
    run(resumed, **rendezvous(tmp_path, "rdzv_b2"))
    a = torch.load(tmp_path / "a" / "ckpt" / "step_00000004" / "model_rank00000.pt")["model"]
    b = torch.load(tmp_path / "b" / "ckpt" / "step_00000004" / "model_rank00000.pt")["model"]
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key


def test_torch_dist_without_psutil_fails_clearly_instead_of_hanging(monkeypatch):
    """megatron's writer would die silently in each worker and the save would wait forever."""
    import sys

    from megatron_rl.train.checkpoint.torch_dist import _megatron_dist_checkpointing

    monkeypatch.setitem(sys.modules, "psutil", None)
    with pytest.raises(RuntimeError, match="needs psutil"):
        _megatron_dist_checkpointing()


def _one_rank_fails_collecting_worker(rank, world_size, init_method, tmp_dir) -> None:
    """EP2: rank 1 fails once megatron has built its sharded state (megatron's collectives
    inside that build done on both ranks), before the write; every rank must get an error."""
    from unittest import mock

    from train_state_testing import build_tiny

    from megatron_rl.backend import ParallelConfig, init_distributed
    from megatron_rl.train.checkpoint import torch_dist
    from megatron_rl.train.checkpoint.save import save_training_state

    init_distributed(
        ParallelConfig(seed=3, expert_parallel=2),
        rank=rank,
        world_size=world_size,
        init_method=init_method,
        device="cpu",
    )
    _, model, optimizer = build_tiny(seed=11)
    real = torch_dist._non_tensor_state

    def failing(*args, **kwargs):
        if rank == 1:
            raise AssertionError("rank 1: no optimizer state")
        return real(*args, **kwargs)

    save_dir = os.path.join(tmp_dir, "ckpt")
    with mock.patch.object(torch_dist, "_non_tensor_state", failing):
        try:
            save_training_state(
                save_dir, 1, model=model, optimizer=optimizer, rl_state={}, fmt="torch_dist"
            )
        except (AssertionError, RuntimeError) as error:
            message = f"{type(error).__name__}: {error}"
        else:
            message = "saved"
    with open(os.path.join(tmp_dir, f"rank{rank}.txt"), "w") as out:
        out.write(message)


@pytest.mark.slow
@pytest.mark.distributed
def test_a_rank_failing_to_collect_its_sharded_state_stops_every_rank_instead_of_a_hang(
    tmp_path,
):
    """Before the fix the other rank waited forever in megatron's save (its first global
    collective): found by rehearsing the GLM-4.5 launcher at PP2 with a dense first stage."""
    from qwen3_moe_testing import spawn_ranks

    spawn_ranks(_one_rank_fails_collecting_worker, tmp_path, 2)
    assert (tmp_path / "rank1.txt").read_text() == "AssertionError: rank 1: no optimizer state"
    assert (
        (tmp_path / "rank0.txt")
        .read_text()
        .startswith("RuntimeError: another rank failed while collecting step 1's sharded state")
    )
    assert latest_step(str(tmp_path / "ckpt")) is None  # nothing committed
