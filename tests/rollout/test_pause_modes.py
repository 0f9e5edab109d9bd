"""Pausing generation at a weight update (partial rollouts), in SGLang's three modes.

The in-process engine (`InProcessEngine.pause` / ``resume``), the loopback server's
``/pause_generation`` over HTTP, and the SGLang client's weight sync with
``WeightSyncConfig.pause_mode``. A generation is paused at an exact token (a forward hook starts
the pause after the k-th forward and waits until it is set, so the call stops at the boundary
after token k), the weights are updated, and it is resumed: the sample completes, its
``weight_versions`` name both versions at token k, and its log-probs after k come from the new
weights over a recomputed KV cache (``retract``) or over the KV cache the old weights computed
(``in_place``), as SGLang documents the two modes (``PauseGenerationReqInput``).
"""

from __future__ import annotations

import dataclasses
import inspect
import threading

import pytest
import torch
from rollout_testing import (
    checkpoint_tensors,
    direct_logprobs,
    direct_routes,
    make_engine,
    random_hf_model,
    tiny_config,
    wait_for,
)
from sglang_source import class_node, load_function
from transformers import DynamicCache

from megatron_rl.rollout import InProcessEngineConfig, SamplingParams
from megatron_rl.rollout.http_pool import HttpPoolConfig, request_json
from megatron_rl.rollout.inprocess import version_spans
from megatron_rl.rollout.sampling import row_seed
from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig
from megatron_rl.rollout.weight_sync import WeightSyncConfig
from megatron_rl.testing.loopback_server import LoopbackServer

PROMPT = [5, 17, 33, 2]
PARAMS = SamplingParams(max_new_tokens=12, seed=11)
AT = 5  # tokens generated when the pause takes effect
LOGPROB_ATOL = 1e-4  # one unpadded forward vs the engine's KV-cached steps (fp32)


@pytest.fixture(scope="module")
def update(tmp_path_factory):
    """The weights pushed during the pause: (HF model, its checkpoint folder, its tensors)."""
    model = random_hf_model(tiny_config(), seed=7)
    folder = tmp_path_factory.mktemp("v1")
    return model, folder, checkpoint_tensors(model, folder)


@pytest.fixture(scope="module")
def reference():
    """Samples of an engine that is never paused (the weights before the update)."""
    engine = make_engine(seed=0)
    return {
        "one": engine.generate([PROMPT], PARAMS)[0],
        "batch": engine.generate([PROMPT, [9, 9, 250, 301]], PARAMS),
    }


class PauseAt:
    """Start ``pause()`` in a thread after the engine's ``at``-th forward (1: the prefill) and
    hold that forward until ``is_set()`` says the pause is seen: the running call then stops at
    the step boundary after token ``at``."""

    def __init__(self, engine, at: int, pause, is_set) -> None:
        self.engine, self.at, self.pause, self.is_set = engine, at, pause, is_set
        self.forwards = 0
        self.thread: threading.Thread | None = None
        self.errors: list[BaseException] = []
        engine.model.register_forward_hook(self._hook)

    def _run(self) -> None:
        try:
            self.pause()
        except BaseException as err:  # surfaced by `join`
            self.errors.append(err)

    def _hook(self, module, args, output) -> None:
        self.forwards += 1
        if self.forwards == self.at and self.thread is None:
            self.thread = threading.Thread(target=self._run, daemon=True)
            self.thread.start()
            wait_for(self.is_set, "the pause to be set")

    def join(self) -> None:
        """Wait for the pause call (the hook keeps counting forwards)."""
        if self.thread is not None:
            self.thread.join()
        if self.errors:
            raise self.errors[0]


class Call(threading.Thread):
    """``fn()`` in a thread; `result` joins it and returns its value (or raises its error)."""

    def __init__(self, fn) -> None:
        super().__init__(daemon=True)
        self.fn, self.value, self.error = fn, None, None
        self.start()

    def run(self) -> None:
        try:
            self.value = self.fn()
        except BaseException as err:
            self.error = err

    def result(self):
        self.join()
        if self.error is not None:
            raise self.error
        return self.value


