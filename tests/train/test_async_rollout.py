"""--async-rollout: one-step-off-policy generation overlapping training, with bounded staleness,
every prompt trained exactly once, and resume from the last trained batch."""

from __future__ import annotations

import json
import threading
import time

import pytest
from trainer_testing import StepRecorder, killed_after, rendezvous, small_config

from megatron_rl.data.sampler import PromptSampler
from megatron_rl.train.config import TrainConfig, parse_args
from megatron_rl.train.rollouts.async_rollout import Producer, overlap, staleness_metrics
from megatron_rl.train.run import run
from megatron_rl.train.trainer import Trainer


def _tiny(tmp_path, **overrides) -> TrainConfig:
    values = dict(
        async_rollout=True,
        rollout_batch_size=2,
        n_samples_per_prompt=2,
        global_batch_size=4,
        micro_batch_size=4,
        max_response_length=2,
    )
    values.update(overrides)
    return small_config(tmp_path, **values)


def _expected_batches(sampler: PromptSampler, batch: int, steps: int) -> list[list[int]]:
    fresh = PromptSampler(sampler.num_records, seed=sampler.seed, shuffle=sampler.shuffle)
    return [fresh.next_batch(batch) for _ in range(steps)]


def test_config_validation():
    with pytest.raises(ValueError, match="--max-staleness=0"):
        TrainConfig.from_flags(async_rollout=True, max_staleness=0)
    with pytest.raises(ValueError, match="without --async-rollout"):
        TrainConfig.from_flags(max_staleness=2)
    config = parse_args(["--async-rollout", "--max-staleness", "2"])
    assert config.rollout.async_rollout and config.rollout.max_staleness == 2
    assert not parse_args([]).rollout.async_rollout and parse_args([]).rollout.max_staleness == 1


def test_the_producer_reports_a_running_generation_up_to_now_and_keeps_16_intervals():
    """`time/generation` of a step counts the part of a generation still running at its end
    (with partial rollouts the sync does not wait for it), and the interval history is bounded."""
    started, release = threading.Event(), threading.Event()

    def generate(prompts, index):
        if index == 0:
            started.set()
            release.wait()
        return [], {}

    producer = Producer(generate)
    try:
        producer.submit(0, [1])
        started.wait()
        (start, end), *rest = producer.spans()
        assert not rest and start <= end <= time.perf_counter() and producer.intervals == []
        release.set()
        producer.result(0)
        assert producer.spans() == producer.intervals and len(producer.intervals) == 1
        for index in range(1, 21):
            producer.submit(index, [index])
            producer.result(index)
        assert len(producer.intervals) == 16
    finally:
        release.set()
        producer.close()


def test_staleness_metrics_and_overlap_helpers():
    out = staleness_metrics([3, 3, 4, 4], current=4, max_staleness=2)
    assert out == {
        "async/staleness_mean": 0.5,
        "async/staleness_hist/0": 2.0,
        "async/staleness_hist/1": 2.0,
        "async/staleness_hist/2": 0.0,
    }
    assert overlap((0.0, 2.0), (1.0, 5.0)) == 1.0 and overlap((0.0, 1.0), (2.0, 3.0)) == 0.0


ASYNC_ONLY = {  # what the async rollout source adds to a step's metrics
    "async/staleness_mean",
    "async/staleness_hist/0",
    "async/staleness_hist/1",
    "async/dropped_batches",
    "async/overlap_fraction",
    "time/generation",
    "time/engine_idle",
    "time/trainer_idle",
}


def test_sync_and_async_steps_share_one_body(tmp_path, monkeypatch):
    """The async step reports the sync step's metrics plus the async source's, every step; its
    first step (generated in the foreground, same seed and weights) trains on the same samples
    the sync step does, so every value but the timings agrees; both trained the prompts they
    drew."""
    recorder = StepRecorder(monkeypatch)
    rows, prompts = {}, {}
    for mode in (False, True):
        config = _tiny(tmp_path / f"async_{mode}", async_rollout=mode, train_iters=3)
        trainer = Trainer(config, **rendezvous(tmp_path, f"rdzv_{mode}"))
        try:
            expected = _expected_batches(trainer.rollouts.sampler, 2, 3)
            rows[mode] = [trainer.step() for _ in range(3)]
        finally:
            trainer.close()
        prompts[mode] = [step["prompts"] for step in recorder.steps]
        recorder.steps.clear()
        assert prompts[mode] == expected
    for sync_row, async_row in zip(rows[False], rows[True], strict=True):
        assert set(sync_row) <= set(async_row)
        assert set(async_row) - set(sync_row) == ASYNC_ONLY
    first_sync, first_async = rows[False][0], rows[True][0]
    for key, value in first_sync.items():
        if not key.startswith("time/"):
            assert first_async[key] == pytest.approx(value, rel=1e-6, abs=1e-9), key


