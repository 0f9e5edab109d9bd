"""Log-probs renormalised on the sampling support the engine recorded (DeepSeek-V3.2's "keep
sampling mask", SGLang's ``return_sampling_mask``).

With top-k/top-p sampling a token is drawn from ``softmax(logits / T)`` restricted to a support
``S`` and renormalised, so the behaviour log-prob is

    ``log mu_S(y) = l_y - log sum_{v in S} exp(l_v)``,  ``l = logits / T``,

and the trainer evaluates its policy on the same ``S`` (recorded per token by the engine, not
recomputed from the trainer's logits, so a near tie at the cut cannot move it). The ratios
``pi_S / pi_old,S`` and ``pi_S / mu_S`` then compare distributions over the same action space.

Tensor parallelism: ``S``'s ids are full-vocabulary ids; each rank gathers the entries of its
vocabulary shard (``[b, s - 1, K]``, never the vocabulary), and the max and ``sum exp`` are
all-reduced over the tensor-parallel group (the sum through megatron's
``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity backward, the
gradient each shard's logits need). Reference-policy log-probs (the KL term), entropy and the
exact-p evaluation stay on the full vocabulary, as NeMo-RL keeps its reference.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.utils import VocabUtility

from megatron_rl.train.logprobs import token_logprobs


def support_token_logprobs(
    logits_BSv: torch.Tensor,
    tokens_BS: torch.Tensor,
    support_BTK: torch.Tensor,
    temperature: float = 1.0,
) -> torch.Tensor:
    """``[b, s - 1]`` float32 ``log mu_S(tokens[:, 1:])`` from this rank's shard ``[b, s, V / tp]``.

    ``support_BTK``: int64 ``[b, s - 1, K]`` full-vocabulary ids of each predicted position's
    support, -1 padded; a position with no id (prompt, padding, a tool's tokens) gets 0. Every
    target must be in its position's support (the engine's contract, checked on the samples).
    Differentiable in ``logits_BSv``; ``T`` of 0 or 1 leaves the logits unscaled."""
    batch, seq, shard = logits_BSv.shape
    if support_BTK.shape[:2] != (batch, seq - 1):
        raise ValueError(
            f"support_BTK {tuple(support_BTK.shape)} must be [b, s - 1, K] = "
            f"[{batch}, {seq - 1}, K] for logits {tuple(logits_BSv.shape)}"
        )
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        shard, parallel_state.get_tensor_model_parallel_rank(), tp_size
    )
    logits_BTv = logits_BSv[:, :-1]
    scale = 1.0 if temperature in (0.0, 1.0) else 1.0 / temperature
    ids_BTK = torch.cat([tokens_BS[:, 1:, None], support_BTK], dim=-1)  # target first
    here_BTK = (ids_BTK >= start) & (ids_BTK < end)
    local_BTK = torch.where(here_BTK, ids_BTK - start, torch.zeros_like(ids_BTK))
    values_BTK = logits_BTv.gather(-1, local_BTK).float() * scale
    values_BTK = values_BTK.masked_fill(~here_BTK, float("-inf"))
    target_BT, members_BTK = values_BTK[..., 0], values_BTK[..., 1:]
    has_support_BT = (support_BTK >= 0).any(dim=-1)
    max_BT = members_BTK.detach().amax(dim=-1)
    if tp_size > 1:
        group = parallel_state.get_tensor_model_parallel_group()
        torch.distributed.all_reduce(max_BT, op=torch.distributed.ReduceOp.MAX, group=group)
    max_BT = torch.where(has_support_BT, max_BT, torch.zeros_like(max_BT))
    # each shard's partial sum exp(l - m) and its share of the target's logit (0 off-shard)
    sums_BT2 = torch.stack(
        [
            torch.exp(members_BTK - max_BT[..., None]).sum(dim=-1),
            torch.where(here_BTK[..., 0], target_BT, torch.zeros_like(target_BT)),
        ],
        dim=-1,
    )
    if tp_size > 1:
        sums_BT2 = reduce_from_tensor_model_parallel_region(sums_BT2)
    sum_exp_BT, target_BT = sums_BT2.unbind(-1)
    # 1 where there is no support: log(0) would send NaN through the masked branch's gradient
    sum_exp_BT = torch.where(has_support_BT, sum_exp_BT, torch.ones_like(sum_exp_BT))
    logprobs_BT = target_BT - max_BT - torch.log(sum_exp_BT)
    return torch.where(has_support_BT, logprobs_BT, torch.zeros_like(logprobs_BT))


def policy_logprobs(logits_BSv: torch.Tensor, mb, temperature: float) -> torch.Tensor:
    """``[b, s - 1]`` float32 log-probs the loss compares with the behaviour's: on the recorded
    sampling supports when the micro-batch ``mb`` carries them (``mb.support_BTK``), else on
    the full vocabulary (`megatron_rl.train.logprobs.token_logprobs`)."""
    if mb.support_BTK is None:
        return token_logprobs(logits_BSv, mb.tokens_BS, temperature)
    return support_token_logprobs(logits_BSv, mb.tokens_BS, mb.support_BTK, temperature)