def _ids(sample) -> list[int]:
    return sample.response_ids_R.tolist()


@torch.no_grad()
def in_place_logprobs(old, new, prompt, response, at: int) -> torch.Tensor:
    """float32 [R - at]: log-probs of ``response[at:]`` decoded by ``new`` over the KV cache
    ``old`` computed for ``prompt + response[: at - 1]`` (what an in-place pause keeps)."""
    kwarg = "cache" if "cache" in inspect.signature(type(old).forward).parameters else None
    kwarg = kwarg or "past_key_values"
    cache = DynamicCache(config=old.config)
    old(input_ids=torch.tensor([prompt + response[: at - 1]]), use_cache=True, **{kwarg: cache})
    logits = new(input_ids=torch.tensor([response[at - 1 : -1]]), use_cache=True, **{kwarg: cache})
    logp = torch.log_softmax(logits.logits[0].float(), dim=-1)
    return logp.gather(-1, torch.tensor(response[at:])[:, None]).squeeze(-1)


# ------------------------------------------------------------------ the in-process engine
def test_a_generation_paused_in_place_without_an_update_is_bit_identical(reference):
    engine = make_engine(seed=0)
    pauser = PauseAt(engine, AT, lambda: engine.pause("in_place"), lambda: engine.paused())
    call = Call(lambda: engine.generate([PROMPT], PARAMS)[0])
    wait_for(lambda: engine.parked() == 1, "the call to park")
    pauser.join()
    engine.resume()
    sample, want = call.result(), reference["one"]
    assert _ids(sample) == _ids(want) and torch.equal(sample.logprobs_R, want.logprobs_R)
    assert sample.weight_versions == ((0, 0, 12),) == want.weight_versions


def test_a_retracted_generation_without_an_update_recomputes_the_same_cache(reference):
    engine = make_engine(seed=0)
    pauser = PauseAt(engine, AT, lambda: engine.pause("retract"), lambda: engine.paused())
    call = Call(lambda: engine.generate([PROMPT], PARAMS)[0])
    wait_for(lambda: engine.parked() == 1, "the call to park")
    pauser.join()
    engine.resume()
    sample, want = call.result(), reference["one"]
    assert pauser.forwards == 12 + 1  # one more forward: the re-prefill of prompt + 4 tokens
    assert _ids(sample) == _ids(want)
    torch.testing.assert_close(sample.logprobs_R, want.logprobs_R, atol=LOGPROB_ATOL, rtol=0)


@pytest.mark.slow
@pytest.mark.parametrize("mode", ["in_place", "retract"])
def test_an_update_during_a_pause_splits_the_versions_at_the_pause(mode, update, reference):
    """The tokens before the pause are the unpaused ones; after it ``retract`` scores with the
    new weights over a recomputed cache, ``in_place`` with the new weights over the old cache;
    each matches its own reference and not the other's."""
    new_model, _, tensors = update
    engine = make_engine(seed=0)
    pauser = PauseAt(engine, AT, lambda: engine.pause(mode), lambda: engine.paused())
    call = Call(lambda: engine.generate([PROMPT], PARAMS, return_routed_experts=True)[0])
    wait_for(lambda: engine.parked() == 1, "the call to park")
    pauser.join()
    engine.update_weights(tensors, version=1)  # runs while the call is parked
    engine.resume()
    sample = call.result()
    assert sample.finish_reason == "length" and sample.response_ids_R.numel() == 12
    assert sample.weight_versions == ((0, 0, AT), (1, AT, 12)) and sample.weight_version == 0
    before = reference["one"]
    assert _ids(sample)[:AT] == _ids(before)[:AT]
    assert torch.equal(sample.logprobs_R[:AT], before.logprobs_R[:AT])
    response = _ids(sample)
    recomputed = direct_logprobs(new_model, PROMPT, response)[AT:]
    kept = in_place_logprobs(random_hf_model(tiny_config(), 0), new_model, PROMPT, response, AT)
    assert (recomputed - kept).abs().max() > 1e-2, "the two modes must be told apart"
    want, other = (recomputed, kept) if mode == "retract" else (kept, recomputed)
    torch.testing.assert_close(sample.logprobs_R[AT:], want, atol=LOGPROB_ATOL, rtol=0)
    assert (sample.logprobs_R[AT:] - other).abs().max() > 1e-2
    routes = engine.codec.decode(sample.routes).sort(-1).values
    new_routes = direct_routes(new_model, PROMPT + response[:-1]).sort(-1).values
    assert routes.shape == new_routes.shape == (len(PROMPT) + 12 - 1, 2, 2)
    if mode == "retract":  # every position re-prefilled or decoded by the new weights
        assert torch.equal(routes, new_routes)
    else:  # the prompt's routes come from the old weights' prefill
        old_routes = direct_routes(random_hf_model(tiny_config(), 0), PROMPT).sort(-1).values
        assert torch.equal(routes[: len(PROMPT)], old_routes)