@pytest.mark.slow
def test_fifty_async_steps_train_every_prompt_once_within_the_staleness_bound(
    tmp_path, monkeypatch
):
    """(a) no prompt lost or duplicated over 50 steps with a sync after each; (b) every trained
    sample carries its weight version, one behind the trainer (0 at the first step)."""
    recorder = StepRecorder(monkeypatch)
    steps = 50
    trainer = Trainer(_tiny(tmp_path, train_iters=steps), **rendezvous(tmp_path))
    try:
        expected = _expected_batches(trainer.rollouts.sampler, 2, steps)
        rows = [trainer.step() for _ in range(steps)]
        assert trainer.weight_version == steps  # one sync per step
    finally:
        trainer.close()
    assert [s["prompts"] for s in recorder.steps] == expected
    for k, step in enumerate(recorder.steps):
        assert None not in step["versions"]
        behind = {step["trainer_version"] - v for v in step["versions"]}
        assert behind == ({0} if k == 0 else {1}), k
    assert all(r["async/dropped_batches"] == 0 for r in rows)
    assert all(r["async/staleness_mean"] <= 1 for r in rows)
    assert rows[1]["async/staleness_hist/1"] == 4.0 and rows[1]["async/staleness_hist/0"] == 0.0
    for key in ("async/overlap_fraction", "time/trainer_idle", "time/engine_idle"):
        assert all(r[key] >= 0 for r in rows), key
    assert 0 < rows[1]["async/overlap_fraction"] <= 1
    assert rows[-1]["time/generation"] == 0.0  # nothing is generated after the last step


def test_a_batch_beyond_max_staleness_is_dropped_and_regenerated(tmp_path, monkeypatch):
    """An extra weight sync while the next batch waits puts it 2 versions behind: with S = 1 it
    is generated again, for the same prompts, under the current weights."""
    recorder = StepRecorder(monkeypatch)
    trainer = Trainer(_tiny(tmp_path, train_iters=4), **rendezvous(tmp_path))
    try:
        expected = _expected_batches(trainer.rollouts.sampler, 2, 4)
        rows = [trainer.step(), trainer.step()]
        trainer.sync_weights(version=trainer.weight_version + 1)  # the artificial delay
        rows += [trainer.step(), trainer.step()]
    finally:
        trainer.close()
    assert [r["async/dropped_batches"] for r in rows] == [0.0, 0.0, 1.0, 0.0]
    assert rows[2]["async/staleness_mean"] == 0.0  # regenerated with the trainer's weights
    assert [s["prompts"] for s in recorder.steps] == expected
    for step in recorder.steps:
        assert max(step["trainer_version"] - v for v in step["versions"]) <= 1


def test_a_stop_after_the_rollout_redraws_its_prompts(tmp_path, monkeypatch):
    recorder = StepRecorder(monkeypatch)
    trainer = Trainer(_tiny(tmp_path, train_iters=4), **rendezvous(tmp_path))
    try:
        expected = _expected_batches(trainer.rollouts.sampler, 2, 3)
        trainer.step()
        saved = trainer.state_dict()["sampler"]  # batch 1 is in flight, not part of the state
        assert trainer.step(should_stop=lambda: True) is None
        assert trainer.step_index == 1 and trainer.rollouts.sampler.state_dict() == saved
        trainer.step()
        trainer.step()
    finally:
        trainer.close()
    assert [s["prompts"] for s in recorder.steps] == expected


