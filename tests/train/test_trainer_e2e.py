"""End-to-end CPU runs of the trainer: every loss, every replay mode, 2 gloo ranks, resume,
preemption, and a reward function that raises."""

from __future__ import annotations

import json
import os
import signal
import threading

import pytest
import torch
from forked_ranks import forkserver_context
from paper_losses import PAPER_LOSSES
from trainer_testing import rendezvous, small_config

from megatron_rl.train.run import run
from megatron_rl.train.trainer import Trainer


def _metrics(tmp_path) -> list[dict]:
    with open(tmp_path / "run" / "metrics.jsonl") as handle:
        return [json.loads(line) for line in handle]


@pytest.mark.slow
def test_every_loss_trains_end_to_end(tmp_path, monkeypatch):
    """One trainer, the loss switched between steps: every loss runs a full step on CPU.

    The reward is a parity of the response text, so every group has mixed rewards and every
    loss must produce a non-zero gradient.
    """
    (tmp_path / "parity_reward.py").write_text(
        "def reward(response, answer):\n    return float(sum(map(ord, response)) % 2)\n"
    )
    monkeypatch.syspath_prepend(str(tmp_path))
    config = small_config(tmp_path, reward="parity_reward:reward", n_samples_per_prompt=8)
    trainer = Trainer(config.with_flags(global_batch_size=16), **rendezvous(tmp_path))
    try:
        for name in PAPER_LOSSES:
            trainer.config = trainer.config.with_flags(loss=name)
            trainer.objective = trainer.config.objective
            metrics = trainer.step()
            assert all(v == v for v in metrics.values()), name  # no NaN metric
            assert metrics["grad_norm"] > 0, name
            assert metrics["policy/num_tokens"] > 0, name
            assert any(key.startswith(f"{name}/") for key in metrics), name
    finally:
        trainer.close()


@pytest.mark.parametrize(
    "replay",
    [
        {"routing_replay": "r2"},
        {"routing_replay": "r3", "routing_dtype": "packed"},
        {"routing_replay": "r3", "routing_record_only": True},
    ],
    ids=["r2", "r3_packed", "r3_record_only"],
)
def test_routing_replay_modes_run_and_report_state_and_agreement(tmp_path, replay):
    last = run(small_config(tmp_path, **replay), **rendezvous(tmp_path))
    assert last["routing/state_bytes"] >= 0
    assert 0.0 <= last["routing/agreement/update"] <= 1.0
    # every mode holds routing bytes: R2 its recordings, R3 the engine's routes in the samples
    assert last["routing/bytes_per_rank"] > 0
    if replay["routing_replay"] == "r2":
        assert last["routing/state_bytes"] == last["routing/bytes_per_rank"]
        assert last["routing/agreement/update"] > 0.5  # the policy moved a little in one step
        assert "routing/agreement/behaviour" not in last  # R2 records its own routes there
    else:  # R3: the behaviour pass compares the engine's routes with the trainer's, same weights
        assert last["routing/state_bytes"] == 0
        # fp32 engine and trainer route alike: padding and final tokens are not counted
        assert last["routing/agreement/behaviour"] == 1.0
    rows = _metrics(tmp_path)
    assert [r["step"] for r in rows] == [1, 2]
    assert os.path.exists(tmp_path / "run" / "learning_curve.svg")


@pytest.mark.slow
@pytest.mark.parametrize(
    "optimizer",
    [{}, {"use_distributed_optimizer": True, "bf16": True}],
    ids=["adam_fp32", "distributed_adam_bf16"],
)
def test_resume_equals_an_uninterrupted_run(tmp_path, optimizer):
    """Also with what GPUs run: megatron's distributed optimizer over bf16 parameters."""
    straight = small_config(
        tmp_path / "a", train_iters=4, save=str(tmp_path / "a" / "ckpt"), **optimizer
    )
    run(straight, **rendezvous(tmp_path, "rdzv_a"))
    first = small_config(
        tmp_path / "b", train_iters=2, save=str(tmp_path / "b" / "ckpt"), **optimizer
    )
    run(first, **rendezvous(tmp_path, "rdzv_b1"))
    resumed = first.with_flags(train_iters=4, load=first.checkpoint.save)
    run(resumed, **rendezvous(tmp_path, "rdzv_b2"))
    a = torch.load(_latest_model_file(tmp_path / "a" / "ckpt"), weights_only=False)
    b = torch.load(_latest_model_file(tmp_path / "b" / "ckpt"), weights_only=False)
    assert a.keys() == b.keys()
    for key in a:
        if torch.is_tensor(a[key]):
            assert torch.equal(a[key], b[key]), key
    steps = [r["step"] for r in _metrics(tmp_path / "b")]
    assert steps == [1, 2, 3, 4]