@pytest.mark.slow
def test_a_row_that_finished_before_the_update_keeps_one_version(update, reference):
    stop = _ids(reference["batch"][0])[1]  # row 0 ends at its second token
    params = dataclasses.replace(PARAMS, stop_token_ids=(stop,))
    unpaused = make_engine(seed=0).generate([PROMPT, [9, 9, 250, 301]], params)
    assert len(_ids(unpaused[0])) == 2 and len(_ids(unpaused[1])) > AT, "pick another stop id"
    engine = make_engine(seed=0)
    pauser = PauseAt(engine, AT, lambda: engine.pause("in_place"), lambda: engine.paused())
    call = Call(lambda: engine.generate([PROMPT, [9, 9, 250, 301]], params))
    wait_for(lambda: engine.parked() == 1, "the call to park")
    pauser.join()
    engine.update_weights(update[2], version=3)
    engine.resume()
    done, running = call.result()
    assert _ids(done) == _ids(unpaused[0]) and done.weight_versions == ((0, 0, 2),)
    assert done.weight_version == 0 and done.finish_reason == "stop"
    (first, second) = running.weight_versions
    assert first == (0, 0, AT) and second == (3, AT, len(_ids(running)))


def test_abort_ends_the_running_rows_with_their_partial_tokens_and_holds_new_calls(reference):
    engine = make_engine(seed=0)
    pauser = PauseAt(engine, AT, lambda: engine.pause("abort"), lambda: engine.paused())
    samples = engine.generate([PROMPT, [9, 9, 250, 301]], PARAMS)
    pauser.join()
    for sample, want in zip(samples, reference["batch"], strict=True):
        assert sample.finish_reason == "abort" and _ids(sample) == _ids(want)[:AT]
        assert torch.equal(sample.logprobs_R, want.logprobs_R[:AT])
        assert sample.weight_versions == ((0, 0, AT),)
    forwards = pauser.forwards
    held = Call(lambda: engine.generate([PROMPT], PARAMS)[0])
    held.join(timeout=0.5)
    assert held.is_alive() and pauser.forwards == forwards, "a new call ran during the pause"
    engine.resume()
    assert _ids(held.result()) == _ids(reference["one"])


def test_a_call_arriving_during_a_pause_waits_and_runs_on_the_new_weights(update):
    engine = make_engine(seed=0)
    engine.pause("retract")  # nothing runs: returns at once
    call = Call(lambda: engine.generate([PROMPT], PARAMS)[0])
    engine.update_weights(update[2], version=1)
    engine.resume()
    sample = call.result()
    assert sample.weight_versions == ((1, 0, 12),) and sample.weight_version == 1
    torch.testing.assert_close(
        sample.logprobs_R,
        direct_logprobs(update[0], PROMPT, _ids(sample)),
        atol=LOGPROB_ATOL,
        rtol=0,
    )


def test_pauses_are_per_scope(reference):
    engine = make_engine(seed=0)
    engine.pause("in_place", scope="server-a")
    assert engine.paused("server-a") == "in_place" and engine.paused() is None
    assert _ids(engine.generate([PROMPT], PARAMS)[0]) == _ids(reference["one"])
    held = Call(lambda: engine.generate([PROMPT], PARAMS, scope="server-a")[0])
    held.join(timeout=0.3)
    assert held.is_alive()
    engine.resume(scope="server-a")
    assert _ids(held.result()) == _ids(reference["one"])


