"""Routing replay per (model chunk, micro-batch), in the interleaved pipeline schedule's order.

Under interleaved pipeline parallelism a rank's chunks run one micro-batch's forward at different
times: chunk 0 runs micro-batches 0 and 1, then chunk 1 runs them (PP 2's group of 2). Two
world-1 models stand in for a rank's two chunks here (a real PP 2 x VP 2 rank is run by
tests/train/test_pipeline_parallel.py); each chunk must record and replay its own layers' routes
for the micro-batch it runs, and a route kept or consumed for the wrong micro-batch must fail.
"""

from __future__ import annotations

import pytest
import torch
from replay_testing import chosen_experts, logits_of, make_driver, perturb_routers, tiny_moe


@pytest.fixture
def ws1_seed() -> int:
    return 3


def _tokens(config, batch: int, seed: int) -> torch.Tensor:
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, 12), generator=gen)


def _two_chunks():
    config, first = tiny_moe()
    _, second = tiny_moe()
    return config, [first, second]


def _record_interleaved(driver, chunks, tokens) -> list[list[torch.Tensor]]:
    """R2's record pass in the interleaved order; each chunk's chosen experts per micro-batch."""
    chosen = [[], []]
    driver.start_pass("record")
    with torch.no_grad():
        for c, chunk in enumerate(chunks):
            for key, mb in enumerate(tokens):
                _, experts = chosen_experts(chunk, lambda chunk=chunk, mb=mb: logits_of(chunk, mb))
                driver.keep_recorded(key, chunk=c)
                chosen[key] += experts
    driver.end_pass()
    return chosen


def test_each_chunk_records_and_replays_its_own_layers_per_micro_batch(ws1):
    config, chunks = _two_chunks()
    driver = make_driver(chunks, config, mode="r2")
    tokens = [_tokens(config, 2, seed=0), _tokens(config, 3, seed=1)]
    recorded = _record_interleaved(driver, chunks, tokens)
    for key in (0, 1):  # one recording per micro-batch: both chunks' layers, in chunk order
        routes = driver.recorded_routes(key)
        assert len(routes) == 4
        for got, want in zip(routes, recorded[key], strict=True):
            assert torch.equal(got.sort(dim=-1).values, want)
    for chunk in chunks:
        perturb_routers(chunk)
    driver.start_pass("replay")
    replayed = [[], []]
    with torch.no_grad():
        for c, chunk in enumerate(chunks):
            for key, mb in enumerate(tokens):
                driver.push(driver.recorded_routes(key), chunk=c)
                _, experts = chosen_experts(chunk, lambda chunk=chunk, mb=mb: logits_of(chunk, mb))
                replayed[key] += experts
    driver.end_pass()
    for key in (0, 1):
        for got, want in zip(replayed[key], recorded[key], strict=True):
            assert torch.equal(got, want), key
    driver.close()


def test_a_chunk_recording_a_micro_batch_twice_is_an_error(ws1):
    config, chunks = _two_chunks()
    driver = make_driver(chunks, config, mode="r2")
    tokens = _tokens(config, 2, seed=0)
    driver.start_pass("record")
    with torch.no_grad():
        logits_of(chunks[0], tokens)
        driver.keep_recorded("mb0", chunk=0)
        logits_of(chunks[0], tokens)
        with pytest.raises(RuntimeError, match="model chunk 0 recorded micro-batch 'mb0' twice"):
            driver.keep_recorded("mb0", chunk=0)
    driver.finish_pass(False)
    driver.close()


def test_a_micro_batch_recorded_by_some_chunks_only_fails_the_pass(ws1):
    config, chunks = _two_chunks()
    driver = make_driver(chunks, config, mode="r2")
    driver.start_pass("record")
    with torch.no_grad():
        logits_of(chunks[0], _tokens(config, 2, seed=0))
        driver.keep_recorded("mb0", chunk=0)
    with pytest.raises(RuntimeError, match=r"recorded by some model chunks only: 'mb0' by chunks"):
        driver.end_pass()
    driver.close()


@pytest.mark.parametrize(
    ("pushed", "runs", "match"),
    [
        # chunk 1 given micro-batch 1's routes (3 rows) while it runs micro-batch 0 (2 rows)
        ((1, 1), (1, 0), "routes 24 local tokens but 36 replay rows"),
        # routes pushed for chunk 1 only: chunk 0's forward has nothing to replay
        ((0, 1), (0, 0), "forward needs replayed routes but none are left"),
    ],
    ids=["another-micro-batch", "another-chunk"],
)
def test_a_route_pushed_for_another_forward_fails_loudly(ws1, pushed, runs, match):
    """``pushed``: (micro-batch, chunk) whose routes are pushed; ``runs``: (chunk, micro-batch)
    whose forward then runs."""
    config, chunks = _two_chunks()
    driver = make_driver(chunks, config, mode="r2")
    tokens = [_tokens(config, 2, seed=0), _tokens(config, 3, seed=1)]
    _record_interleaved(driver, chunks, tokens)
    driver.start_pass("replay")
    (key, chunk), (running, mb) = pushed, runs
    with torch.no_grad():
        driver.push(driver.recorded_routes(key), chunk=chunk)
        with pytest.raises(RuntimeError, match=match):
            logits_of(chunks[running], tokens[mb])
    driver.finish_pass(False)
    driver.close()