def _latest_model_file(folder):
    step = int((folder / "latest").read_text())
    return folder / f"step_{step:08d}" / "model_rank00000.pt"


@pytest.mark.slow
def test_sigterm_saves_at_the_next_step_and_exits_cleanly(tmp_path):
    config = small_config(tmp_path, train_iters=5000, save=str(tmp_path / "ckpt"))
    timer = threading.Timer(8.0, lambda: os.kill(os.getpid(), signal.SIGTERM))
    timer.start()
    try:
        run(config, **rendezvous(tmp_path))
    finally:
        timer.cancel()
    saved = int((tmp_path / "ckpt" / "latest").read_text())
    assert 1 <= saved < 5000
    assert len(_metrics(tmp_path)) == saved


def test_a_stop_request_is_served_within_one_update(tmp_path):
    """After the rollout: the step is abandoned and its prompts are drawn again; before an
    update: the remaining updates are skipped and the step ends."""
    trainer = Trainer(small_config(tmp_path), **rendezvous(tmp_path))
    try:
        position = trainer.rollouts.sampler.state_dict()
        assert trainer.step(should_stop=lambda: True) is None
        assert trainer.step_index == 0 and trainer.rollouts.sampler.state_dict() == position
        answers = iter([False, False, True])  # after the rollout, update 1, update 2
        metrics = trainer.step(should_stop=lambda: next(answers))
        assert trainer.step_index == 1
        assert metrics["update/skipped_preempted"] == 1.0 and "grad_norm" in metrics  # one ran
    finally:
        trainer.close()


@pytest.mark.slow
def test_a_kl_term_to_the_frozen_reference_starts_at_zero_and_grows(tmp_path):
    run(small_config(tmp_path, kl_coef=0.05, train_iters=3), **rendezvous(tmp_path))
    rows = _metrics(tmp_path)
    assert 0 <= rows[0]["kl/value"] < 1e-3  # step 1 starts at the reference itself
    assert rows[-1]["kl/value"] > rows[0]["kl/value"]


def test_sigterm_during_start_up_exits_cleanly_before_the_first_step(tmp_path, caplog, monkeypatch):
    import megatron_rl.train.run as run_module

    class SignalledWhileBuilding(Trainer):
        def __init__(self, *args, **kwargs):
            os.kill(os.getpid(), signal.SIGTERM)  # arrives while the model is being built
            super().__init__(*args, **kwargs)

    monkeypatch.setattr(run_module, "Trainer", SignalledWhileBuilding)
    assert run(small_config(tmp_path, train_iters=5), **rendezvous(tmp_path)) == {}
    assert not os.path.exists(tmp_path / "run" / "metrics.jsonl")
    assert "during start-up" in caplog.text


def test_a_reward_function_that_raises_fails_its_samples_not_the_run(tmp_path, monkeypatch):
    module = tmp_path / "flaky_reward.py"
    module.write_text("def reward(response, answer):\n    raise RuntimeError('broken verifier')\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    last = run(small_config(tmp_path, reward="flaky_reward:reward"), **rendezvous(tmp_path))
    assert last["reward/failed_frac"] == 1.0  # every sample failed, logged, scored 0
    assert last["reward/mean"] == 0.0
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]


def run_two_ranks(tmp_path, overrides: dict) -> dict[int, dict]:
    """Run `_two_rank_worker` on two ranks; {rank: its last metrics}."""
    ctx = forkserver_context()  # ranks forked from a pre-imported server (tests/forked_ranks.py)
    queue = ctx.Queue()
    procs = [
        ctx.Process(target=_two_rank_worker, args=(r, str(tmp_path), overrides, queue))
        for r in range(2)
    ]
    for p in procs:
        p.start()
    results = dict(queue.get(timeout=600) for _ in procs)
    for p in procs:
        p.join(timeout=120)
        assert p.exitcode == 0
    return results


