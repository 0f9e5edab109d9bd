"""The SGLang HTTP client over real loopback HTTP, against servers that fail on purpose.

What this proves: the client's retry, failover, timeout and bounded-concurrency behaviour, its
decoding and checking of SGLang-shaped answers (``output_ids``, ``meta_info`` with
``output_token_logprobs``, ``finish_reason``, ``weight_version``, base64 int32
``routed_experts``), and that it returns exactly what the in-process engine returns. What it does
not prove: that a real SGLang server answers in exactly this shape (the loopback server is
written from SGLang's ``io_struct.py`` field names, checked below and in
``test_sglang_contract_payload.py`` against the pinned SGLang's source), nor SGLang's own
sampling numerics.
"""

from __future__ import annotations

import base64
import threading
import time

import pytest
import torch
from rollout_testing import PROMPTS, tiny_config

from megatron_rl.rollout import RolloutEngine, SamplingParams
from megatron_rl.rollout.http_pool import HttpPool, HttpPoolConfig, NoHealthyServerError
from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig
from megatron_rl.rollout.sglang_payload import (
    GENERATE_FIELDS,
    SAMPLING_FIELDS,
    SEED_FIELD,
    decode_generate,
    generate_request,
)
from megatron_rl.routing import RoutingCodec

PARAMS = SamplingParams(max_new_tokens=4, seed=21)
N = 2


def client_for(servers, **http) -> SGLangEngine:
    http = {"request_timeout_s": 3.0, "backoff_s": 0.01, "down_s": 0.3, **http}
    config = SGLangEngineConfig.from_hf_config(
        tiny_config(), http=HttpPoolConfig(urls=tuple(s.url for s in servers), **http)
    )
    return SGLangEngine(config)


def assert_same_samples(got, want):
    assert [(s.prompt_index, s.sample_index) for s in got] == [
        (s.prompt_index, s.sample_index) for s in want
    ]
    for g, w in zip(got, want, strict=True):
        assert g.response_ids_R.tolist() == w.response_ids_R.tolist()
        torch.testing.assert_close(g.logprobs_R, w.logprobs_R, atol=1e-5, rtol=0)
        assert g.finish_reason == w.finish_reason and g.weight_version == w.weight_version
        if w.routes is not None:
            assert torch.equal(g.routes.data, w.routes.data)


@pytest.mark.slow
def test_http_client_returns_what_the_in_process_engine_returns(servers, shared_engine):
    (server,) = servers(1)
    with client_for([server]) as client:
        assert isinstance(client, RolloutEngine)
        got = client.generate(PROMPTS, PARAMS, n=N, return_routed_experts=True)
        assert client.health().healthy and client.health().weight_version == 0
        torch.testing.assert_close(client.score(PROMPTS[2]), shared_engine.score(PROMPTS[2]))
    want = shared_engine.generate(PROMPTS, PARAMS, n=N, return_routed_experts=True)
    assert_same_samples(got, want)
    assert got[0].routes.data.dtype == torch.uint8


def _fail_first(counts: dict, faults: list[str]):
    lock = threading.Lock()

    def before(path, payload):
        if path != "/generate":
            return None
        with lock:
            counts["n"] = counts.get("n", 0) + 1
            return faults[counts["n"] - 1] if counts["n"] <= len(faults) else None

    return before


@pytest.mark.parametrize("faults", [["503", "503"], ["drop"], ["503", "drop", "503"]])
def test_503_and_dropped_connections_are_retried_without_loss_or_duplicates(
    servers, shared_engine, faults
):
    (server,) = servers(1)
    server.before_request = _fail_first({}, faults)
    with client_for([server], down_s=0.0) as client:
        got = client.generate(PROMPTS, PARAMS, n=N)
        assert client.pool.retries == len(faults)
    assert_same_samples(got, shared_engine.generate(PROMPTS, PARAMS, n=N))


def test_failover_to_the_healthy_server(servers, shared_engine):
    bad, good = servers(2)
    bad.before_request = lambda path, payload: "503" if path == "/generate" else None
    with client_for([bad, good], down_s=60.0) as client:  # stays down however slow the machine
        got = client.generate(PROMPTS, PARAMS, n=N)
        assert client.pool.healthy_urls() == [good.url]
    assert_same_samples(got, shared_engine.generate(PROMPTS, PARAMS, n=N))
    assert good.requests.count("/generate") == len(PROMPTS) * N


