"""``--async-save``: ``torch_dist`` checkpoints written in the background, committed only once
every rank's writer has finished (`megatron_rl.train.checkpoint.save.start_async_save`).

megatron's writer runs in a process forked from the rank; the tests slow it down or hold it at a
gate (a file) by wrapping ``FileSystemWriterAsync.write_preloaded_data_multiproc`` before the
fork, so the pending state is observable.
"""

from __future__ import annotations

import json
import os
import time

import pytest
import torch
from qwen3_moe_testing import spawn_ranks

from megatron_rl.train.checkpoint.folders import latest_step
from megatron_rl.train.checkpoint.save import pending_save

STEP2 = "step_00000002"


def _hold_writer(monkeypatch, gate: str | None = None, delay: float = 0.0) -> None:
    """megatron's writer waits ``delay`` seconds, and until ``gate`` exists when given."""
    from megatron.core.dist_checkpointing.strategies.filesystem_async import (
        FileSystemWriterAsync,
    )

    write = FileSystemWriterAsync.write_preloaded_data_multiproc

    def held(*args, **kwargs):
        time.sleep(delay)
        deadline = time.monotonic() + 120
        while gate is not None and not os.path.exists(gate):
            if time.monotonic() > deadline:
                raise TimeoutError(f"{gate} never appeared")
            time.sleep(0.02)
        return write(*args, **kwargs)

    monkeypatch.setattr(FileSystemWriterAsync, "write_preloaded_data_multiproc", staticmethod(held))


