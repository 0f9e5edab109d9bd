"""The SGLang client against the real SGLang 0.5.23 server (and sglang-router 0.3.2) on CPU.

One server for the module (start-up ~50 s), serving the trainer's own tiny Qwen3-MoE shape (the
built-in task's vocabulary) so that the trainer test in ``tests/train/test_real_sglang_run.py``
can reuse the same set-up. Everything above the two test-only shims of ``tests/real_sglang/
shims`` is SGLang's own code: its HTTP server, tokenizer manager, scheduler, weight updater and
CPU model runner. The loopback stand-in (``test_update_sessions.py``) covers only what this
server cannot be made to show on demand.
"""

from __future__ import annotations

import json
import subprocess
import sys
import threading
import time
from pathlib import Path

import pytest
import torch
from ports import torchrun
from real_sglang import servers as real
from rollout_testing import direct_logprobs, random_hf_model

from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.http_pool import HttpPool, HttpPoolConfig, request_json
from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig
from megatron_rl.rollout.weight_sync import WeightSyncConfig, WeightSyncError
from megatron_rl.train.teacher import Teacher, TeacherConfig

# one worker process runs the whole module (make test: --dist loadgroup): one server start
pytestmark = [pytest.mark.slow, pytest.mark.real_sglang, pytest.mark.xdist_group("real_sglang")]
ROOT = Path(__file__).resolve().parents[2]
LEARN_STEPS = 50

PROMPTS = [[1, 5, 9, 3], [2, 7], [4, 4, 8, 11, 6, 12]]
PARAMS = SamplingParams(max_new_tokens=6, temperature=1.0)
SEQUENCE = [1, 5, 9, 3, 7, 2, 8, 13, 6, 4]
# bf16 server vs an fp32 HF reference of the same weights (measured max gap ~0.03 on this model)
BF16_LOGPROB_ATOL = 0.08


@pytest.fixture(scope="module")
def hf_config():
    return real.task_hf_config()


@pytest.fixture(scope="module")
def server(tmp_path_factory, hf_config):
    real.require()
    folder = tmp_path_factory.mktemp("real_sglang")
    model_dir = real.write_tiny_checkpoint(folder / "model", hf_config)
    started = real.start_server(model_dir, log_path=folder / "server.log")
    try:
        started.wait_ready(timeout_s=600)
        yield started
    finally:
        started.stop()


def client_for(
    server, hf_config, transport="distributed", tmp_path=None, pause_mode="abort", **config
):
    sync = WeightSyncConfig(
        transport=transport,
        bucket_bytes=64 * 1024,  # several buckets for the tiny model
        disk_dir=str(tmp_path) if tmp_path is not None else None,
        group_timeout_s=120.0,
        pause_mode=pause_mode,
    )
    engine_config = SGLangEngineConfig.from_hf_config(
        hf_config,
        http=HttpPoolConfig(urls=(server.url,), request_timeout_s=120.0, backoff_s=0.05),
        sync=sync,
        **config,
    )
    return SGLangEngine(engine_config, hf_config=hf_config)


def perturbed(hf_config, seed: int):
    """A random HF model of the server's shape: what the trainer would push."""
    return random_hf_model(hf_config, seed=seed)


def test_generation_returns_logprobs_and_routed_experts(server, hf_config):
    with client_for(server, hf_config) as client:
        assert client.wait_until_ready() >= 0  # also checks tp_size from /server_info
        samples = client.generate(PROMPTS, PARAMS, n=2, return_routed_experts=True)
    assert len(samples) == len(PROMPTS) * 2
    for s in samples:
        assert s.routes is not None and s.routes.num_tokens == s.num_routed_positions
        routes = client.codec.decode(s.routes, dtype=torch.int64)
        assert int(routes.max()) < hf_config.num_experts and s.finish_reason in ("stop", "length")
        assert bool((s.logprobs_R <= 0).all())


def test_sampling_supports_and_their_renormalised_logprobs_from_the_server(server, hf_config):
    """``return_sampling_mask`` at top-k 4, top-p 0.7: every token comes with the support it was
    drawn from (at most 4 ids, itself among them) and a log-prob that is the log of its
    probability renormalised on that support, as an fp32 forward of the server's weights gives
    it (bf16 server), far from the full-vocabulary log-prob (~log(1/4) against ~log(1/V))."""
    params = SamplingParams(
        max_new_tokens=6, top_k=4, top_p=0.7, seed=3, return_sampling_support=True
    )
    model = perturbed(hf_config, seed=21)
    with client_for(server, hf_config) as client:
        version = client.health().weight_version + 1
        client.update_weights(model.named_parameters(), version=version)
        samples = client.generate(PROMPTS, params, n=2)
    full_gap = []
    for s in samples:
        s.check()
        assert s.support_RK.shape[1] <= 4
        prompt, response = s.prompt_ids_P.tolist(), s.response_ids_R.tolist()
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([prompt + response])).logits[0].double()
        probs = torch.softmax(logits[len(prompt) - 1 : -1], dim=-1)
        for j, token in enumerate(response):
            support = s.support_RK[j][s.support_RK[j] >= 0]
            want = torch.log(probs[j, token] / probs[j, support].sum())
            assert abs(float(s.logprobs_R[j]) - float(want)) < BF16_LOGPROB_ATOL, (j, want)
            full_gap.append(float(want - torch.log(probs[j, token])))
    assert min(full_gap) >= 0 and max(full_gap) > 0.5