def test_a_stalled_server_times_out_and_the_request_fails_over(servers, shared_engine):
    stalled, good = servers(2)
    stalled.stall_s = 60.0
    stalled.before_request = lambda path, payload: "stall" if path == "/generate" else None
    start = time.monotonic()
    with client_for([stalled, good], request_timeout_s=1.0) as client:
        got = client.generate(PROMPTS, PARAMS, n=N)
    assert time.monotonic() - start < 45.0  # the stall lasts 60 s
    assert_same_samples(got, shared_engine.generate(PROMPTS, PARAMS, n=N))


def test_a_server_dying_mid_batch_loses_no_sample(servers, shared_engine):
    dying, good = servers(2)
    dying.before_request = _fail_first({}, [None, None, "die"])
    with client_for([dying, good], max_attempts=3) as client:
        got = client.generate(PROMPTS, PARAMS, n=N)
    assert_same_samples(got, shared_engine.generate(PROMPTS, PARAMS, n=N))
    assert not client.health().detail.startswith("2/2")


def test_no_healthy_server_is_an_error_not_a_hang(servers):
    (server,) = servers(1)
    server.before_request = lambda path, payload: "503"
    start = time.monotonic()
    with client_for([server], max_attempts=3) as client:
        with pytest.raises(NoHealthyServerError, match=r"sample \(prompt 0, sample 0\)|healthy"):
            client.generate(PROMPTS, PARAMS, n=N)
        assert not client.health().healthy
    server.stop()
    with client_for([server], max_attempts=2) as client, pytest.raises(NoHealthyServerError):
        client.generate(PROMPTS[:1], PARAMS)
    assert time.monotonic() - start < 10.0


def test_in_flight_requests_are_bounded(servers):
    (server,) = servers(1)
    active, peak, lock = [0], [0], threading.Lock()
    original = server.handle

    def counting(path, payload):
        with lock:
            active[0] += 1
            peak[0] = max(peak[0], active[0])
        try:
            time.sleep(0.05)
            return original(path, payload)
        finally:
            with lock:
                active[0] -= 1

    server.handle = counting
    config = SGLangEngineConfig.from_hf_config(
        tiny_config(), http=HttpPoolConfig(urls=(server.url,)), max_in_flight=2
    )
    with SGLangEngine(config) as client:
        assert len(client.generate(PROMPTS, PARAMS, n=N)) == len(PROMPTS) * N
    assert peak[0] == 2


def test_client_errors_are_not_retried(servers):
    (server,) = servers(1)
    pool = HttpPool(HttpPoolConfig(urls=(server.url,)))
    with pytest.raises(RuntimeError, match="HTTP 404"):
        pool.post("/no_such_endpoint", {})
    assert pool.retries == 0


def test_a_bad_answer_names_the_sample_end_to_end(servers):
    (server,) = servers(1)
    original = server.handle

    def corrupt(path, payload):
        status, body = original(path, payload)
        if path == "/generate" and payload["input_ids"] == PROMPTS[1]:
            body["meta_info"]["output_token_logprobs"][1][0] = float("nan")
        return status, body

    server.handle = corrupt
    with client_for([server]) as client, pytest.raises(RuntimeError, match="prompt 1, sample"):
        client.generate(PROMPTS, PARAMS, n=N)


def _answer(num_prompt: int, num_out: int, layers=2, topk=2) -> dict:
    routes = torch.tensor([[0, 1], [2, 3]], dtype=torch.int32).repeat(num_prompt + num_out - 1, 1)
    routes = routes[: (num_prompt + num_out - 1) * layers].reshape(-1, layers, topk)
    return {
        "output_ids": list(range(10, 10 + num_out)),
        "meta_info": {
            "finish_reason": {"type": "length"},
            "weight_version": "3",
            "output_token_logprobs": [[-1.0, 10 + k, None] for k in range(num_out)],
            "routed_experts": base64.b64encode(routes.numpy().tobytes()).decode(),
        },
    }


def _decode(body, prompt=(1, 2, 3)):
    return decode_generate(
        body, prompt=list(prompt), prompt_index=3, sample_index=1,
        codec=RoutingCodec(8, 2), layer_pattern=(1, 1),
    )  # fmt: skip


def test_decoding_a_good_answer():
    sample = _decode(_answer(3, 4))
    assert sample.weight_version == 3 and sample.routes.num_tokens == 6
    assert RoutingCodec(8, 2).decode(sample.routes)[0].tolist() == [[0, 1], [2, 3]]