def _two_rank_worker(rank, tmp, overrides, queue):
    import torch

    torch.set_num_threads(1)
    from pathlib import Path

    from trainer_testing import small_config

    from megatron_rl.train.run import run

    config = small_config(Path(tmp), **overrides)
    last = run(config, rank=rank, world_size=2, init_method=f"file://{tmp}/rdzv2")
    queue.put((rank, last))


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "overrides",
    [{}, {"expert_model_parallel_size": 2, "routing_replay": "r3"}],
    ids=["dp2", "ep2_r3"],
)
def test_two_gloo_ranks_train_together(tmp_path, overrides):
    results = run_two_ranks(tmp_path, overrides)
    assert results[0] == results[1]  # metrics are averaged over ranks: every rank reports them
    assert results[0]["grad_norm"] > 0
    assert [r["step"] for r in _metrics(tmp_path)] == [1, 2]


def test_non_finite_updates_are_skipped_then_stop_the_run_with_a_checkpoint(tmp_path, monkeypatch):
    import megatron_rl.train.trainer as trainer_module
    from megatron_rl.train.run import TrainingStopped

    real = trainer_module.policy_logprobs

    def poisoned(logits, mb, temperature=1.0):
        out = real(logits, mb, temperature)
        return out * float("nan") if torch.is_grad_enabled() else out  # only the updates

    monkeypatch.setattr(trainer_module, "policy_logprobs", poisoned)
    config = small_config(tmp_path, train_iters=10, max_bad_steps=3, save=str(tmp_path / "ckpt"))
    with pytest.raises(TrainingStopped, match="3 consecutive updates had non-finite"):
        run(config, **rendezvous(tmp_path))
    rows = _metrics(tmp_path)
    assert rows[0]["update/skipped_nonfinite"] == 2.0  # N = 2 updates per step, both skipped
    # the limit is checked per update: the third bad update stops the run's updates at once
    assert rows[1]["update/skipped_nonfinite"] == 1.0
    assert rows[1]["update/skipped_stopping"] == 1.0
    assert int((tmp_path / "ckpt" / "latest").read_text()) == len(rows) == 2


@pytest.mark.slow
def test_the_trainer_drives_an_sglang_server_by_configuration_only(tmp_path):
    """The same trainer against SGLang's HTTP API: the loopback stand-in (fast; the real SGLang
    server runs the trainer in tests/rollout/test_real_sglang.py) backed by an in-process
    engine, with R3 routes over HTTP and weights synced through the disk transport."""
    from megatron_rl.data import BuiltinTaskConfig, builtin_task
    from megatron_rl.rollout import InProcessEngine
    from megatron_rl.testing.loopback_server import LoopbackServer
    from megatron_rl.train.task import load_policy_config

    config = small_config(tmp_path)
    tokenizer, _ = builtin_task(BuiltinTaskConfig(seed=config.parallel.seed))
    hf_config, _ = load_policy_config(config.task, tokenizer)
    server = LoopbackServer(InProcessEngine.from_hf_config(hf_config, seed=99)).start()
    try:
        sglang = config.with_flags(
            rollout_engine="sglang",
            sglang_url=(server.url,),
            sglang_return_routed_experts=True,
            routing_replay="r3",
            weight_sync_transport="disk",
        )
        last = run(sglang, **rendezvous(tmp_path))
        assert server.engine.weight_version == 2  # one sync per step
        assert last["rollout/weight_version"] == 1.0  # the step-2 rollout came from version 1
        assert last["mismatch/train_rollout_logprob_abs_gap"] < 1e-4  # weights really arrived
        assert "routing/agreement/update" in last and "routing/agreement/behaviour" in last
    finally:
        server.stop()


@pytest.mark.slow
def test_a_corrupted_checkpoint_stops_the_resume_or_falls_back_with_the_flag(tmp_path):
    save = str(tmp_path / "ckpt")
    run(small_config(tmp_path, train_iters=2, save=save, save_interval=1), **rendezvous(tmp_path))
    shard = tmp_path / "ckpt" / "step_00000002" / "optim_rank00000.pt"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0x01
    shard.write_bytes(bytes(data))
    resumed = small_config(tmp_path, train_iters=3, load=save)
    with pytest.raises(ValueError, match=r"optim_rank00000\.pt is corrupted"):
        run(resumed, **rendezvous(tmp_path, "rdzv2"))
    last = run(resumed.with_flags(load_fallback=True), **rendezvous(tmp_path, "rdzv3"))
    assert [r["step"] for r in _metrics(tmp_path)][-2:] == [2, 3]  # step 1 + 2 more
    assert last