@pytest.mark.slow
def test_update_weights_pauses_in_the_configured_mode_and_resumes(update, reference):
    engine = make_engine(seed=0, pause_mode="retract")
    pauser = PauseAt(
        engine,
        AT,
        lambda: engine.update_weights(update[2], version=1),
        lambda: engine.paused() == "retract",
    )
    sample = engine.generate([PROMPT], PARAMS)[0]
    pauser.join()
    assert engine.paused() is None and engine.weight_version == 1
    assert sample.weight_versions == ((0, 0, AT), (1, AT, 12))
    torch.testing.assert_close(
        sample.logprobs_R[AT:],
        direct_logprobs(update[0], PROMPT, _ids(sample))[AT:],
        atol=LOGPROB_ATOL,
        rtol=0,
    )


@dataclasses.dataclass
class _Span:  # SGLang's WeightVersionSpan (a msgspec struct), mutable as it is
    version: str
    start: int
    end: int


@pytest.mark.parametrize(
    "changes,current,num_tokens",
    [
        ([], 4, 7),
        ([(0, 3)], 1, 9),
        ([(0, 3), (1, 3), (2, 6)], 3, 6),  # an empty segment and a finished sample
        ([(0, 2), (1, 5)], 1, 8),  # a version that comes back merges
        ([(5, 12)], 6, 12),
    ],
)
def test_version_spans_are_sglangs_compute_weight_version_spans(changes, current, num_tokens):
    event = type("WeightVersionEvent", (), {})
    events = []
    for version, count in changes:
        e = event()
        e.old_version, e.num_output_tokens = version, count
        events.append(e)
    sglang = load_function(
        "srt/utils/weight_versions.py",
        "compute_weight_version_spans",
        {"WeightVersionSpan": _Span, "WeightVersionSpans": list, "List": list},
    )
    want = tuple((s.version, s.start, s.end) for s in sglang(events, current, num_tokens))
    assert version_spans(changes, current, num_tokens) == want


def test_the_pause_modes_and_defaults_are_sglangs():
    """``PauseGenerationReqInput.mode`` (the pinned io_struct.py) is what the engine, the sync
    and the flag accept, ``abort`` by default; ``/update_weight_version`` aborts every request
    by default, which is why a retract / in_place sync sends ``abort_all_requests: false``."""
    import ast

    from megatron_rl.rollout.engine_config import SGLANG_PAUSE_MODES
    from megatron_rl.rollout.pause_gate import PAUSE_MODES
    from megatron_rl.rollout.weight_sync.common import PAUSE_MODES as SYNC_MODES

    def field(cls: str, name: str) -> ast.AnnAssign:
        (node,) = [
            n
            for n in class_node("srt/managers/io_struct.py", cls).body
            if isinstance(n, ast.AnnAssign) and getattr(n.target, "id", None) == name
        ]
        return node

    mode = field("PauseGenerationReqInput", "mode")
    assert tuple(ast.literal_eval(mode.annotation.slice)) == PAUSE_MODES
    assert PAUSE_MODES == SYNC_MODES == SGLANG_PAUSE_MODES
    assert ast.literal_eval(mode.value) == "abort" == WeightSyncConfig().pause_mode
    assert ast.literal_eval(field("UpdateWeightVersionReqInput", "abort_all_requests").value)
    assert ast.literal_eval(field("UpdateWeightFromDiskReqInput", "flush_cache").value)


def test_bad_pause_modes_name_the_field():
    from megatron_rl.rollout.engine_config import EngineConfig

    with pytest.raises(ValueError, match="pause mode 'wait'"):
        make_engine().pause("wait")
    with pytest.raises(ValueError, match=r"InProcessEngineConfig\.pause_mode='keep'"):
        InProcessEngineConfig(pause_mode="keep")
    with pytest.raises(ValueError, match=r"WeightSyncConfig\.pause_mode='inplace'"):
        WeightSyncConfig(pause_mode="inplace")
    with pytest.raises(ValueError, match="--sglang-pause-mode"):
        EngineConfig(sglang_pause_mode="inplace")