def _break(mutate):
    body = _answer(3, 4)
    mutate(body)
    return body


@pytest.mark.parametrize(
    "mutate,match",
    [
        (lambda b: b.pop("output_ids"), "no output_ids"),
        (lambda b: b.pop("meta_info"), "no meta_info"),
        (lambda b: b["meta_info"]["output_token_logprobs"].pop(), "3 output_token_logprobs"),
        (lambda b: b["meta_info"]["output_token_logprobs"][2].__setitem__(0, float("inf")), "inf"),
        (lambda b: b["meta_info"]["output_token_logprobs"][0].__setitem__(0, None), "None"),
        (lambda b: b["meta_info"].pop("routed_experts"), "routed_experts missing"),
        (lambda b: b["output_ids"].append(99), "output_token_logprobs for 5"),
        (lambda b: b["meta_info"].__setitem__("weight_version", "v?"), "weight_version"),
        (lambda b: b["meta_info"]["output_token_logprobs"][1].__setitem__(1, 7), "for token 7"),
    ],
)
def test_bad_answers_name_the_sample(mutate, match):
    with pytest.raises(RuntimeError, match=f"prompt 3, sample 1.*{match}"):
        _decode(_break(mutate))


def test_wrong_routed_expert_shapes_and_values_name_the_sample():
    body = _answer(3, 4)
    short = torch.zeros(5, 2, 2, dtype=torch.int32)  # one row short of 3 + 4 - 1
    body["meta_info"]["routed_experts"] = base64.b64encode(short.numpy().tobytes()).decode()
    with pytest.raises(RuntimeError, match=r"prompt 3, sample 1.*expected 6 rows"):
        _decode(body)
    out_of_range = torch.tensor([[[0, 9], [1, 2]]] * 6, dtype=torch.int32)
    body["meta_info"]["routed_experts"] = base64.b64encode(out_of_range.numpy().tobytes()).decode()
    with pytest.raises(RuntimeError, match=r"prompt 3, sample 1.*expert 9"):
        _decode(body)


def test_request_payload_uses_sglang_field_names():
    payload = generate_request(
        [1, 2], PARAMS, prompt_index=0, sample_index=1, rid="r", return_routed_experts=True
    )
    assert set(payload) <= set(GENERATE_FIELDS)
    assert set(payload["sampling_params"]) <= {*SAMPLING_FIELDS, SEED_FIELD}
    assert payload["sampling_params"]["n"] == 1


def test_field_names_match_sglang_dataclasses():
    """Read from the pinned SGLang's source (`sglang_source`), not imported: runs in CI."""
    from sglang_source import dataclass_fields

    io_struct = "srt/managers/io_struct.py"
    assert set(GENERATE_FIELDS) <= set(dataclass_fields(io_struct, "GenerateReqInput"))
    sampling_fields = set(dataclass_fields("srt/sampling/sampling_params.py", "SamplingParams"))
    assert {*SAMPLING_FIELDS, SEED_FIELD} <= sampling_fields
    for name, fields in [
        ("UpdateWeightsFromDistributedReqInput", {"names", "dtypes", "shapes", "group_name"}),
        ("InitWeightsUpdateGroupReqInput", {"master_address", "master_port", "rank_offset"}),
        ("UpdateWeightsFromTensorReqInput", {"serialized_named_tensors", "load_format"}),
        ("UpdateWeightFromDiskReqInput", {"model_path", "load_format"}),
        ("UpdateWeightVersionReqInput", {"new_version"}),
    ]:
        assert fields <= set(dataclass_fields(io_struct, name)), name


def test_a_read_timeout_does_not_mark_the_server_down_and_aborts_the_request(servers):
    (server,) = servers(1)
    server.stall_s = 600.0  # far beyond the wait below: only the abort can end it in time
    server.before_request = _fail_first({}, ["stall"])
    assert HttpPoolConfig(urls=(server.url,)).request_timeout_s is None  # default: no timeout
    with client_for([server], request_timeout_s=1.0, down_s=60.0) as client:
        got = client.generate(PROMPTS[:1], PARAMS)
        assert client.pool.healthy_urls() == [server.url]  # busy is not down
    assert len(got) == 1 and client.pool.retries == 1
    assert [set(a) for a in server.aborts] == [{"rid"}]  # the timed-out request, by its rid
    # the stalled request ends (aborted) rather than running on: its handler thread leaves
    # `_running` once it wakes, which a loaded machine may delay (CI saw it still there at once)
    with server._state:
        ended = server._state.wait_for(lambda: not server._running, timeout=120.0)
    assert ended, server._running


