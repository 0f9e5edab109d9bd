"""Next-token sampling and the log-prob convention, as pure functions.

Log-prob convention (matches SGLang 0.5's sampler, ``python/sglang/srt/layers/sampler.py``):

* ``temperature > 0`` and ``logprob_mode="temperature"`` (SGLang's default): the log-prob of
  the sampled token under ``softmax(logits / temperature)`` over the *whole* vocabulary, i.e.
  before top-k/top-p filtering (SGLang computes ``log(probs)`` from the temperature-scaled
  softmax and samples from a filtered copy).
* ``logprob_mode="original"`` (SGLang with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``):
  ``log_softmax(logits)``, temperature 1, whatever the sampling temperature.
* ``temperature == 0`` (greedy): the argmax, with ``log_softmax(logits)``.

The trainer compares these with its own log-probs at the same temperature; with
``temperature != 1`` configure the trainer's temperature accordingly (or use "original").

Sampling is Gumbel-max with one ``torch.Generator`` per row, so a row's draw depends only on
its own generator and logits, not on the other rows of the batch.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch

LOGPROB_MODES = ("temperature", "original")


def filter_top_k_top_p(scaled_BV: torch.Tensor, top_k: int, top_p: float) -> torch.Tensor:
    """``scaled_BV`` with tokens outside the top-k and the top-p nucleus set to ``-inf``.

    The nucleus keeps the smallest prefix of tokens (by descending probability) whose mass
    reaches ``top_p``; the most likely token is always kept. ``top_k = -1`` / ``top_p = 1``: off.
    """
    out_BV = scaled_BV
    vocab = scaled_BV.shape[-1]
    if 0 < top_k < vocab:
        kth_B1 = torch.topk(scaled_BV, top_k, dim=-1).values[:, -1:]
        out_BV = out_BV.masked_fill(out_BV < kth_B1, float("-inf"))
    if top_p < 1.0:
        sorted_BV, order_BV = torch.sort(out_BV, dim=-1, descending=True)
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        mass_before_BV = torch.cumsum(probs_BV, dim=-1) - probs_BV
        drop_sorted_BV = mass_before_BV > top_p
        drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
        out_BV = out_BV.masked_fill(drop_BV, float("-inf"))
    return out_BV


def token_logprobs(
    logits_BV: torch.Tensor, tokens_B: torch.Tensor, temperature: float, mode: str
) -> torch.Tensor:
    """float32 [B]: log-prob of ``tokens_B`` under the convention of the module docstring."""
    if mode not in LOGPROB_MODES:
        raise ValueError(f"logprob mode {mode!r}: choose one of {LOGPROB_MODES}")
    logits_BV = logits_BV.float()
    if temperature > 0 and mode == "temperature":
        logits_BV = logits_BV / temperature
    logp_BV = torch.log_softmax(logits_BV, dim=-1)
    return logp_BV.gather(-1, tokens_B[:, None]).squeeze(-1)


def sample_next(
    logits_BV: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generators: Sequence[torch.Generator] | None,
) -> torch.Tensor:
    """int64 [B]: the next token of every row (argmax when ``temperature == 0``).

    ``generators``: one per row (seeded sampling), or None for the global RNG.
    """
    logits_BV = logits_BV.float()
    if temperature == 0:
        return logits_BV.argmax(dim=-1)
    scaled_BV = filter_top_k_top_p(logits_BV / temperature, top_k, top_p)
    batch, vocab = scaled_BV.shape
    if generators is None:
        uniform_BV = torch.rand(batch, vocab, device=scaled_BV.device)
    else:
        if len(generators) != batch:
            raise ValueError(f"{len(generators)} generators for {batch} rows")
        uniform_BV = torch.stack([torch.rand(vocab, generator=g) for g in generators]).to(
            scaled_BV.device
        )
    gumbel_BV = -torch.log(-torch.log(uniform_BV.clamp_(min=1e-20, max=1.0 - 1e-7)))
    return (scaled_BV + gumbel_BV).argmax(dim=-1)


def row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one (prompt, sample) under batch seed ``seed`` (SGLang's ``sampling_seed``)."""
    return (seed * 1_000_003 + prompt_index * 65_537 + sample_index) % (2**31 - 1)
