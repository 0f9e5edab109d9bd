"""Training checkpoints: exact round trips, resume equivalence, crash safety, pruning, layout."""

from __future__ import annotations

import json
import os
import random

import numpy as np
import pytest
import torch
from qwen3_moe_testing import spawn_ranks
from train_state_testing import (
    adam_state,
    build_tiny,
    expert_parallel_worker,
    linear_with_adam_state,
    same_tensors,
    train_steps,
    weights,
)

from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
from megatron_rl.train.checkpoint.folders import CheckpointDamaged, latest_step
from megatron_rl.train.checkpoint.load import load_training_state
from megatron_rl.train.checkpoint.save import save_training_state


@pytest.fixture
def ws1_seed() -> int:
    return 7


def _save_linear(save_dir, step, seed, **kwargs) -> str:
    model, optimizer = linear_with_adam_state(seed)
    return save_training_state(
        str(save_dir), step, model=model, optimizer=optimizer, rl_state={"step": step}, **kwargs
    )


def test_round_trip_restores_weights_adam_state_rng_and_rl_state(ws1, tmp_path):
    config, model, optimizer = build_tiny(seed=0)
    train_steps(model, optimizer, config.vocab_size, 1)
    rl_state = {"step": 1, "sampler": {"epoch": 0, "position": 8}, "weight_version": 1}
    save_dir = str(tmp_path / "ckpt")
    save_training_state(save_dir, 1, model=model, optimizer=optimizer, rl_state=rl_state)
    saved_weights, saved_adam = weights(model), adam_state(optimizer)
    draws = (torch.rand(3), random.random(), np.random.rand(), torch.randn(2))

    train_steps(model, optimizer, config.vocab_size, 1)  # moves weights, Adam state and RNGs
    assert not same_tensors(weights(model), saved_weights)
    restored = load_training_state(save_dir, model=model, optimizer=optimizer)

    assert restored == rl_state
    assert same_tensors(weights(model), saved_weights)
    restored_adam = adam_state(optimizer)
    assert {"exp_avg", "exp_avg_sq", "step"} <= restored_adam[0].keys()
    assert all(same_tensors(a, b) for a, b in zip(saved_adam, restored_adam, strict=True))
    assert torch.equal(torch.rand(3), draws[0])
    assert random.random() == draws[1]
    assert np.random.rand() == draws[2]
    assert torch.equal(torch.randn(2), draws[3])


def test_resumed_training_matches_uninterrupted_training(ws1, tmp_path):
    k, save_dir = 2, str(tmp_path / "ckpt")
    config, model, optimizer = build_tiny(seed=0)
    train_steps(model, optimizer, config.vocab_size, k)
    save_training_state(save_dir, k, model=model, optimizer=optimizer, rl_state={"step": k})
    train_steps(model, optimizer, config.vocab_size, k)
    uninterrupted = weights(model)

    torch.manual_seed(12345)  # a "fresh process": other init, other RNG position
    _, model2, optimizer2 = build_tiny(seed=99)
    assert load_training_state(save_dir, model=model2, optimizer=optimizer2) == {"step": k}
    train_steps(model2, optimizer2, config.vocab_size, k)

    resumed = weights(model2)
    assert same_tensors(resumed, uninterrupted), max(
        (resumed[n] - uninterrupted[n]).abs().max().item() for n in resumed
    )


def test_mismatched_tensor_raises_naming_it_before_modifying_the_model(ws1, tmp_path):
    from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
    from megatron_rl.model import build_model, preset_config

    _, model, optimizer = build_tiny(seed=0)
    save_dir = str(tmp_path / "ckpt")
    save_training_state(save_dir, 3, model=model, optimizer=optimizer, rl_state={})
    other = wrap_for_training(build_model(preset_config("tiny", moe_intermediate_size=48)))
    other_optimizer = build_optimizer(other, OptimizerConfig(lr=1e-3))
    before = weights(other)
    with pytest.raises(ValueError, match=r"experts\.weight1.*checkpoint has \(\(8, 64, 64\)"):
        load_training_state(save_dir, model=other, optimizer=other_optimizer)
    assert same_tensors(weights(other), before)


def test_other_world_size_raises_naming_it(ws1, tmp_path):
    _, model, optimizer = build_tiny(seed=0)
    folder = save_training_state(
        str(tmp_path / "ckpt"), 5, model=model, optimizer=optimizer, rl_state={}
    )
    meta_path = os.path.join(folder, "checkpoint.json")
    with open(meta_path) as handle:
        meta = json.load(handle)
    meta["layout"].update(world_size=4, expert_parallel=2)
    with open(meta_path, "w") as handle:
        json.dump(meta, handle)
    with pytest.raises(ValueError, match=r"world_size: saved 4, now 1.*expert_parallel: saved 2"):
        load_training_state(str(tmp_path / "ckpt"), model=model, optimizer=optimizer)