def test_sglang_request_timeout_flag_reaches_the_pool():
    from megatron_rl.rollout.build import build_engine
    from megatron_rl.train.config import parse_args

    argv = ["--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:1"]
    assert parse_args(argv).engine.sglang_request_timeout is None
    config = parse_args([*argv, "--sglang-request-timeout", "7200"]).engine
    with build_engine(config, tiny_config(), pad_token_id=0, seed=0) as engine:
        assert engine.pool.config.request_timeout_s == 7200.0


def test_a_failed_batch_aborts_what_it_already_sent(servers):
    (server,) = servers(1)
    server.stall_s = 60.0
    original = server.handle

    def reject_prompt_1(path, payload):
        if path == "/generate" and payload["input_ids"] == PROMPTS[1]:
            return 400, {"error": "rejected"}
        return original(path, payload)

    server.handle = reject_prompt_1

    def stall_prompt_0(path, payload):
        return "stall" if payload and payload.get("input_ids") == PROMPTS[0] else None

    server.before_request = stall_prompt_0
    start = time.monotonic()
    with client_for([server]) as client, pytest.raises(RuntimeError, match="HTTP 400"):
        client.generate(PROMPTS, PARAMS, n=N)
    assert {"abort_all": True} in server.aborts
    deadline = time.monotonic() + 10.0
    while server._running and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not server._running and time.monotonic() - start < 30.0  # the 60 s stalls ended


# sglang-router 0.3.2's routes (sglang-api.md); the real binary is tested in test_real_router.py
ROUTER_ROUTES = {"/generate", "/health", "/health_generate", "/flush_cache", "/get_model_info"}


@pytest.mark.slow
def test_generation_goes_through_the_router_and_control_calls_to_the_workers(servers):
    worker, router = servers(2)
    original = router.handle
    router.handle = lambda path, payload: (
        original(path, payload) if path in ROUTER_ROUTES else (404, {"detail": "Not Found"})
    )
    config = SGLangEngineConfig.from_hf_config(
        tiny_config(),
        http=HttpPoolConfig(urls=(worker.url,), backoff_s=0.01),
        router_url=router.url,
    )
    with SGLangEngine(config) as client:
        assert len(client.generate(PROMPTS, PARAMS, n=N)) == len(PROMPTS) * N
        client.flush_cache()
        assert client.health().healthy
        assert client.weight_sync.urls == (worker.url,)  # the router is no weight-group member
    assert router.requests.count("/generate") == len(PROMPTS) * N
    assert "/generate" not in worker.requests
    assert "/flush_cache" in worker.requests and "/model_info" in worker.requests
    assert not set(router.requests) - ROUTER_ROUTES


def test_r3_generation_bypasses_the_router_which_drops_routed_experts(servers):
    """The real router forwards no ``return_routed_experts`` (test_real_router.py): samples that
    need routes go to the workers, the others through the router."""
    worker, router = servers(2)
    config = SGLangEngineConfig.from_hf_config(
        tiny_config(),
        http=HttpPoolConfig(urls=(worker.url,), backoff_s=0.01),
        router_url=router.url,
    )
    with SGLangEngine(config) as client:
        samples = client.generate(PROMPTS, PARAMS, n=N, return_routed_experts=True)
        assert all(s.routes is not None for s in samples)
        assert worker.requests.count("/generate") == len(PROMPTS) * N
        assert "/generate" not in router.requests
        client.generate(PROMPTS, PARAMS, n=N)
        assert router.requests.count("/generate") == len(PROMPTS) * N
    with pytest.raises(ValueError, match="both router_url and a worker URL"):
        SGLangEngineConfig.from_hf_config(
            tiny_config(), http=HttpPoolConfig(urls=(worker.url,)), router_url=worker.url
        )


