"""Next-token sampling and the log-prob convention, as pure functions.

Log-prob convention (matches SGLang 0.5's sampler, ``python/sglang/srt/layers/sampler.py``):

* ``temperature > 0`` and ``logprob_mode="temperature"`` (SGLang's default): the log-prob of
  the sampled token under ``softmax(logits / temperature)`` over the *whole* vocabulary, i.e.
  before top-k/top-p filtering (SGLang computes ``log(probs)`` from the temperature-scaled
  softmax and samples from a filtered copy).
* ``logprob_mode="original"`` (SGLang with ``SGLANG_RETURN_ORIGINAL_LOGPROB=1``):
  ``log_softmax(logits)``, temperature 1, whatever the sampling temperature.
* ``temperature == 0`` (greedy): the argmax, with ``log_softmax(logits)``.
* On the sampling support (``SamplingParams.return_sampling_support``, SGLang's
  ``return_sampling_mask``): the log-prob under the distribution the token was actually drawn
  from, ``softmax(logits / T)`` restricted to the top-k/top-p support ``S`` and renormalised
  (`support_logprobs`), with ``S`` itself (`support_ids`); greedy: ``S = {argmax}``, log-prob 0.

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
    """``scaled_BV`` with every token outside the sampling support set to ``-inf``.

    SGLang's joint rule (``top_k_top_p_min_p_sampling_from_probs_torch``): sort the tokens by
    descending probability ``p = softmax(scaled)``; the token of rank ``i`` (0-based) stays iff
    ``i < top_k`` and the mass before it, ``sum_{j < i} p_j``, is at most ``top_p``. Both
    filters read the full distribution's ``p`` (top-p is not applied to a renormalised top-k),
    the most likely token always stays, and ties at the top-k cut are broken by the sort.
    ``top_k = -1`` / ``top_p = 1``: off.
    """
    vocab = scaled_BV.shape[-1]
    cut_k = 0 < top_k < vocab
    if not cut_k and top_p >= 1.0:
        return scaled_BV
    sorted_BV, order_BV = torch.sort(scaled_BV, dim=-1, descending=True)
    drop_sorted_BV = torch.zeros_like(sorted_BV, dtype=torch.bool)
    if cut_k:
        drop_sorted_BV[:, top_k:] = True
    if top_p < 1.0:
        probs_BV = torch.softmax(sorted_BV, dim=-1)
        drop_sorted_BV |= (torch.cumsum(probs_BV, dim=-1) - probs_BV) > top_p
    drop_BV = torch.zeros_like(drop_sorted_BV).scatter(-1, order_BV, drop_sorted_BV)
    return scaled_BV.masked_fill(drop_BV, float("-inf"))


def support_logprobs(filtered_BV: torch.Tensor, tokens_B: torch.Tensor) -> torch.Tensor:
    """float32 [B]: ``log(p(y) / sum_{v in S} p(v))``, the log-prob each token was drawn with.

    ``filtered_BV``: ``filter_top_k_top_p(logits / T, ...)`` (``-inf`` off the support ``S``);
    ``log_softmax`` over it is the renormalised truncated distribution, SGLang's
    ``output_token_sampling_logprobs`` (``log(selected_weight / support_mass)``)."""
    return torch.log_softmax(filtered_BV.float(), dim=-1).gather(-1, tokens_B[:, None]).squeeze(-1)


def support_ids(filtered_BV: torch.Tensor) -> list[torch.Tensor]:
    """Per row, int32 ids of the support ``S`` (finite entries of ``filtered_BV``) in descending
    probability, the order of SGLang's ``output_token_sampling_mask``."""
    sorted_BV, order_BV = torch.sort(filtered_BV, dim=-1, descending=True)
    sizes = torch.isfinite(sorted_BV).sum(dim=-1).tolist()
    order_BV = order_BV.to(torch.int32)
    return [order_BV[b, :n] for b, n in enumerate(sizes)]


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
    return draw(filter_top_k_top_p(logits_BV / temperature, top_k, top_p), generators)


def draw(filtered_BV: torch.Tensor, generators: Sequence[torch.Generator] | None) -> torch.Tensor:
    """int64 [B]: one Gumbel-max draw per row from ``softmax(filtered_BV)`` (float32 logits,
    ``-inf`` off the support); ``generators`` as in `sample_next`."""
    batch, vocab = filtered_BV.shape
    if generators is None:
        uniform_BV = torch.rand(batch, vocab, device=filtered_BV.device)
    else:
        if len(generators) != batch:
            raise ValueError(f"{len(generators)} generators for {batch} rows")
        uniform_BV = torch.stack([torch.rand(vocab, generator=g) for g in generators]).to(
            filtered_BV.device
        )
    gumbel_BV = -torch.log(-torch.log(uniform_BV.clamp_(min=1e-20, max=1.0 - 1e-7)))
    return (filtered_BV + gumbel_BV).argmax(dim=-1)


def sample_on_support(
    logits_BV: torch.Tensor,
    *,
    temperature: float,
    top_k: int,
    top_p: float,
    generators: Sequence[torch.Generator] | None,
) -> tuple[torch.Tensor, torch.Tensor, list[torch.Tensor]]:
    """`sample_next` with its support: the tokens int64 [B], their log-probs under the
    renormalised support float32 [B] (`support_logprobs`) and each row's support ids
    (`support_ids`); greedy: the argmax alone, drawn with probability 1."""
    logits_BV = logits_BV.float()
    if temperature == 0:
        next_B = logits_BV.argmax(dim=-1)
        return next_B, torch.zeros(next_B.shape), [t.view(1).to(torch.int32) for t in next_B]
    filtered_BV = filter_top_k_top_p(logits_BV / temperature, top_k, top_p)
    next_B = draw(filtered_BV, generators)
    return next_B, support_logprobs(filtered_BV, next_B), support_ids(filtered_BV)


def row_seed(seed: int, prompt_index: int, sample_index: int) -> int:
    """The seed of one (prompt, sample) under batch seed ``seed`` (SGLang's ``sampling_seed``)."""
    return (seed * 1_000_003 + prompt_index * 65_537 + sample_index) % (2**31 - 1)