def test_missing_or_empty_dir_returns_none(tmp_path):
    model, optimizer = linear_with_adam_state(0)
    assert load_training_state(str(tmp_path / "nope"), model=model, optimizer=optimizer) is None
    assert load_training_state(str(tmp_path), model=model, optimizer=optimizer) is None
    assert latest_step(str(tmp_path)) is None


def test_crash_while_writing_optimizer_keeps_previous_checkpoint(tmp_path, monkeypatch):
    save_dir = tmp_path / "ckpt"
    _save_linear(save_dir, 1, seed=1)
    real_save = torch.save

    def crashing_save(obj, path, *args, **kwargs):
        if "optim_rank" in os.fspath(path):
            raise OSError("disk full (simulated)")
        return real_save(obj, path, *args, **kwargs)

    monkeypatch.setattr(torch, "save", crashing_save)
    with pytest.raises(OSError, match="simulated"):
        _save_linear(save_dir, 2, seed=2)
    monkeypatch.setattr(torch, "save", real_save)

    assert (save_dir / "latest").read_text().strip() == "1"
    assert latest_step(str(save_dir)) == 1
    assert not (save_dir / "step_00000002").exists()
    assert (save_dir / ".tmp_step_00000002").is_dir()  # the half-written shard stays until...
    expected, _ = linear_with_adam_state(1)
    model, optimizer = linear_with_adam_state(3)
    assert load_training_state(str(save_dir), model=model, optimizer=optimizer) == {"step": 1}
    assert torch.equal(model.weight, expected.weight)
    _save_linear(save_dir, 2, seed=2)  # ...the next save cleans it
    assert sorted(os.listdir(save_dir)) == ["latest", "step_00000001", "step_00000002"]


def test_crash_before_latest_is_rewritten_resumes_from_previous_step(tmp_path, monkeypatch):
    from megatron_rl.train.checkpoint import commit

    save_dir = tmp_path / "ckpt"
    _save_linear(save_dir, 1, seed=1)

    def crash(path, text):
        raise OSError("killed (simulated)")

    monkeypatch.setattr(commit, "atomic_write_text", crash)
    with pytest.raises(OSError, match="simulated"):
        _save_linear(save_dir, 2, seed=2)
    assert (save_dir / "latest").read_text().strip() == "1"
    assert latest_step(str(save_dir)) == 1


def test_an_unreadable_latest_takes_the_newest_step_folder_damaged_or_not(tmp_path):
    save_dir = tmp_path / "ckpt"
    _save_linear(save_dir, 1, seed=1)
    _save_linear(save_dir, 2, seed=2)
    (save_dir / "latest").write_text("")  # e.g. a file system that lost the write
    assert latest_step(str(save_dir)) == 2
    (save_dir / "step_00000009").mkdir()  # newer and damaged (no checkpoint.json): not skipped
    model, optimizer = linear_with_adam_state(0)
    with pytest.raises(CheckpointDamaged, match=r"step_00000009: checkpoint\.json is missing"):
        load_training_state(str(save_dir), model=model, optimizer=optimizer)


def test_keep_last_prunes_oldest_checkpoints_after_commit(tmp_path):
    save_dir = tmp_path / "ckpt"
    for step in (10, 20, 30, 40):
        _save_linear(save_dir, step, seed=step, keep_last=2)
    assert sorted(os.listdir(save_dir)) == ["latest", "step_00000030", "step_00000040"]
    assert latest_step(str(save_dir)) == 40
    _save_linear(save_dir, 40, seed=41, keep_last=1)  # a committed step is never rewritten
    assert sorted(os.listdir(save_dir)) == ["latest", "step_00000040"]
    model, optimizer = linear_with_adam_state(0)
    load_training_state(str(save_dir), model=model, optimizer=optimizer)
    assert torch.equal(model.weight, linear_with_adam_state(40)[0].weight)


