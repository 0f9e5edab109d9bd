"""What the real sglang-router 0.3.2 binary forwards to a worker, field by field.

The worker here is the loopback stand-in recording each ``/generate`` body it receives (the
router's forwarding is what is under test, not the worker); the router is the real Rust binary
started by ``python -m sglang_router.launch_router``. This is the evidence behind
`SGLangEngine` sending R3 generation and sampling-support requests to the workers directly.
"""

from __future__ import annotations

import pytest
from real_sglang import servers as real

from megatron_rl.rollout import SamplingParams
from megatron_rl.rollout.http_pool import request_json
from megatron_rl.rollout.sglang_payload import GENERATE_FIELDS, SEED_FIELD, generate_request

pytestmark = [pytest.mark.slow, pytest.mark.real_sglang]

# what the router 0.3.2 drops of what the client sends (sglang-api.md, measured 2026-12-01;
# return_sampling_mask measured 2026-12-06)
DROPPED = {"return_routed_experts", "return_sampling_mask"}


@pytest.fixture
def recording_worker(servers):
    (worker,) = servers(1)
    bodies: list[dict] = []
    original = worker.handle

    def record(path, payload):
        if path == "/generate":
            bodies.append(dict(payload))
        return original(path, payload)

    worker.handle = record
    return worker, bodies


def test_the_router_drops_routed_experts_and_sampling_masks_and_keeps_every_other_field(
    recording_worker, tmp_path
):
    real.require()
    worker, bodies = recording_worker
    router = real.start_router([worker.url], log_path=tmp_path / "router.log")
    try:
        router.wait_ready(timeout_s=120)
        params = SamplingParams(
            max_new_tokens=3,
            top_p=0.9,
            top_k=5,
            stop_token_ids=(2,),
            seed=4,
            return_sampling_support=True,
        )
        sent = generate_request(
            [5, 17, 33], params, prompt_index=0, sample_index=1, rid="r-1",
            return_routed_experts=True,
        )  # fmt: skip
        sent["logprob_start_len"] = 0
        status, answer = request_json(router.url, "POST", "/generate", sent, timeout_s=60)
    finally:
        router.stop()
    assert status == 200, answer
    (got,) = bodies
    assert set(sent) == set(GENERATE_FIELDS)  # every top-level field the client ever sends
    kept = {k for k in sent if k in got}
    assert set(sent) - kept == DROPPED, f"the router now forwards {set(sent) - kept}"
    for key in kept - {"sampling_params"}:
        assert got[key] == sent[key], key
    for key, value in sent["sampling_params"].items():
        if key == SEED_FIELD:
            continue  # checked below
        assert got["sampling_params"].get(key) == value, key
    assert SEED_FIELD in got["sampling_params"], "the router dropped the per-sample seed"