# ------------------------------------------------------------------ the loopback server
def _generate_body(max_new_tokens: int = 12) -> dict:
    return {
        "input_ids": PROMPT,
        # the seed `generate` gives sample (0, 0) of a batch seeded 11: the reference's draws
        "sampling_params": {"max_new_tokens": max_new_tokens, "sampling_seed": row_seed(11, 0, 0)},
        "return_logprob": True,
    }


def _post(server, path: str, payload=None):
    return request_json(server.url, "POST", path, payload, timeout_s=120.0)


def _paused_request(server, mode: str) -> tuple[Call, PauseAt]:
    """A ``/generate`` parked by ``/pause_generation`` in ``mode`` after token `AT`."""
    engine = server.engine
    pauser = PauseAt(
        engine,
        AT,
        lambda: _post(server, "/pause_generation", {"mode": mode}),
        lambda: engine.paused(server) == mode,
    )
    call = Call(lambda: _post(server, "/generate", _generate_body()))
    wait_for(lambda: engine.parked(server) == 1, "the request to park")
    pauser.join()
    return call, pauser


@pytest.mark.parametrize("mode", ["retract", "in_place"])
def test_the_loopback_server_keeps_a_paused_request_across_an_update(mode, update, reference):
    server = LoopbackServer(make_engine(seed=0)).start()
    try:
        call, _ = _paused_request(server, mode)
        flush = _post(server, "/flush_cache?timeout=0")
        waited = _post(server, "/flush_cache?timeout=0.2")
        load = _post(server, "/update_weights_from_disk", {"model_path": str(update[1])})
        if mode == "retract":  # SGLang >= 0.5.21: the waiting queue does not block a flush
            assert flush[0] == 200 and flush[1].startswith("Cache flushed.")
            assert waited == (400, "Timed out waiting for idle state.")  # the flush wrapper
            assert load[0] == 200
        else:  # a request parked in place holds its KV: no flush
            assert flush == (400, "Flush cache failed.\n") and waited[0] == 400
            assert load[0] == 400 and "Weights were updated, but the cache was not" in str(load)
            payload = {"model_path": str(update[1]), "flush_cache": False}
            assert _post(server, "/update_weights_from_disk", payload)[0] == 200
        version = {"new_version": "1", "abort_all_requests": False}
        assert _post(server, "/update_weight_version", version)[0] == 200
        assert call.is_alive()
        assert _post(server, "/continue_generation", {})[1]["status"] == "ok"
        status, body = call.result()
    finally:
        server.stop()
    meta = body["meta_info"]
    assert status == 200 and meta["finish_reason"] == {"type": "length"}
    assert meta["weight_versions"] == [
        {"version": "0", "start": 0, "end": AT},
        {"version": "1", "start": AT, "end": 12},
    ]
    assert meta["weight_version"] == "1"  # SGLang: the newest segment's version
    assert body["output_ids"][:AT] == _ids(reference["one"])[:AT]
    recomputed = direct_logprobs(update[0], PROMPT, body["output_ids"])[AT:]
    got = torch.tensor([lp for lp, _, _ in meta["output_token_logprobs"]])[AT:]
    if mode == "retract":
        torch.testing.assert_close(got, recomputed, atol=LOGPROB_ATOL, rtol=0)
    else:
        assert (got - recomputed).abs().max() > 1e-2


def test_the_loopback_server_flushes_retracted_requests_only_from_0_5_21(update):
    server = LoopbackServer(make_engine(seed=0)).start()
    server.flush_ignores_retracted = False  # SGLang 0.5.10-0.5.20: is_fully_idle() counts them
    try:
        call, _ = _paused_request(server, "retract")
        assert _post(server, "/flush_cache?timeout=0") == (400, "Flush cache failed.\n")
        _post(server, "/continue_generation", {})
        assert call.result()[1]["meta_info"]["finish_reason"] == {"type": "length"}
    finally:
        server.stop()


