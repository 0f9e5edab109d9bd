"""Helpers for the merged-pass tests: the tiny model, micro-batches with engine routes, and one
behaviour pass merged or not."""

from __future__ import annotations

import random

import torch

from megatron_rl.model import ModelOptions, build_model, preset_config
from megatron_rl.routing import RoutingCodec
from megatron_rl.train.batch import TrainSample, make_micro_batch
from megatron_rl.train.logprobs import token_logprobs
from megatron_rl.train.merged_pass import forward_only_pass
from megatron_rl.train.pipeline import run_pass

ROWS = 3  # per micro-batch
TEMPERATURE = 0.7


def tiny_moe():
    config = preset_config("tiny")
    return config, build_model(config, ModelOptions(routing_replay=True))


def samples_with_routes(config, lengths, seed=0) -> list[TrainSample]:
    gen = torch.Generator().manual_seed(seed)
    samples = []
    for i, n in enumerate(lengths):
        prompt = 2 + i % 3
        tokens = torch.randint(1, config.vocab_size, (n,), generator=gen)
        # R3: routes of every token but the last, as a rollout engine returns them
        scores = torch.rand(n - 1, config.num_hidden_layers, config.num_experts, generator=gen)
        routes = scores.topk(config.num_experts_per_tok, dim=-1).indices
        codec = RoutingCodec(config.num_experts, config.num_experts_per_tok)
        samples.append(
            TrainSample(
                prompt_ids=tokens[:prompt],
                response_ids=tokens[prompt:],
                rollout_logprobs=torch.zeros(n - prompt),
                advantage=1.0,
                reward=1.0,
                in_loss=True,
                routes=codec.encode(routes),
            )
        )
    return samples


def micro_batches(config, widths=(19, 19, 14, 14, 14), seed=0):
    """One micro-batch of ``ROWS`` rows per width (its first row that long, the others 5 to
    ``width`` tokens), pad id 0."""
    rng = random.Random(seed)
    lengths = [n for w in widths for n in (w, *(rng.randint(5, w) for _ in range(ROWS - 1)))]
    samples = samples_with_routes(config, lengths, seed)
    return [make_micro_batch(samples[i : i + ROWS], 0) for i in range(0, len(samples), ROWS)]


def behaviour_logprobs(model, mbs, passes, max_tokens, *, pad_widths=False, group=None):
    """Per micro-batch log-probs and the number of forwards: ``None`` = the old path, one
    `run_pass` forward per micro-batch; else `forward_only_pass` with ``max_tokens``."""
    out = [None] * len(mbs)
    forwards = []
    handle = model.register_forward_pre_hook(lambda module, args: forwards.append(1))

    def on_logits(k, logits):
        assert logits.shape[:2] == mbs[k].tokens_BS.shape
        out[k] = token_logprobs(logits, mbs[k].tokens_BS, TEMPERATURE)

    keys = [("mb", k) for k in range(len(mbs))]
    try:
        with torch.no_grad():
            if max_tokens is None:
                run_pass(model, mbs, keys, passes, on_logits, phase="behaviour")
            else:
                forward_only_pass(
                    model,
                    mbs,
                    keys,
                    passes,
                    on_logits,
                    max_tokens=max_tokens,
                    pad_widths=pad_widths,
                    group=group,
                )
    finally:
        handle.remove()
    return out, len(forwards)