@pytest.mark.parametrize("transport", ["distributed", "disk", "tensor"])
def test_weight_sync_loads_the_trainer_weights(server, hf_config, transport, tmp_path):
    """After a sync the server scores a sequence as the pushed weights do (bf16 server)."""
    model = perturbed(hf_config, seed=11 + len(transport))
    want = direct_logprobs(model, SEQUENCE[:4], SEQUENCE[4:])
    with client_for(server, hf_config, transport, tmp_path) as client:
        version = client.weight_sync.pool.model_info(server.url).get("weight_version")
        version = 0 if version == "default" else int(version)
        client.update_weights(model.named_parameters(), version=version + 1)
        got = client.score(SEQUENCE)[3:]
        assert client.health().weight_version == version + 1
    torch.testing.assert_close(got, want, atol=BF16_LOGPROB_ATOL, rtol=0)


def test_a_sync_failing_midway_closes_its_session_and_the_next_succeeds(server, hf_config):
    """The trainer's side fails after the first buckets went out (a NaN in a later tensor):
    the session is closed in the finally, the version is unchanged, the next sync succeeds."""
    model = perturbed(hf_config, seed=3)
    named = [(n, p.detach().clone()) for n, p in model.named_parameters()]
    named[-1][1][0] = float("nan")
    with client_for(server, hf_config) as client:
        before = client.health().weight_version
        with pytest.raises(WeightSyncError, match="NaN"):
            client.update_weights(iter(named), version=before + 1)
        assert client.health().weight_version == before
        client.update_weights(model.named_parameters(), version=before + 1)
        assert client.health().weight_version == before + 1
        assert len(client.generate(PROMPTS[:1], PARAMS)) == 1


def test_updates_outside_a_session_are_refused(server):
    """What the client before sessions ran into (SGLang 0.5.23's scheduler)."""
    status, body = request_json(
        server.url,
        "POST",
        "/update_weights_from_tensor",
        {"serialized_named_tensors": [""], "load_format": "flattened_bucket"},
        timeout_s=60,
    )
    assert status == 400 and "must run between begin_weight_update()" in body["message"]


def test_pause_holds_generation_and_health_but_not_the_liveness_probe(server, hf_config):
    pool = HttpPool(HttpPoolConfig(urls=(server.url,), health_timeout_s=60.0))
    with client_for(server, hf_config) as client:
        request_json(server.url, "POST", "/pause_generation", {}, timeout_s=60)
        done: list = []
        thread = threading.Thread(target=lambda: done.append(client.generate(PROMPTS[:1], PARAMS)))
        try:
            thread.start()
            time.sleep(2.0)
            assert not done  # held while paused
            assert pool.alive(server.url)  # /model_info answers during the pause
            start = time.monotonic()
            assert not pool.probe(server.url)  # /health: 503 after SGLANG_HEALTH_CHECK_TIMEOUT
            assert time.monotonic() - start >= real.HEALTH_CHECK_TIMEOUT_S - 0.5
        finally:
            request_json(server.url, "POST", "/continue_generation", {}, timeout_s=60)
            thread.join(timeout=120)
        assert done and len(done[0]) == 1
        client.flush_cache()  # idle again: the flush goes through
        assert pool.probe(server.url)


def test_an_abort_all_mid_batch_regenerates_the_aborted_samples(server, hf_config, monkeypatch):
    """Long samples (SGLang's ``ignore_eos``: the tiny model's 16-token vocabulary ends most
    samples within a few tokens) so that an ``abort_all`` after 0.5 s lands mid-batch. 150
    tokens take ~1.5 s unloaded; the regenerated samples must finish within the client's
    request timeout on a loaded CI machine too (at 400 tokens two CI runs of the suite had a
    regenerated request exceed 120 s)."""
    to_sglang = SamplingParams.to_sglang
    monkeypatch.setattr(SamplingParams, "to_sglang", lambda p: {**to_sglang(p), "ignore_eos": True})
    long = SamplingParams(max_new_tokens=150, temperature=1.0)
    with client_for(server, hf_config) as client:
        timer = threading.Timer(
            0.5,
            lambda: request_json(
                server.url, "POST", "/abort_request", {"abort_all": True}, timeout_s=60
            ),
        )
        timer.start()
        samples = client.generate(PROMPTS, long, n=2)
        timer.join()
        aborted = client.take_aborted()
    assert aborted >= 1, "the abort came after the batch: lengthen max_new_tokens"
    assert len(samples) == len(PROMPTS) * 2 and all(s.finish_reason != "abort" for s in samples)


