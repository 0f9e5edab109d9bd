"""A prompt's samples stay on one SGLang worker when R3 sends them to the workers directly.

Two real SGLang 0.5.23 workers on CPU show the point of it: every sample after a prompt's first
is served from the worker's prefix cache (``meta_info.cached_tokens``). Stand-in servers
(`LoopbackServer`) show the routing under faults the real server cannot be made to show on cue
(a worker dying mid-batch): they record every ``/generate`` request's ``rid``
(``{batch}-{prompt}-{sample}-{attempt}``), so the test reads which worker each attempt of each
sample went to; the last attempt of a sample is the one that answered.
"""

from __future__ import annotations

import collections
import random
import threading

import pytest
from real_sglang import servers as real
from rollout_testing import tiny_config

from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.http_pool import HttpPoolConfig
from megatron_rl.rollout.prompt_affinity import PromptAffinity
from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig

PARAMS = SamplingParams(max_new_tokens=2, seed=5)
PROMPTS = [[5, 17, 33, 2], [101, 7], [9, 9, 250, 301], [44, 12, 3], [8, 80, 480], [61, 62]]
N = 4


def record_generates(server, log, die_on=None):
    """Append ``(server url, prompt, sample, attempt)`` for each ``/generate`` to ``log``; the
    ``die_on``-th one (1-based) stops the server instead of answering."""
    lock = threading.Lock()
    seen = [0]

    def before(path, payload):
        if path != "/generate":
            return None
        _, i, j, attempt = payload["rid"].rsplit("-", 3)
        with lock:
            log.append((server.url, int(i), int(j), int(attempt)))
            seen[0] += 1
            return "die" if seen[0] == die_on else None

    server.before_request = before


def client_for(workers, router=None) -> SGLangEngine:
    http = HttpPoolConfig(
        urls=tuple(s.url for s in workers),
        request_timeout_s=60.0,
        backoff_s=0.01,
        down_s=600.0,  # a dead worker stays out for the whole test
        health_timeout_s=5.0,
    )
    config = SGLangEngineConfig.from_hf_config(
        tiny_config(), http=http, router_url=None if router is None else router.url
    )
    return SGLangEngine(config)


def answered_on(log) -> dict[int, list[str]]:
    """prompt -> the worker that answered each of its samples (its last attempt's)."""
    last = {}
    for url, i, j, attempt in log:
        if (i, j) not in last or attempt > last[i, j][0]:
            last[i, j] = (attempt, url)
    by_prompt = collections.defaultdict(list)
    for (i, _), (_, url) in sorted(last.items()):
        by_prompt[i].append(url)
    return dict(by_prompt)


def test_every_prompt_of_an_r3_batch_is_served_by_one_worker_and_both_workers_get_work(servers):
    a, b, router = servers(3)  # the third plays the router that R3 bypasses
    log: list = []
    for server in (a, b, router):
        record_generates(server, log)
    with client_for([a, b], router=router) as client:
        samples = client.generate(PROMPTS, PARAMS, n=N, return_routed_experts=True)
    assert len(samples) == len(PROMPTS) * N and all(s.routes is not None for s in samples)
    assert router.url not in {url for url, *_ in log}
    sent_to = collections.defaultdict(set)
    for url, i, _, _ in log:
        sent_to[i].add(url)
    assert {i: len(urls) for i, urls in sent_to.items()} == dict.fromkeys(range(len(PROMPTS)), 1)
    assert {url for urls in sent_to.values() for url in urls} == {a.url, b.url}