def _dcp_tensors(step_dir) -> dict:
    """Every entry of a ``torch_dist`` step folder's ``*.distcp`` files, read without a model."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    out = os.path.join(os.path.dirname(step_dir), f"{os.path.basename(step_dir)}.pt")
    dcp_to_torch_save(str(step_dir), out)
    return torch.load(out, weights_only=False)


def _same(a, b) -> bool:
    if torch.is_tensor(a):
        return torch.is_tensor(b) and a.dtype == b.dtype and torch.equal(a, b)
    if isinstance(a, dict):
        return isinstance(b, dict) and a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    if hasattr(a, "getvalue"):  # BytesIO entries (megatron's _extra_state)
        return a.getvalue() == b.getvalue()
    return a == b


def _assert_same_step(a_dir, b_dir) -> None:
    """Same model/optimizer tensors, common state, RNG files and RL state (but its config)."""
    assert _same(_dcp_tensors(a_dir), _dcp_tensors(b_dir))
    common_a, common_b = (torch.load(d / "common.pt", weights_only=False) for d in (a_dir, b_dir))
    assert _same(common_a, common_b)
    for name in sorted(os.listdir(a_dir)):
        if name.startswith("rng_rank"):
            assert _same(torch.load(a_dir / name), torch.load(b_dir / name)), name
    rl_a, rl_b = (json.loads((d / "rl_state.json").read_text()) for d in (a_dir, b_dir))
    rl_a.pop("config", None)
    rl_b.pop("config", None)
    assert rl_a == rl_b


def async_worker(rank, world_size, init_method, tmp_dir) -> None:
    """Save step 2 synchronously into ``sync/`` and in the background into ``async/`` (whose
    step 1 is committed), update once more while the write is held, then commit it."""
    from megatron.core import parallel_state
    from reshard_testing import train_on
    from train_state_testing import build_tiny

    from megatron_rl.backend import ParallelConfig, init_distributed
    from megatron_rl.collectives import barrier
    from megatron_rl.train.checkpoint.save import save_training_state, start_async_save

    init_distributed(
        ParallelConfig(seed=3), rank=rank, world_size=world_size, init_method=init_method
    )
    assert parallel_state.get_data_parallel_world_size() == world_size
    hf_config, model, optimizer = build_tiny(seed=11, clip_grad=0.0)
    vocab = hf_config.vocab_size
    sync_dir, async_dir = (os.path.join(tmp_dir, name) for name in ("sync", "async"))
    state = {"model": model, "optimizer": optimizer}
    train_on(model, optimizer, vocab, 0)
    save_training_state(async_dir, 1, rl_state={"step": 1}, fmt="torch_dist", **state)
    train_on(model, optimizer, vocab, 1)
    save_training_state(sync_dir, 2, rl_state={"step": 2}, fmt="torch_dist", **state)

    gate = os.path.join(tmp_dir, "gate")
    with pytest.MonkeyPatch.context() as monkeypatch:
        _hold_writer(monkeypatch, gate=gate)
        pending = start_async_save(async_dir, 2, rl_state={"step": 2}, **state)
    train_on(model, optimizer, vocab, 2)  # in place, while step 2 is being written
    seen = {
        "latest": latest_step(async_dir),
        "listing": sorted(os.listdir(async_dir)),
        "try_finalize": pending.try_finalize(),
        "pending": pending_save() is pending,
    }
    barrier()
    if rank == 0:
        open(gate, "w").close()
    seen["finalized"] = pending.finalize()
    seen["latest_after"] = latest_step(async_dir)
    seen["pending_after"] = pending_save()
    if rank == 0:
        torch.save(seen, os.path.join(tmp_dir, "seen.pt"))


@pytest.mark.slow
@pytest.mark.distributed
def test_pending_write_keeps_latest_and_commits_the_saved_state_on_two_ranks(tmp_path):
    spawn_ranks(async_worker, tmp_path, 2)
    seen = torch.load(tmp_path / "seen.pt")
    assert seen["latest"] == 1  # the write is held: step 1 is still the checkpoint
    assert seen["listing"] == [".tmp_step_00000002", "latest", "step_00000001"]
    assert seen["try_finalize"] is None and seen["pending"]
    assert seen["finalized"] == str(tmp_path / "async" / STEP2)
    assert seen["latest_after"] == 2 and seen["pending_after"] is None
    # the update made during the write is not in it: the same state as the synchronous save
    _assert_same_step(tmp_path / "sync" / STEP2, tmp_path / "async" / STEP2)


def _config(tmp_path, name, **overrides):
    from trainer_testing import small_config

    values = dict(save=str(tmp_path / name / "ckpt"), ckpt_format="torch_dist", save_interval=1)
    return small_config(tmp_path / name, **dict(values, **overrides))


@pytest.mark.slow
def test_async_run_resumes_like_the_uninterrupted_synchronous_run(tmp_path):

    from trainer_testing import rendezvous

    from megatron_rl.train.run import run

    straight = _config(tmp_path, "sync", train_iters=3)
    run(straight, **rendezvous(tmp_path, "rdzv_sync"))
    first = _config(tmp_path, "async", train_iters=2, async_save=True)
    run(first, **rendezvous(tmp_path, "rdzv_async1"))
    sync_ckpt, async_ckpt = (tmp_path / name / "ckpt" for name in ("sync", "async"))
    assert latest_step(str(async_ckpt)) == 2
    _assert_same_step(sync_ckpt / STEP2, async_ckpt / STEP2)
    resumed = first.with_flags(train_iters=3, load=first.checkpoint.save)
    run(resumed, **rendezvous(tmp_path, "rdzv_async2"))
    assert latest_step(str(async_ckpt)) == 3
    _assert_same_step(sync_ckpt / "step_00000003", async_ckpt / "step_00000003")


@pytest.mark.slow
def test_the_run_ends_only_after_its_last_save_is_committed(tmp_path, monkeypatch):
    from trainer_testing import rendezvous

    from megatron_rl.train.run import run

    _hold_writer(monkeypatch, delay=1.5)  # the write outlasts everything after the last step
    config = _config(tmp_path, "run", train_iters=1, async_save=True)
    run(config, **rendezvous(tmp_path))
    save_dir = config.checkpoint.save
    assert latest_step(save_dir) == 1
    assert sorted(os.listdir(save_dir)) == ["latest", "step_00000001"]
    assert pending_save() is None


@pytest.mark.slow
def test_a_new_save_commits_the_pending_one_and_an_abandoned_one_commits_nothing(
    ws1, tmp_path, monkeypatch
):
    """Never two writes in flight; the error path (no collective) waits for the writer and
    leaves the previous step as latest."""
    from train_state_testing import build_tiny, train_steps

    from megatron_rl.train.checkpoint.save import save_training_state, start_async_save

    _, model, optimizer = build_tiny(seed=0)
    save_dir = str(tmp_path / "ckpt")
    state = {"model": model, "optimizer": optimizer}
    save_training_state(save_dir, 1, rl_state={}, fmt="torch_dist", **state)
    _hold_writer(monkeypatch, delay=0.5)
    second = start_async_save(save_dir, 2, rl_state={}, **state)
    third = start_async_save(save_dir, 3, rl_state={}, **state)
    assert second.committed == os.path.join(save_dir, STEP2) and pending_save() is third
    third.abandon()
    assert pending_save() is None
    assert latest_step(save_dir) == 2
    assert any(n.endswith(".distcp") for n in os.listdir(tmp_path / "ckpt" / ".tmp_step_00000003"))
    # the next save, of another layout (megatron's plain optimizer), must not take the abandoned
    # writer's results for its own: its metadata would describe the wrong files
    from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
    from megatron_rl.model import build_model, preset_config
    from megatron_rl.train.checkpoint.load import load_training_state

    def plain(seed: int) -> dict:
        torch.manual_seed(seed)
        model = wrap_for_training(build_model(tiny), use_distributed_optimizer=False)
        config = OptimizerConfig(lr=3e-3, use_distributed_optimizer=False)
        return {"model": model, "optimizer": build_optimizer(model, config)}

    tiny = preset_config("tiny")
    other = plain(1)
    train_steps(other["model"], other["optimizer"], tiny.vocab_size, 1)  # Adam state to save
    save_training_state(save_dir, 4, rl_state={"step": 4}, fmt="torch_dist", **other)
    assert sorted(os.listdir(save_dir)) == ["latest", STEP2, "step_00000004"]  # 3 removed
    loaded = plain(2)
    assert load_training_state(save_dir, **loaded) == {"step": 4}
    for name, tensor in other["model"].state_dict().items():
        if torch.is_tensor(tensor):
            assert torch.equal(loaded["model"].state_dict()[name], tensor), name