def test_a_release_waits_for_the_long_request_in_flight_and_the_server_lives(server, hf_config):
    """SGLang asserts an idle scheduler on ``/release_memory_occupation`` and its scheduler dies
    otherwise. The client's release polls ``/flush_cache`` first: asked for while a 150-token
    request runs, it releases once that request has finished whole, and the server lives on."""
    body = {
        "input_ids": PROMPTS[0],
        "sampling_params": {"max_new_tokens": 150, "ignore_eos": True, "temperature": 1.0},
    }
    answers = []
    running = threading.Thread(
        target=lambda: answers.append(
            real.request(server.url, "POST", "/generate", body, timeout_s=300)
        )
    )
    running.start()
    busy = False
    while running.is_alive() and not busy:  # a flush of an idle server is harmless
        busy = real.request(server.url, "POST", "/flush_cache")[0] == 400
    assert busy, "the request ended before the release: lengthen max_new_tokens"
    with client_for(server, hf_config) as client:
        client.release_memory(None)  # all three tags
        assert not running.is_alive()  # the release waited for it
        client.resume_memory(None)
        assert len(client.generate(PROMPTS[:1], PARAMS)) == 1
    running.join()
    status, answer = answers[0]
    assert status == 200 and answer["meta_info"]["completion_tokens"] == 150, answer


@torch.no_grad()
def _in_place_logprobs(old, new, prompt, response, at: int) -> torch.Tensor:
    """float32 [R - at]: ``response[at:]`` decoded by ``new`` over the KV cache ``old`` computed
    for ``prompt + response[: at - 1]``: what a request paused in place at token ``at`` sees."""
    import inspect

    from transformers import DynamicCache

    # transformers >= 5.2x calls the KV cache ``cache``; older ones ``past_key_values``
    forward_args = inspect.signature(type(old).forward).parameters
    kwarg = "cache" if "cache" in forward_args else "past_key_values"
    cache = DynamicCache(config=old.config)
    old(input_ids=torch.tensor([prompt + response[: at - 1]]), use_cache=True, **{kwarg: cache})
    logits = new(input_ids=torch.tensor([response[at - 1 : -1]]), use_cache=True, **{kwarg: cache})
    logp = torch.log_softmax(logits.logits[0].float(), dim=-1)
    return logp.gather(-1, torch.tensor(response[at:])[:, None]).squeeze(-1)


def _sync_during_a_long_request(server, hf_config, mode, old, new, body, wait_s: float):
    """Load ``old``, start ``body``, sync ``new`` with ``pause_mode=mode`` after ``wait_s``; the
    answer, the version ``old`` was loaded as, the sync's seconds and each control call's."""
    seconds: dict[str, list[float]] = {}
    with client_for(server, hf_config, pause_mode=mode) as client:
        client.update_weights(old.named_parameters(), version=client.health().weight_version + 1)
        client.flush_cache()  # an in_place sync keeps the prefix cache: no stale prompt KV
        version = client.health().weight_version
        pool = client.weight_sync.pool
        call_on = pool.call_on

        def timed(url, method, path, payload, **kwargs):
            start = time.monotonic()
            try:
                return call_on(url, method, path, payload, **kwargs)
            finally:
                seconds.setdefault(path, []).append(time.monotonic() - start)

        pool.call_on = timed
        answers: list = []
        thread = threading.Thread(
            target=lambda: answers.append(
                request_json(server.url, "POST", "/generate", body, timeout_s=600)
            )
        )
        thread.start()
        time.sleep(wait_s)  # the request runs (its length at the pause is checked by the caller)
        start = time.monotonic()
        client.update_weights(new.named_parameters(), version=version + 1)
        sync_s = time.monotonic() - start
        thread.join()
    status, answer = answers[0]
    assert status == 200, answer
    return answer, version, sync_s, seconds