def test_a_version_update_aborts_the_paused_requests_unless_told_not_to(reference):
    """SGLang's ``UpdateWeightVersionReqInput.abort_all_requests`` defaults to true."""
    server = LoopbackServer(make_engine(seed=0)).start()
    try:
        call, _ = _paused_request(server, "retract")
        assert _post(server, "/update_weight_version", {"new_version": "1"})[0] == 200
        status, body = call.result()  # ended while still paused
        _post(server, "/continue_generation", {})
    finally:
        server.stop()
    meta = body["meta_info"]
    assert status == 200 and meta["finish_reason"]["type"] == "abort"
    assert body["output_ids"] == _ids(reference["one"])[:AT]
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": AT}]


def test_an_abort_pause_ends_a_request_retracted_before(reference):
    server = LoopbackServer(make_engine(seed=0)).start()
    try:
        call, _ = _paused_request(server, "retract")
        assert _post(server, "/pause_generation", {"mode": "abort"})[0] == 200
        status, body = call.result()  # answered before the abort pause returned
        assert status == 200 and not server._running
        _post(server, "/continue_generation", {})
    finally:
        server.stop()
    assert body["meta_info"]["finish_reason"]["type"] == "abort"
    assert body["output_ids"] == _ids(reference["one"])[:AT]


def test_the_loopback_server_aborts_running_requests_in_abort_mode(reference):
    server = LoopbackServer(make_engine(seed=0)).start()
    engine = server.engine
    try:
        assert _post(server, "/pause_generation", {"mode": "wait"})[0] == 422
        assert _post(server, "/continue_generation")[0] == 400  # no body: SGLang's 400
        pauser = PauseAt(
            engine, AT, lambda: _post(server, "/pause_generation", {}), lambda: server.pause_mode
        )
        status, body = _post(server, "/generate", _generate_body())
        pauser.join()  # the pause answered once no request ran
        assert server.pause_mode == "abort" and not server._running
        held = Call(lambda: _post(server, "/generate", _generate_body()))
        held.join(timeout=0.5)
        assert held.is_alive(), "a request ran during the pause"
        _post(server, "/continue_generation", {})
        assert held.result()[1]["output_ids"] == _ids(reference["one"])
    finally:
        server.stop()
    meta = body["meta_info"]
    assert status == 200 and meta["finish_reason"]["type"] == "abort"
    count = len(body["output_ids"])
    assert AT <= count < 12 and body["output_ids"] == _ids(reference["one"])[:count]
    assert meta["weight_versions"] == [{"version": "0", "start": 0, "end": count}]


# ------------------------------------------------------------------ the SGLang client's sync
@pytest.mark.parametrize("mode", ["retract", "in_place", "abort"])
def test_a_sync_keeps_an_in_flight_request_in_retract_and_in_place_modes(mode, update):
    """The client's ``update_weights`` while a sample generates: ``retract`` and ``in_place``
    keep it (one sample, two versions); ``abort`` ends it and the client generates it again
    on the new weights (today's behaviour)."""
    sample, aborted, flushes = _sync_during_a_sample(mode, update)
    assert sample.finish_reason == "length" and sample.response_ids_R.numel() == 12
    if mode == "abort":
        assert aborted == 1 and sample.weight_versions == ((1, 0, 12),)
        assert flushes == 1
        return
    assert aborted == 0 and sample.weight_versions == ((0, 0, AT), (1, AT, 12))
    assert sample.weight_version == 0
    assert flushes == (1 if mode == "retract" else 0)  # in_place: no flush


def test_a_retract_sync_to_a_release_before_0_5_21_warns_once_and_keeps_the_request(update, caplog):
    """Such a server refuses the flush while requests are retracted: the sync goes on (the
    prompts' cached KV stays from the old weights there) and says so once per server."""
    with caplog.at_level("WARNING", logger="megatron_rl.rollout.weight_sync.sync"):
        sample, aborted, flushes = _sync_during_a_sample("retract", update, old_release=True)
    assert sample.weight_versions == ((0, 0, AT), (1, AT, 12)) and aborted == 0 and flushes == 1
    warnings = [r for r in caplog.records if "refuses /flush_cache while requests" in r.message]
    assert len(warnings) == 1


