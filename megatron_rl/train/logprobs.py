"""Per-token log-probs (and entropy) of the taken tokens from a megatron GPT model.

``log pi(y_t) = log softmax(logits_{t-1} / T)[y_t]`` computed with megatron's
``vocab_parallel_cross_entropy`` on the tensor-parallel vocabulary shards (no full-vocabulary
gather in the differentiable path). ``T`` is the rollout temperature, so the trainer's numbers are
comparable to the engines' (SGLang's convention: log-probs of ``softmax(logits / T)``).
"""

from __future__ import annotations

import torch
from megatron.core import tensor_parallel
from megatron.core.tensor_parallel.mappings import gather_from_tensor_model_parallel_region


def forward_logits(model, tokens_BS: torch.Tensor) -> torch.Tensor:
    """This rank's vocabulary shard of the logits, ``[b, s, V / tp]``."""
    batch, seq = tokens_BS.shape
    position_ids = torch.arange(seq, device=tokens_BS.device).expand(batch, seq)
    return model(input_ids=tokens_BS, position_ids=position_ids, attention_mask=None)


def token_logprobs(
    logits_BSv: torch.Tensor, tokens_BS: torch.Tensor, temperature: float = 1.0
) -> torch.Tensor:
    """``[b, s - 1]`` log-probs of ``tokens[:, 1:]`` under ``softmax(logits[:, :-1] / T)``.

    ``logits_BSv`` is left untouched (megatron's kernel works in place on its input, so it gets
    its own copy even when no transpose or dtype cast would make one, e.g. ``b = 1`` in fp32).
    """
    # megatron's kernel wants [s, b, v]; it returns the per-token cross-entropy (= -log p)
    logits_TBv = logits_BSv[:, :-1].transpose(0, 1).float()
    if temperature not in (0.0, 1.0):
        logits_TBv = logits_TBv / temperature  # a new tensor
    elif logits_TBv.untyped_storage().data_ptr() == logits_BSv.untyped_storage().data_ptr():
        logits_TBv = logits_TBv.clone(memory_format=torch.contiguous_format)
    target_TB = tokens_BS[:, 1:].transpose(0, 1).contiguous()
    nll_TB = tensor_parallel.vocab_parallel_cross_entropy(logits_TBv.contiguous(), target_TB)
    return -nll_TB.transpose(0, 1)


@torch.no_grad()
def token_entropy(logits_BSv: torch.Tensor, temperature: float = 1.0) -> torch.Tensor:
    """``[b, s - 1]`` entropy of the predictive distribution (gathers the vocabulary)."""
    logits = gather_from_tensor_model_parallel_region(logits_BSv[:, :-1].float())
    if temperature not in (0.0, 1.0):
        logits = logits / temperature
    logp = torch.log_softmax(logits, dim=-1)
    return -(logp.exp() * logp).sum(dim=-1)