@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_a_long_request_across_a_sync_paused_in_each_mode(server, hf_config, mode):
    """Partial rollouts on the real server: a 480-token request (``ignore_eos``) is running when
    the client syncs new weights with ``pause_mode``. ``retract`` and ``in_place`` keep it: it
    finishes with SGLang's ``weight_versions`` segments split where the pause came, the tokens
    before scored by the old weights; after it ``retract`` scores with the new weights alone
    (its KV recomputed after the flush) and ``in_place`` with the new weights over the old KV.
    ``abort`` ends it with its partial tokens. Prints each control call's latency.

    The two references differ only through the KV of the tokens before the pause, so a pause
    after a handful of tokens cannot tell the modes apart: on a loaded machine the request is
    run again with a longer wait until the pause comes after ``MIN_BEFORE`` tokens (and with a
    shorter one when the machine sped up and the request ended before the pause), and the
    modes are told apart on the tokens where their references differ by more than bf16 noise."""
    old, new = perturbed(hf_config, seed=31), perturbed(hf_config, seed=32)
    prompt, length, min_before = SEQUENCE[:4], 480, 60  # the model's context is 512 positions
    body = {
        "input_ids": prompt,
        "sampling_params": {"max_new_tokens": length, "temperature": 1.0, "ignore_eos": True},
        "return_logprob": True,
    }
    wait_s = 1.0
    for _attempt in range(6):  # the wait adapts to the machine's speed, which may change
        answer, version, sync_s, seconds = _sync_during_a_long_request(
            server, hf_config, mode, old, new, body, wait_s
        )
        meta, out = answer["meta_info"], answer["output_ids"]
        spans = meta.get("weight_versions")
        print(
            f"real SGLang, pause {mode} after {wait_s:.2f} s: {len(out)} tokens, finish "
            f"{meta['finish_reason']}, spans {spans}, cached_tokens {meta.get('cached_tokens')}, "
            f"sync {sync_s:.2f} s, "
            + ", ".join(f"{p} {max(v):.3f} s" for p, v in sorted(seconds.items()))
        )
        at = spans[0]["end"]
        assert at > 0, f"the pause came before the first token ({spans})"
        if at >= length:  # the machine sped up since the last try: the request ended first
            wait_s /= 4
            continue
        if mode == "abort" or at >= min_before:
            break
        wait_s *= min(8.0, 2.0 * min_before / at)  # the machine is loaded: pause later
    else:
        pytest.fail(f"no pause landed between token {min_before} and {length} (last: {spans})")
    lps = torch.tensor([entry[0] for entry in meta["output_token_logprobs"]])
    assert len(lps) == len(out)
    # bf16 server vs fp32 HF over up to 480 positions: measured mean 1.2e-2-1.7e-2, single
    # tokens up to 8.3e-2 (BF16_LOGPROB_ATOL was measured on 10-token sequences)
    before = (lps[:at] - direct_logprobs(old, prompt, out)[:at]).abs()
    assert before.mean() < 0.03 and before.max() < 2 * BF16_LOGPROB_ATOL, before
    if mode == "abort":
        assert meta["finish_reason"]["type"] == "abort" and len(out) == at
        assert spans == [{"version": str(version), "start": 0, "end": at}]
        return
    assert meta["finish_reason"]["type"] == "length" and len(out) == length
    assert spans == [
        {"version": str(version), "start": 0, "end": at},
        {"version": str(version + 1), "start": at, "end": length},
    ]
    assert meta["weight_version"] == str(version + 1)
    recomputed = direct_logprobs(new, prompt, out)[at:]
    kept = _in_place_logprobs(old, new, prompt, out, at)
    want, other = (recomputed, kept) if mode == "retract" else (kept, recomputed)
    error, other_error = (lps[at:] - want).abs(), (lps[at:] - other).abs()
    apart = (want - other).abs() > 2 * BF16_LOGPROB_ATOL  # beyond the bf16 server's noise
    print(
        f"  after the pause: |server - own reference| mean {error.mean():.2e} max "
        f"{error.max():.2e}; |server - other mode's reference| mean {other_error.mean():.2e}; "
        f"{int(apart.sum())} tokens where the references differ by > {2 * BF16_LOGPROB_ATOL}"
    )
    # measured: own 1.4e-2-1.6e-2 (bf16 server vs fp32 HF), the other mode's 3.2e-2-7.8e-2
    # (the more tokens before the pause, the larger)
    assert error.mean() < 0.03 and other_error.mean() > error.mean()
    assert apart.sum() >= 5, "the references agree: the pause came too early to tell modes apart"
    assert error[apart].mean() * 2.5 < other_error[apart].mean()