def _flip_a_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[len(data) // 2] ^= 0x40
    path.write_bytes(bytes(data))


def test_a_flipped_byte_is_a_named_error_or_falls_back_to_the_previous_step(tmp_path):
    save_dir = tmp_path / "ckpt"
    _save_linear(save_dir, 1, seed=1)
    _save_linear(save_dir, 2, seed=2)
    _flip_a_byte(save_dir / "step_00000002" / "model_rank00000.pt")
    model, optimizer = linear_with_adam_state(0)
    with pytest.raises(
        CheckpointDamaged,
        match=r"step_00000002: model_rank00000\.pt is corrupted.*step_00000001: complete.*"
        r"--load-fallback.*--load-ignore-existing",
    ):
        load_training_state(str(save_dir), model=model, optimizer=optimizer)
    assert load_training_state(str(save_dir), model=model, optimizer=optimizer, fallback=True) == {
        "step": 1
    }
    assert torch.equal(model.weight, linear_with_adam_state(1)[0].weight)


def test_a_missing_shard_is_a_named_error_not_a_quiet_load_of_the_previous_step(tmp_path):
    save_dir = tmp_path / "ckpt"
    _save_linear(save_dir, 1, seed=1)
    _save_linear(save_dir, 2, seed=2)
    (save_dir / "step_00000002" / "optim_rank00000.pt").unlink()
    model, optimizer = linear_with_adam_state(0)
    with pytest.raises(CheckpointDamaged, match=r"step_00000002: optim_rank00000\.pt is missing"):
        load_training_state(str(save_dir), model=model, optimizer=optimizer)
    state = load_training_state(str(save_dir), model=model, optimizer=optimizer, fallback=True)
    assert state == {"step": 1}


def test_pruning_removes_incomplete_step_folders_left_by_a_kill(tmp_path):
    save_dir = tmp_path / "ckpt"
    _save_linear(save_dir, 1, seed=1)
    (save_dir / "step_00000000").mkdir()  # e.g. a pruning killed after checkpoint.json went
    (save_dir / "step_00000000" / "model_rank00000.pt").write_bytes(b"half")
    _save_linear(save_dir, 2, seed=2, keep_last=2)
    assert sorted(os.listdir(save_dir)) == ["latest", "step_00000001", "step_00000002"]


def test_bad_arguments_raise_before_writing(tmp_path):
    model, optimizer = linear_with_adam_state(0)
    with pytest.raises(ValueError, match="rl_state is not JSON-serialisable"):
        save_training_state(
            str(tmp_path), 1, model=model, optimizer=optimizer, rl_state={"t": torch.ones(1)}
        )
    with pytest.raises(ValueError, match="keep_last=0"):
        save_training_state(
            str(tmp_path), 1, model=model, optimizer=optimizer, rl_state={}, keep_last=0
        )
    with pytest.raises(ValueError, match="step=3: no complete checkpoint"):
        load_training_state(str(tmp_path), model=model, optimizer=optimizer, step=3)
    assert os.listdir(tmp_path) == []


@pytest.mark.slow
@pytest.mark.distributed
def test_two_rank_expert_parallel_shards_round_trip(tmp_path):
    spawn_ranks(expert_parallel_worker, tmp_path, 2)
    results = [torch.load(tmp_path / f"result{rank}.pt") for rank in range(2)]
    for result in results:
        assert result["rl_state"] == {"step": 1, "rank": 0}  # rank 0's rl_state is the one kept
        assert result["weights_equal"] and result["adam_equal"] and result["rng_equal"]
    assert not torch.equal(results[0]["expert_weight"], results[1]["expert_weight"])
    names = sorted(os.listdir(tmp_path / "ckpt" / "step_00000001"))
    assert names == sorted(
        ["checkpoint.json", "rl_state.json"]
        + [f"{kind}_rank{r:05d}.pt" for kind in ("model", "optim", "rng") for r in range(2)]
    )
    # This single process (world size 1, EP=1) cannot take the EP=2 shards.
    init_distributed(ParallelConfig(), init_method=f"file://{tmp_path}/rdzv1", device="cpu")
    try:
        _, model, optimizer = build_tiny(seed=0)
        with pytest.raises(ValueError, match="world_size: saved 2, now 1"):
            load_training_state(str(tmp_path / "ckpt"), model=model, optimizer=optimizer)
    finally:
        destroy_distributed()


def test_load_accepts_a_step_folder_as_that_step_of_its_root(tmp_path):
    from megatron_rl.train.config import TrainConfig
    from megatron_rl.train.run import resolve_load

    save_dir = tmp_path / "ckpt"
    _save_linear(save_dir, 1, seed=1)
    _save_linear(save_dir, 2, seed=2)
    step_folder = str(save_dir / "step_00000001")
    assert resolve_load(TrainConfig.from_flags(load=step_folder)) == (str(save_dir), 1)
    assert resolve_load(TrainConfig.from_flags(load=str(save_dir))) == (str(save_dir), None)