def test_a_server_before_0_5_19_is_paused_in_abort_mode(update, caplog):
    """Without ``weight_versions`` a kept request would carry only the newest version: such a
    server (``/server_info`` version) is synced in abort mode, with one warning."""
    with caplog.at_level("WARNING", logger="megatron_rl.rollout.weight_sync.sync"):
        sample, aborted, flushes = _sync_during_a_sample("in_place", update, version="0.5.18")
    assert aborted == 1 and sample.weight_versions == ((1, 0, 12),) and flushes == 1
    warnings = [r for r in caplog.records if "before 0.5.19" in r.message]
    assert len(warnings) == 1 and "0.5.18" in warnings[0].message


def _sync_during_a_sample(
    mode: str, update, *, old_release: bool = False, version: str = "loopback"
):
    """(the sample, `take_aborted`, /flush_cache calls) of a client sync that comes at token
    `AT` of a running sample, with ``pause_mode=mode``; ``old_release``: a server before
    0.5.21 (no flush while requests are retracted); ``version``: its ``/server_info``'s."""
    config = tiny_config()
    server = LoopbackServer(make_engine(seed=0)).start()
    server.flush_ignores_retracted = not old_release
    server.version = version
    engine_config = SGLangEngineConfig.from_hf_config(
        config,
        http=HttpPoolConfig(urls=(server.url,), request_timeout_s=120.0, backoff_s=0.01),
        sync=WeightSyncConfig(transport="tensor", bucket_bytes=64 * 1024, pause_mode=mode),
    )
    try:
        with SGLangEngine(engine_config, hf_config=config) as client:
            engine = server.engine
            pauser = PauseAt(
                engine,
                AT,
                lambda: client.update_weights(iter(update[2]), version=1),
                # abort: the loopback's flag; else the engine's (set after the loopback's)
                lambda: server.pause_mode == "abort" or engine.paused(server) == mode,
            )
            (sample,) = client.generate([PROMPT], PARAMS)
            pauser.join()
            aborted = client.take_aborted()
            flushes = server.requests.count("/flush_cache")
    finally:
        server.stop()
    return sample, aborted, flushes


@pytest.mark.slow
def test_a_retract_recomputes_only_the_live_rows_and_a_finished_row_keeps_its_routes(
    update, reference
):
    """Row 0 ends at its second token and leaves the batch; the retract at token ``AT``
    re-prefills row 1 alone with the new weights. Row 0 keeps the old weights' routes (a
    finished SGLang request is not retracted); row 1's are the new weights' everywhere."""
    new_model, _, tensors = update
    stop = _ids(reference["batch"][0])[1]
    params = dataclasses.replace(PARAMS, stop_token_ids=(stop,))
    engine = make_engine(seed=0)
    batch_rows: list[int] = []
    engine.model.register_forward_pre_hook(
        lambda _m, _a, kwargs: batch_rows.append(kwargs["input_ids"].shape[0]), with_kwargs=True
    )
    pauser = PauseAt(engine, AT, lambda: engine.pause("retract"), lambda: engine.paused())
    prompts = [PROMPT, [9, 9, 250, 301]]
    call = Call(lambda: engine.generate(prompts, params, return_routed_experts=True))
    wait_for(lambda: engine.parked() == 1, "the call to park")
    pauser.join()
    engine.update_weights(tensors, version=1)
    engine.resume()
    done, running = call.result()
    assert len(_ids(done)) == 2 and done.finish_reason == "stop"
    assert batch_rows[:2] == [2, 2] and set(batch_rows[2:]) == {1}  # row 0 left after token 2
    old_model = random_hf_model(tiny_config(), 0)
    routes = [engine.codec.decode(s.routes).sort(-1).values for s in (done, running)]
    want_done = direct_routes(old_model, PROMPT + _ids(done)[:-1]).sort(-1).values
    assert torch.equal(routes[0], want_done)
    response = _ids(running)
    want_running = direct_routes(new_model, prompts[1] + response[:-1]).sort(-1).values
    assert torch.equal(routes[1], want_running)
    recomputed = direct_logprobs(new_model, prompts[1], response)[AT:]
    torch.testing.assert_close(running.logprobs_R[AT:], recomputed, atol=LOGPROB_ATOL, rtol=0)