def test_what_sglang_refuses_while_requests_are_paused_in_place_or_retracted(
    server, hf_config, tmp_path
):
    """What the loopback stand-in plays (``test_pause_modes.py``), on the real server, with one
    long request per mode. ``in_place``: ``/flush_cache`` and a disk update's own flush are
    refused (the update loads anyway), and ``/update_weight_version`` without
    ``abort_all_requests: false`` aborts the paused request. ``retract``:
    ``/flush_cache?timeout=0`` flushes, a waiting flush times out (the retracted request waits
    in the queue), and the request finishes after ``/continue_generation``."""
    checkpoint = real.write_tiny_checkpoint(tmp_path / "ckpt", hf_config, seed=41)
    body = {
        "input_ids": SEQUENCE[:4],
        "sampling_params": {"max_new_tokens": 480, "temperature": 1.0, "ignore_eos": True},
    }
    version = HttpPool(HttpPoolConfig(urls=(server.url,))).model_info(server.url)
    version = str(version["weight_version"])

    def post(path, payload=None):  # SGLang answers 400 to a control call without a body
        return request_json(server.url, "POST", path, payload, timeout_s=120)

    def paused_request(mode: str, steps):
        """Start the request, pause in ``mode`` after 1 s, run ``steps()``, continue; the
        request's answer and what ``steps`` returned."""
        answers: list = []
        # the paused request waits through the pause: a generous guard (600 s), not a measure
        generate = lambda: request_json(server.url, "POST", "/generate", body, timeout_s=600)  # noqa: E731
        thread = threading.Thread(target=lambda: answers.append(generate()))
        thread.start()
        try:
            time.sleep(1.0)  # the request runs (checked: it is still running when paused)
            assert post("/pause_generation", {"mode": mode})[0] == 200
            assert thread.is_alive(), "the request ended before the pause: lengthen it"
            seen = steps()
        finally:
            assert post("/continue_generation", {})[0] == 200
            thread.join()
        return answers[0][1], seen

    answer, (refused, loaded) = paused_request(
        "in_place",
        lambda: (
            post("/flush_cache?timeout=0"),
            post("/update_weights_from_disk", {"model_path": str(checkpoint)}),
            post("/update_weight_version", {"new_version": version}),  # aborts by default
        )[:2],
    )
    in_place = answer["meta_info"]
    answer, (flushed, waited) = paused_request(
        "retract", lambda: (post("/flush_cache?timeout=0"), post("/flush_cache?timeout=0.5"))
    )
    retract = answer["meta_info"]
    print(f"in_place: flush {refused}, disk update {loaded}, then the request: "
          f"{in_place['completion_tokens']} tokens, {in_place['finish_reason']}; retract: flush "
          f"{flushed[0]}, waiting flush {waited}, then {retract['completion_tokens']} tokens, "
          f"{retract['finish_reason']}")  # fmt: skip
    assert refused == (400, "Flush cache failed.\n")
    assert loaded[0] == 400 and loaded[1]["success"] is False
    assert "Weights were updated, but the cache was not flushed" in loaded[1]["message"]
    assert in_place["finish_reason"]["type"] == "abort" and in_place["completion_tokens"] < 480
    assert flushed[0] == 200 and flushed[1].startswith("Cache flushed.")
    assert waited == (400, "Timed out waiting for idle state.")
    assert retract["finish_reason"]["type"] == "length" and retract["completion_tokens"] == 480


def test_r3_through_the_real_router_reaches_the_worker(server, hf_config, tmp_path):
    """sglang-router 0.3.2 drops ``return_routed_experts`` (seen here at a recording worker in
    ``test_real_router.py``): R3 generation goes to the workers, the rest through the router."""
    router = real.start_router([server.url], log_path=tmp_path / "router.log")
    try:
        router.wait_ready(timeout_s=120)
        with client_for(server, hf_config, router_url=router.url) as client:
            samples = client.generate(PROMPTS, PARAMS, n=2, return_routed_experts=True)
            assert all(s.routes is not None for s in samples)
            assert len(client.generate(PROMPTS, PARAMS, n=2)) == len(PROMPTS) * 2
    finally:
        router.stop()