def test_a_worker_dying_mid_batch_moves_its_prompts_whole_to_one_other_worker(servers):
    a, b, c = servers(3)
    log: list = []
    for server in (a, c):
        record_generates(server, log)
    record_generates(b, log, die_on=2)  # b dies on its second request: its prompt has more
    with client_for([a, b, c]) as client:
        samples = client.generate(PROMPTS, PARAMS, n=N, return_routed_experts=True)
        assert client.workers.healthy_urls() == [a.url, c.url]
    assert len(samples) == len(PROMPTS) * N
    answers = answered_on(log)
    assert sorted(answers) == list(range(len(PROMPTS)))
    for i, urls in answers.items():  # what b answered before dying stays; the rest on one worker
        assert len(set(urls) - {b.url}) <= 1, f"prompt {i} scattered over {set(urls)}"
    moved = [i for i, urls in answers.items() if any(u != b.url for u in urls)]
    tried_b = {i for url, i, _, _ in log if url == b.url}
    assert tried_b & set(moved), "no prompt of the dead worker was moved"


def test_prompts_are_pinned_by_load_then_by_pins_so_far_and_move_whole():
    affinity = PromptAffinity(2)
    urls = ["http://a:1", "http://b:1"]
    assert affinity.choose(0, urls) == "http://a:1"
    assert affinity.choose(1, urls) == "http://b:1"  # a carries prompt 0's two samples
    assert affinity.choose(0, urls) == "http://a:1"  # pinned
    for prompt in (0, 0, 1, 1):
        affinity.answered(prompt)
    assert affinity.choose(2, urls) == "http://a:1"  # both idle, one prompt each: the first URL
    affinity.answered(2)
    assert affinity.choose(2, ["http://b:1"]) == "http://b:1"  # a is out: prompt 2 moves
    assert affinity.choose(3, urls) == "http://a:1"  # b carries prompt 2's one unanswered sample
    assert affinity.moves == 1 and affinity.pins() == {
        0: "http://a:1",
        1: "http://b:1",
        2: "http://b:1",
        3: "http://a:1",
    }


@pytest.fixture(scope="module")
def real_workers(tmp_path_factory):
    real.require()
    folder = tmp_path_factory.mktemp("real_sglang_affinity")
    model_dir = real.write_tiny_checkpoint(folder / "model", real.task_hf_config())
    started = [real.start_server(model_dir, log_path=folder / f"worker{k}.log") for k in range(2)]
    try:
        for server in started:
            server.wait_ready(timeout_s=600)
        yield started
    finally:
        for server in started:
            server.stop()


@pytest.mark.slow
@pytest.mark.real_sglang
@pytest.mark.xdist_group("real_sglang_affinity")
def test_real_workers_serve_each_prompts_later_samples_from_their_prefix_cache(
    real_workers, monkeypatch
):
    hf_config = real.task_hf_config()
    rng = random.Random(0)
    prompts = [[rng.randrange(3, hf_config.vocab_size) for _ in range(24)] for _ in range(4)]
    config = SGLangEngineConfig.from_hf_config(
        hf_config,
        http=HttpPoolConfig(urls=tuple(s.url for s in real_workers), request_timeout_s=300.0),
        max_in_flight=1,  # one request at a time: a cache hit never depends on timing
    )
    served = []  # (worker, prompt length, cached tokens) per /generate
    with SGLangEngine(config, hf_config=hf_config) as client:
        for url in client.workers.members():
            client.workers.flush_cache(url)
        once = client.workers._once

        def spy(url, method, path, payload, **kwargs):
            body = once(url, method, path, payload, **kwargs)
            if path == "/generate":
                cached = int(body["meta_info"]["cached_tokens"])
                served.append((url, tuple(payload["input_ids"]), cached))
            return body

        monkeypatch.setattr(client.workers, "_once", spy)
        params = SamplingParams(max_new_tokens=2, temperature=1.0)
        samples = client.generate(prompts, params, n=3, return_routed_experts=True)
    assert len(samples) == 12 and all(s.routes is not None for s in samples)
    by_prompt = collections.defaultdict(list)
    for url, prompt, cached in served:
        by_prompt[prompt].append((url, cached))
    for answers in by_prompt.values():
        assert len({url for url, _ in answers}) == 1
        assert answers[0][1] == 0 and all(c > 0 for _, c in answers[1:]), answers
    assert {url for url, _, _ in served} == {s.url for s in real_workers}