@pytest.mark.slow
def test_resume_mid_run_continues_from_the_last_trained_batch(tmp_path, monkeypatch):
    """(c) the prompt sequence of a resumed async run equals the uninterrupted run's."""
    recorder = StepRecorder(monkeypatch)
    straight = _tiny(tmp_path / "a", train_iters=5)
    run(straight, **rendezvous(tmp_path, "rdzv_a"))
    uninterrupted = [s["prompts"] for s in recorder.steps]
    recorder.steps.clear()
    first = _tiny(tmp_path / "b", train_iters=5, save=str(tmp_path / "b" / "ckpt"), save_interval=2)
    with killed_after(3):  # batch 4 in flight
        run(first, **rendezvous(tmp_path, "rdzv_b1"))
    assert int((tmp_path / "b" / "ckpt" / "latest").read_text()) == 2
    run(first.with_flags(load=first.checkpoint.save), **rendezvous(tmp_path, "rdzv_b2"))
    resumed = [s["prompts"] for s in recorder.steps]
    # steps 1-3 of the killed run, then steps 3-5 again from the step-2 checkpoint
    assert resumed[:3] == uninterrupted[:3]
    assert resumed[3:] == uninterrupted[2:]
    rows = [json.loads(line) for line in (tmp_path / "b" / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows][-3:] == [3, 4, 5]
    assert rows[-3]["async/staleness_mean"] == 0.0  # regenerated in the foreground on resume


def test_async_run_logs_the_async_metrics(tmp_path):
    """(d) a run() with --async-rollout writes every async metric to metrics.jsonl."""
    run(small_config(tmp_path, async_rollout=True, train_iters=3), **rendezvous(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert [r["step"] for r in rows] == [1, 2, 3]
    for key in (
        "async/staleness_mean",
        "async/staleness_hist/0",
        "async/staleness_hist/1",
        "async/overlap_fraction",
        "async/dropped_batches",
        "time/trainer_idle",
        "time/engine_idle",
    ):
        assert all(key in r for r in rows), key
    assert rows[1]["async/staleness_mean"] == 1.0


@pytest.mark.slow
def test_async_rollouts_through_the_sglang_http_client(tmp_path):
    """The SGLang client's HTTP calls run in the generation thread just as well (the CPU loopback
    server stands in for SGLang; weights synced through the disk transport)."""
    from megatron_rl.data import BuiltinTaskConfig, builtin_task
    from megatron_rl.rollout import InProcessEngine
    from megatron_rl.testing.loopback_server import LoopbackServer
    from megatron_rl.train.task import load_policy_config

    config = small_config(tmp_path, async_rollout=True, train_iters=3)
    tokenizer, _ = builtin_task(BuiltinTaskConfig(seed=config.parallel.seed))
    hf_config, _ = load_policy_config(config.task, tokenizer)
    server = LoopbackServer(InProcessEngine.from_hf_config(hf_config, seed=99)).start()
    try:
        sglang = config.with_flags(
            rollout_engine="sglang", sglang_url=(server.url,), weight_sync_transport="disk"
        )
        last = run(sglang, **rendezvous(tmp_path))
        assert server.engine.weight_version == 3  # one sync per step
        assert last["rollout/weight_version"] == 1.0  # step 3's batch came from version 1
        assert last["async/staleness_mean"] == 1.0
    finally:
        server.stop()


@pytest.mark.slow
@pytest.mark.distributed
def test_async_rollouts_with_two_tensor_parallel_ranks(tmp_path):
    """The generator rank generates in the background; its tensor-parallel peer receives the
    batch and the generation timings by broadcast."""
    from test_trainer_e2e import run_two_ranks

    overrides = {"async_rollout": True, "tensor_model_parallel_size": 2, "train_iters": 3}
    results = run_two_ranks(tmp_path, overrides)
    assert results[0] == results[1]
    assert results[0]["async/staleness_mean"] == 1.0
    assert "async/overlap_fraction" in results[0] and "time/trainer_idle" in results[0]


@pytest.mark.slow
@pytest.mark.hardware_sensitive
def test_the_main_job_learns_with_async_rollouts(tmp_path):
    """(d) The embedded default with --async-rollout and the engine's log-probs as behaviour
    (the policy that generated the one-version-old samples) learns the task.

    One run is a draw of the CPU's float rounding. Measured: the last 5 steps' mean accuracy
    0.91-0.99 over seeds 1234 and 1-5 with torch's AVX-512 and AVX2 kernels (12 runs, Intel
    Xeon; 0.70-0.99 over three seeds on an earlier checkpoint, docs/performance.md), against a
    chance of 1/16; the bar, 0.75, sits below them."""
    config = TrainConfig.from_flags(
        run_dir=str(tmp_path / "run"),
        device="cpu",
        no_progress=True,
        async_rollout=True,
        behavior_logprobs="rollout",
    )
    run(config, **rendezvous(tmp_path))
    rows = [json.loads(line) for line in (tmp_path / "run" / "metrics.jsonl").open()]
    assert len(rows) == config.schedule.train_iters
    assert rows[0]["accuracy"] < 0.3
    final = [r["accuracy"] for r in rows[-5:]]
    assert sum(final) / len(final) >= 0.75, final
    assert all(r["async/staleness_mean"] == 1.0 for r in rows[1:])


@pytest.mark.parametrize("depth", [2, 4])
def test_k_batches_ahead_train_every_prompt_once_at_most_k_versions_behind(
    tmp_path, monkeypatch, depth
):
    """``--max-staleness K``: K rollouts are drawn ahead and generated in the background; every
    prompt is trained once, in draw order, and no sample is more than K versions behind."""
    recorder = StepRecorder(monkeypatch)
    steps = 8
    config = _tiny(tmp_path, train_iters=steps, max_staleness=depth)
    trainer = Trainer(config, **rendezvous(tmp_path))
    try:
        expected = _expected_batches(trainer.rollouts.sampler, 2, steps)
        rows = [trainer.step() for _ in range(steps)]
        assert not trainer.rollouts.source.pending  # nothing drawn beyond --train-iters
    finally:
        trainer.close()
    assert [s["prompts"] for s in recorder.steps] == expected
    behind = [max(s["trainer_version"] - v for v in s["versions"]) for s in recorder.steps]
    assert behind[0] == 0 and max(behind) <= depth
    assert max(behind) >= 2  # the producer ran ahead of the trainer: deeper than one step
    assert all(r["async/dropped_batches"] == 0 for r in rows)
    assert all(f"async/staleness_hist/{depth}" in r for r in rows)


def test_a_checkpoint_of_a_k_deep_run_records_the_first_batch_not_trained(tmp_path, monkeypatch):
    """The batches drawn ahead are not in the state: a resume draws them again, in order."""
    recorder = StepRecorder(monkeypatch)
    trainer = Trainer(_tiny(tmp_path, train_iters=6, max_staleness=3), **rendezvous(tmp_path))
    try:
        expected = _expected_batches(trainer.rollouts.sampler, 2, 6)
        trainer.step()
        trainer.step()
        state = trainer.state_dict()
        assert len(trainer.rollouts.source.pending) == 3
        trainer.load_state_dict(state)  # what a resume does (in the same process)
        assert not trainer.rollouts.source.pending
        for _ in range(4):
            trainer.step()
    finally:
        trainer.close()
    assert [s["prompts"] for s in recorder.steps] == expected


def test_dynamic_sampling_needs_one_batch_ahead():
    with pytest.raises(ValueError, match="--max-staleness 1 with --dynamic-sampling"):
        TrainConfig.from_flags(async_rollout=True, max_staleness=2, dynamic_sampling=True)


def test_partial_rollouts_continue_across_a_sync_with_per_segment_versions(tmp_path, monkeypatch):
    """``--partial-rollout`` with the in-process engine: a background generation still decoding
    when the weight sync starts is parked at a token boundary, gets the new weights and goes on,
    so its samples span two versions and say where. No timing decides it: the producer's first
    decoding step after step 0 started training waits until a sync pauses the engine, and the
    sync waits (when the producer has work) until that generation is parked there."""
    import threading

    config = _tiny(
        tmp_path,
        train_iters=4,
        max_response_length=6,
        partial_rollout=True,
        behavior_logprobs="rollout",
        mask_stale_tokens=True,
    )
    trainer = Trainer(config, **rendezvous(tmp_path))
    engine, producer = trainer.engine, trainer.rollouts.source.producer
    armed, held = threading.Event(), threading.Event()
    real_forward, real_sync = engine.model.forward, trainer.sync_weights

    def forward(*args, **kwargs):
        on_producer = threading.current_thread().name == "rollout-producer"
        if on_producer and armed.is_set() and not held.is_set():
            held.set()
            while engine.paused() is None:  # until the sync pauses the engine
                threading.Event().wait(0.001)
        return real_forward(*args, **kwargs)

    def sync_weights(version):
        if armed.is_set() and not held.is_set() and (producer._busy or producer._jobs):
            held.wait()  # the running generation reached the hook: it is in flight now
        return real_sync(version)

    monkeypatch.setattr(engine.model, "forward", forward)
    trainer.sync_weights = sync_weights
    taken = []
    real_train_on = trainer.train_on

    def train_on(samples, stop=None):  # rollout 0 is taken: later ones generate meanwhile
        taken.append(samples)
        armed.set()
        return real_train_on(samples, stop)

    trainer.train_on = train_on
    try:
        rows = [trainer.step() for _ in range(4)]
    finally:
        trainer.close()
    assert held.is_set()
    spanning = [s for batch in taken for s in batch if len(s.weight_versions) > 1]
    assert spanning, "no sample generated across a sync spans versions"
    for sample in spanning:
        versions = [v for v, _, _ in sample.weight_versions]
        assert versions == sorted(versions) and versions[-1] == versions[0] + 1
        assert sample.weight_versions[0][1] == 0
        assert sample.weight_versions[-1][2] == sample.response_ids.numel()
        assert sample.weight_version == versions[0]
    assert max(r["staleness/multi_version_sample_frac"] for r in rows) > 0
    assert all(r["async/dropped_batches"] == 0 for r in rows)