@pytest.mark.slow
@pytest.mark.hardware_sensitive
def test_the_trainer_learns_against_the_real_server_with_r3(server, tmp_path):
    """The real CLI (``python -m megatron_rl.train``) with ``--rollout-engine sglang``, R3 and the
    ``distributed`` transport over gloo: the engine's routes replayed in megatron, every step's
    weights synced inside a session, and the built-in task's accuracy rises. Reports the
    train/rollout log-prob gap and routing agreement that SGLang's CPU path gives (bf16) against
    megatron (fp32): a real mismatch, not one made for the test. The held-out evaluation
    (before the first step and every 10) generates on the same server between steps."""
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "megatron_rl.train", "--run-dir", str(run_dir), "--device", "cpu",
        "--no-progress", "--rollout-engine", "sglang", "--sglang-url", server.url,
        "--sglang-return-routed-experts", "--routing-replay", "r3",
        "--weight-sync-transport", "distributed", "--train-iters", str(LEARN_STEPS),
        "--torch-threads", "1", "--eval-interval", "10", "--eval-before-train",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    evaluated = [r for r in rows if "eval/mean@8" in r]
    assert [r["step"] for r in evaluated] == list(range(0, LEARN_STEPS + 1, 10))
    assert all(0 <= r["eval/mean@8"] <= r["eval/pass@8"] <= 1 for r in evaluated)
    assert all(r["eval/aborted"] == 0 and r["eval/builtin/response_length"] > 0 for r in evaluated)
    rows = [r for r in rows if "accuracy" in r]  # the training steps (not the step-0 evaluation)
    assert len(rows) == LEARN_STEPS
    first = sum(r["accuracy"] for r in rows[:5]) / 5
    last = sum(r["accuracy"] for r in rows[-5:]) / 5
    gap = sorted(r["mismatch/train_rollout_logprob_abs_gap"] for r in rows)[len(rows) // 2]
    agreements = sorted(r["routing/agreement/behaviour"] for r in rows)
    median_agreement, lowest_agreement = agreements[len(rows) // 2], agreements[0]
    print(
        f"real SGLang + R3: accuracy {first:.2f} -> {last:.2f}; median |train - rollout| "
        f"log-prob gap {gap:.2e}; behaviour routing agreement median {median_agreement:.4f}, "
        f"lowest {lowest_agreement:.4f}; held-out mean@8 "
        + " ".join(f"{r['eval/mean@8']:.2f}" for r in evaluated)
    )
    assert last >= first + 0.3, (first, last)
    # bf16 engine against fp32 trainer: measured medians 0.98-0.99 and single steps down to 0.92
    # (near-tied router logits flip). Routes aligned to the wrong tokens would agree on about
    # top-k / experts = 2 / 8 of their choices, far below either bound.
    assert gap < 0.05, gap
    assert median_agreement > 0.9 and lowest_agreement > 0.75, agreements
    assert all(r["rollout/aborted"] == 0 for r in rows)


def test_the_trainer_renormalises_on_the_real_servers_supports(server, tmp_path):
    """The real CLI with ``--logprobs-on-sampling-support`` against the real server: the
    trainer's old log-probs on the server's recorded supports match the server's renormalised
    ones to the bf16 engine's gap (on the full vocabulary they would be nats apart)."""
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "megatron_rl.train", "--run-dir", str(run_dir), "--device", "cpu",
        "--no-progress", "--rollout-engine", "sglang", "--sglang-url", server.url,
        "--weight-sync-transport", "distributed", "--train-iters", "2", "--torch-threads", "1",
        "--top-k", "4", "--top-p", "0.7", "--logprobs-on-sampling-support",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    rows = [r for r in rows if "mismatch/train_rollout_logprob_abs_gap" in r]
    assert len(rows) == 2
    for r in rows:
        assert r["mismatch/train_rollout_logprob_abs_gap"] < 0.05, r
        assert r["rollout/aborted"] == 0


def _confident(hf_config, seed: int):
    """A model of the server's shape with its output layer scaled 8x (peaked distributions)."""
    model = perturbed(hf_config, seed=seed)
    with torch.no_grad():
        model.lm_head.weight.mul_(8.0)
    return model


def test_the_server_scores_a_teachers_log_probs(server, hf_config):
    """``--loss-teacher sglang:URL``: one batched ``/generate`` with ``max_new_tokens = 0`` gives
    every token's log-prob as an fp32 forward of the served weights does (bf16 server)."""
    model = perturbed(hf_config, seed=31)
    with client_for(server, hf_config) as client:
        client.update_weights(model.named_parameters(), version=client.health().weight_version + 1)
    teacher = Teacher(TeacherConfig(loss_teacher=f"sglang:{server.url}"), vocab_size=16)
    sequences = [SEQUENCE, PROMPTS[2], [3, 9]]
    for ids, got in zip(sequences, teacher.score(sequences), strict=True):
        want = direct_logprobs(model, ids[:1], ids[1:])
        assert got.shape == want.shape
        torch.testing.assert_close(got, want, atol=BF16_LOGPROB_ATOL, rtol=0)


def test_the_server_gives_a_teachers_top_k(server, hf_config):
    """``--teacher-topk 5`` against the server: ``top_logprobs_num`` over the input gives, per
    position, 5 candidates that are an fp32 forward's top 5 up to bf16 rounding (a near tie may
    swap which of two ids is 5th), their log-probs as the forward's, and the sampled token's."""
    model = perturbed(hf_config, seed=32)
    with client_for(server, hf_config) as client:
        client.update_weights(model.named_parameters(), version=client.health().weight_version + 1)
    config = TeacherConfig(loss_teacher=f"sglang:{server.url}", teacher_topk=5)
    teacher = Teacher(config, vocab_size=16)
    sequences = [SEQUENCE, PROMPTS[2], [3, 9]]
    for ids, (sampled, values, top) in zip(
        sequences, teacher.score_topk(sequences, 5), strict=True
    ):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([ids])).logits[0, :-1].float()
        logp = torch.log_softmax(logits, dim=-1)
        assert values.shape == top.shape == (len(ids) - 1, 5) and (top >= 0).all()
        torch.testing.assert_close(
            values, logp.gather(-1, top.long()), atol=BF16_LOGPROB_ATOL, rtol=0
        )
        fifth = logp.topk(5, dim=-1).values[:, -1:]
        assert (logp.gather(-1, top.long()) >= fifth - 2 * BF16_LOGPROB_ATOL).all()
        want = logp.gather(-1, torch.tensor(ids[1:])[:, None]).squeeze(-1)
        torch.testing.assert_close(sampled, want, atol=BF16_LOGPROB_ATOL, rtol=0)


@pytest.mark.hardware_sensitive  # a learning verdict
@pytest.mark.parametrize("topk", [None, "16"])
def test_distillation_from_a_teacher_on_the_real_server(server, hf_config, tmp_path, topk):
    """The real CLI (in-process student engine) distilling from the real server holding a
    confident teacher: pure distillation brings the sampled reverse KL well down, with the
    sampled token's KL as the advantage and with the exact KL over the server's top 16 (the
    whole vocabulary) as a loss term."""
    model = _confident(hf_config, seed=33)
    with client_for(server, hf_config) as client:
        client.update_weights(model.named_parameters(), version=client.health().weight_version + 1)
    run_dir = tmp_path / "run"
    command = [
        sys.executable, "-m", "megatron_rl.train", "--run-dir", str(run_dir), "--device", "cpu",
        "--no-progress", "--train-iters", "12", "--torch-threads", "1", "--seed", "1",
        "--loss-teacher", f"sglang:{server.url}", "--teacher-task-weight", "0",
    ]  # fmt: skip
    command += ["--teacher-topk", topk] if topk else []
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    kl = [r["teacher/reverse_kl_k1"] for r in rows if "teacher/reverse_kl_k1" in r]
    start, end = sum(kl[:3]) / 3, sum(kl[-3:]) / 3
    print(f"distillation from the real server (top-K {topk}): reverse KL {start:.3f} -> {end:.3f}")
    assert len(kl) == 12 and start > 0.5 and end < 0.6 * start, kl


@pytest.mark.slow
def test_partial_rollouts_and_carried_groups_through_the_real_cli_and_server(server, tmp_path):
    """The real CLI against the real server with everything that makes a sample span weight
    versions: ``--async-rollout --max-staleness 2``, ``--partial-rollout`` (the sync pauses the
    server with ``retract``) and ``--carry-over-groups`` (unfinished samples go on at the next
    rollout as new requests of prompt + response so far), under R3. The engine's log-probs and
    routes of continued samples stay aligned with megatron's over the whole sequence (within
    bf16 noise plus staleness), and no request is aborted."""
    run_dir = tmp_path / "run"
    steps = 12
    command = [
        sys.executable, "-m", "megatron_rl.train", "--run-dir", str(run_dir), "--device", "cpu",
        "--no-progress", "--rollout-engine", "sglang", "--sglang-url", server.url,
        "--sglang-return-routed-experts", "--routing-replay", "r3",
        "--weight-sync-transport", "distributed", "--train-iters", str(steps),
        "--torch-threads", "1", "--async-rollout", "--max-staleness", "2", "--partial-rollout",
        "--sglang-pause-mode", "retract", "--carry-over-groups", "4",
        "--carry-over-round-tokens", "2", "--max-response-length", "8",
        "--behavior-logprobs", "rollout", "--mask-stale-tokens",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert len(rows) == steps
    spanning = sum(r["carry_over/spanning_samples"] for r in rows)
    carried = sum(r["carry_over/taken_from_earlier"] for r in rows)
    multi = max(r["staleness/multi_version_sample_frac"] for r in rows)
    masked = max(r["staleness/masked_token_frac"] for r in rows)
    gap = sorted(r["mismatch/train_rollout_logprob_abs_gap"] for r in rows)[steps // 2]
    agreement = sorted(r["routing/agreement/behaviour"] for r in rows)[steps // 2]
    print(
        f"real SGLang, partial + carry-over: {spanning:.0f} samples spanning versions, "
        f"{carried:.0f} carried groups trained, multi-version share up to {multi:.2f}, "
        f"tokens masked as older than K up to {masked:.2f}, median "
        f"rounds {sorted(r['carry_over/rounds'] for r in rows)[steps // 2]:.0f}, median "
        f"|train - rollout| {gap:.2e}, routing agreement {agreement:.4f}"
    )
    assert spanning > 0 and carried > 0 and multi > 0
    assert all(r["carry_over/carried_groups"] == 4 for r in rows)
    assert all(r["rollout/aborted"] == 0 for r in rows)
    # measured: gap 9.7e-2 / 1.06e-1, agreement 0.593 / 0.606 (two runs), below the synchronous
    # run's (< 0.05, > 0.9) because the engine's tokens and routes here are older than the trainer's
    # weights: since the async schedule is fixed by the step (train/rollouts/async_rollout.py),
    # every batch is K = 2 versions behind in the steady state (before, a thread that picked its job
    # up late made some batches fresher: gap 5.5e-2, agreement 0.84); log-probs or routes shifted by
    # one token would be off by nats and agree on about top-k / experts = 2 / 8 of the choices, far
    # below 0.45
    assert gap < 0.15 and agreement > 0.45, (gap, agreement)


@pytest.mark.slow
@pytest.mark.distributed
def test_each_pipeline_stage_sends_its_own_weights_to_the_real_server(server, tmp_path):
    """The real CLI under torchrun with pipeline parallelism (2 gloo ranks, one layer each):
    SGLang takes each stage's buckets over a weight group of that stage's own (two named groups
    per server, each broadcast from its stage's first rank), inside the update session, and
    generation uses the result: the train/rollout log-prob gap stays at the bf16 level of the
    single-sender runs (a stage's tensors missing after a step would widen it)."""
    run_dir = tmp_path / "run"
    steps = 3
    command = [
        *torchrun(2), "-m", "megatron_rl.train",
        "--run-dir", str(run_dir), "--device", "cpu", "--no-progress",
        "--rollout-engine", "sglang", "--sglang-url", server.url,
        "--weight-sync-transport", "distributed", "--pipeline-model-parallel-size", "2",
        "--train-iters", str(steps), "--torch-threads", "1", "--lr", "1e-3",
    ]  # fmt: skip
    result = subprocess.run(command, cwd=ROOT, capture_output=True, text=True, timeout=1800)
    assert result.returncode == 0, result.stderr[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert len(rows) == steps
    stage_mb = [rows[-1][f"weight_sync/stage_mb/{s}"] for s in (0, 1)]
    gaps = [r["mismatch/train_rollout_logprob_abs_gap"] for r in rows]
    _, info = real.request(server.url, "GET", "/model_info")
    print(f"real SGLang, PP2 per-stage senders: stage MB {stage_mb}, log-prob gaps {gaps}")
    assert all(mb > 0 for mb in stage_mb)
    assert str(info["weight_version"]) == str(steps)
    assert max(gaps) < 0.05, gaps


@pytest.mark.slow
def test_a_colocated_run_hands_the_real_servers_memory_back_and_forth(server, tmp_path):
    """The real CLI with ``--colocate`` against the real server: its
    ``/release_memory_occupation`` and ``/resume_memory_occupation`` take every call of the
    hand-over (SGLang's scheduler asserts an idle server on release and dies on a resume of a
    tag not released: either would end this server), weights go by the ``tensor`` transport
    inside a session, and the run leaves the server with its KV cache and CUDA graphs released
    (resumed here: a resume of anything else would end it), generating. On CPU the
    server's memory saver is off, so nothing is freed there: the calls and their order are what
    this run checks, the trainer's side is accounted by ``colocate/*``."""
    run_dir = tmp_path / "run"
    steps = 3
    command = [
        sys.executable, "-m", "megatron_rl.train", "--run-dir", str(run_dir), "--device", "cpu",
        "--no-progress", "--rollout-engine", "sglang", "--sglang-url", server.url,
        "--weight-sync-transport", "tensor", "--colocate", "--train-iters", str(steps),
        "--torch-threads", "1",
    ]  # fmt: skip
    log = tmp_path / "run.log"
    with log.open("w") as out:  # not a pipe: torch's shared-memory manager outlives the run
        code = subprocess.run(command, cwd=ROOT, stdout=out, stderr=out, timeout=1800).returncode
    assert code == 0, log.read_text()[-4000:]
    rows = [json.loads(line) for line in (run_dir / "metrics.jsonl").open()]
    assert len(rows) == steps
    gaps = [r["mismatch/train_rollout_logprob_abs_gap"] for r in rows]
    print(f"real SGLang, colocated: log-prob gaps {gaps}")
    assert all(r["colocate/trainer_resident_bytes_during_rollout"] == 0 for r in rows)
    assert max(gaps) < 0.05, gaps
    tags = {"tags": ["kv_cache", "cuda_graph"]}  # what the run left released, nothing else
    status, answer = real.request(server.url, "POST", "/resume_memory_occupation", tags)
    assert status == 200, answer
    status, answer = real.request(
        server.url,
        "POST",
        "/generate",
        {"input_ids": PROMPTS[0], "sampling_params": {"max_new_tokens": 2}},
    )
    assert status == 200 and answer["meta_info"]["completion_tokens"] == 2, answer