def test_aborted_samples_are_generated_again_and_counted(servers):
    """An ``abort_all`` mid-batch (another generator on the same servers, a pause in abort
    mode) ends requests with HTTP 200 and ``finish_reason`` abort: those samples are generated
    again, never returned, and counted (``rollout/aborted``)."""
    (server,) = servers(1)
    stalled = []

    def stall_two(path, payload):
        if path == "/generate" and len(stalled) < 2:
            stalled.append(payload["rid"])
            return "stall"
        return None

    server.before_request = stall_two
    server.stall_s = 600.0  # the stalled pair waits for the abort, however loaded the machine

    def abort_once_both_stall():  # no timer decides it: the abort comes once both are running
        while True:
            with server._state:
                running = list(server._running.values())
            if sum(rid in stalled for rid in running) >= 2:
                break
            time.sleep(0.01)
        server.handle("/abort_request", {"abort_all": True})

    aborter = threading.Thread(target=abort_once_both_stall, daemon=True)
    aborter.start()
    with client_for([server], request_timeout_s=600.0) as client:
        samples = client.generate(PROMPTS, PARAMS, n=N)
        assert client.take_aborted() == 2 and client.take_aborted() == 0
    aborter.join()
    assert len(samples) == len(PROMPTS) * N
    assert all(s.finish_reason != "abort" for s in samples)
    assert server.requests.count("/generate") == len(PROMPTS) * N + 2


def test_a_partial_aborted_answer_is_not_trained_on(servers):
    """SGLang returns the tokens generated before the abort; the client must not keep them."""
    (server,) = servers(1)
    original, answered = server.handle, []

    def partial_abort_once(path, payload):
        status, body = original(path, payload)
        if path == "/generate" and not answered:
            answered.append(body)
            body["meta_info"]["finish_reason"] = {"type": "abort", "message": "Aborted"}
        return status, body

    server.handle = partial_abort_once
    with client_for([server]) as client:
        samples = client.generate(PROMPTS[:1], PARAMS, n=1)
        assert client.take_aborted() == 1
    assert samples[0].finish_reason != "abort" and answered[0]["output_ids"]


def test_a_sample_aborted_every_time_fails_naming_the_option(servers):
    (server,) = servers(1)
    server.before_request = lambda path, payload: "stall" if path == "/generate" else None
    server.stall_s = 0.0  # each stalled request ends at once as if aborted in the queue
    original_stalled = server._stalled
    server._stalled = lambda key: original_stalled(key) or True
    config = SGLangEngineConfig.from_hf_config(
        tiny_config(), http=HttpPoolConfig(urls=(server.url,), backoff_s=0.01), max_abort_retries=2
    )
    with SGLangEngine(config) as client, pytest.raises(RuntimeError, match="max_abort_retries"):
        client.generate(PROMPTS[:1], PARAMS, n=1)
    assert server.requests.count("/generate") == 3


@pytest.mark.parametrize(
    ("preset", "experts", "pattern"),
    [("tiny", 8, (1, 1)), ("tiny-glm", 16, (0, 0, 1, 1)), ("tiny-deepseek", 8, None)],
)
def test_client_config_reads_every_family_s_expert_count(preset, experts, pattern):
    """Qwen3-MoE names it ``num_experts``, GLM-4.5 and DeepSeek-V3 ``n_routed_experts``: the
    client takes either (GLM's and DeepSeek's launchers stopped at start-up on
    ``hf_config.num_experts`` before)."""
    from megatron_rl.model import preset_config

    http = HttpPoolConfig(urls=("http://h:1",))
    config = SGLangEngineConfig.from_hf_config(preset_config(preset), http=http)
    assert config.num_experts == experts
    if pattern is not None:
        assert config.layer_pattern == pattern


def test_the_health_timeout_flag_reaches_the_pool_and_is_checked():
    """``--sglang-health-timeout`` bounds every /health probe and /server_info answer (in the
    launcher rehearsal a loaded server answered /server_info after more than the 30-s
    default); it must exceed SGLang's own 20-s health check."""
    from megatron_rl.rollout.build import build_engine
    from megatron_rl.train.config import parse_args

    argv = ["--rollout-engine", "sglang", "--sglang-url", "http://127.0.0.1:1"]
    assert parse_args(argv).engine.sglang_health_timeout == 30.0
    config = parse_args([*argv, "--sglang-health-timeout", "120"]).engine
    with build_engine(config, tiny_config(), pad_token_id=0, seed=0) as engine:
        assert engine.workers.config.health_timeout_s == 120.0
    with pytest.raises(ValueError, match=r"--sglang-health-timeout=5\.0: must be > 20 seconds"):
        parse_args([*argv, "--sglang-health-timeout", "5"])
