"""The top-K distillation KL (``--loss-teacher ... --teacher-topk K``): NeMo-RL's distillation
loss on the student's own samples.

At every predicted response position the teacher gives its ``K`` most likely next tokens ``S``
and their log-probs. Both distributions are renormalised on ``S`` (NeMo-RL's default,
``zero_outside_topk = False``):

    ``log p_k = t_k - log sum_{j in S} exp(t_j)``   (teacher, ``t`` its log-probs)
    ``log q_k = l_k - log sum_{j in S} exp(l_j)``   (student, ``l`` its logits, temperature 1)

and the per-token KL is

    forward: ``sum_k p_k (log p_k - log q_k)``   (``KL(p || q)``, the default)
    reverse: ``sum_k q_k (log q_k - log p_k)``   (``KL(q || p)``)
    mixed:   ``alpha * forward + (1 - alpha) * reverse``.

With ``K`` equal to the vocabulary size nothing is truncated: these are the exact KLs of the
two full next-token distributions. The loss term is ``lambda * sum_t KL_t / N`` over the
mini-batch's response tokens (``N``, the same token mean as the policy loss's), differentiable
in the student's logits; unlike the sampled token's reverse KL (`megatron_rl.train.teacher`) it
scores every candidate of the teacher at every position, not one sample of the student.

Tensor parallelism: ``S``'s ids are full-vocabulary ids; each rank gathers the logits of its
vocabulary shard (``[b, s - 1, K]``, zero elsewhere) and the sum over the tensor-parallel group
(megatron's ``reduce_from_tensor_model_parallel_region``: all-reduce forward, identity
backward) gives every rank all ``K`` logits, and each shard the gradient of its own.

Approximation, stated: a teacher log-prob below ``-100`` (or ``-inf``, which a server may return
for a token it gives no mass) is clamped to ``-100`` before renormalising, as NeMo-RL does, so
the reverse KL stays finite where the teacher excludes a token the student still proposes.
"""

from __future__ import annotations

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.mappings import reduce_from_tensor_model_parallel_region
from megatron.core.tensor_parallel.utils import VocabUtility

LOG_FLOOR = -100.0  # the teacher's log-probs are clamped here (NeMo-RL's log_infinitesimal)


def topk_kl(
    logits_BSv: torch.Tensor,
    teacher_ids_BTK: torch.Tensor,
    teacher_logprobs_BTK: torch.Tensor,
    kl_type: str = "forward",
    mixed_weight: float = 0.5,
) -> torch.Tensor:
    """float32 ``[b, s - 1]``: the KL of each predicted position, 0 where the teacher gave no
    ids (``teacher_ids_BTK`` all -1: prompt, padding).

    ``logits_BSv``: this rank's vocabulary shard ``[b, s, V / tp]``; ``teacher_ids_BTK``: int64
    ``[b, s - 1, K]`` full-vocabulary ids (-1 padded); ``teacher_logprobs_BTK``: float ``[b,
    s - 1, K]``, the teacher's log-probs of those ids. Differentiable in ``logits_BSv``."""
    batch, seq, shard = logits_BSv.shape
    for name, tensor in (
        ("teacher_ids_BTK", teacher_ids_BTK),
        ("teacher_logprobs_BTK", teacher_logprobs_BTK),
    ):
        if tensor.dim() != 3 or tensor.shape[:2] != (batch, seq - 1):
            raise ValueError(
                f"{name} {tuple(tensor.shape)} must be [b, s - 1, K] = [{batch}, {seq - 1}, K] "
                f"for logits {tuple(logits_BSv.shape)}"
            )
    if kl_type not in ("forward", "reverse", "mixed"):
        raise ValueError(f"kl_type={kl_type!r}: must be forward, reverse or mixed")
    tp_size = parallel_state.get_tensor_model_parallel_world_size()
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        shard, parallel_state.get_tensor_model_parallel_rank(), tp_size
    )
    present_BTK = teacher_ids_BTK >= 0
    here_BTK = present_BTK & (teacher_ids_BTK >= start) & (teacher_ids_BTK < end)
    local_BTK = torch.where(here_BTK, teacher_ids_BTK - start, torch.zeros_like(teacher_ids_BTK))
    values_BTK = logits_BSv[:, :-1].gather(-1, local_BTK).float()
    values_BTK = torch.where(here_BTK, values_BTK, torch.zeros_like(values_BTK))
    if tp_size > 1:
        values_BTK = reduce_from_tensor_model_parallel_region(values_BTK)
    has_BT = present_BTK.any(dim=-1)
    # absent ids (-1 padding) leave both softmaxes; a row without ids gets a dummy finite one
    absent_BTK = ~present_BTK
    absent_BTK[..., 0] &= has_BT
    student_BTK = torch.log_softmax(values_BTK.masked_fill(absent_BTK, float("-inf")), dim=-1)
    floor = teacher_logprobs_BTK.float().clamp(min=LOG_FLOOR)  # a -inf teacher log-prob
    teacher_BTK = torch.log_softmax(floor.masked_fill(absent_BTK, float("-inf")), dim=-1)
    student_BTK = student_BTK.masked_fill(absent_BTK, 0.0)
    teacher_BTK = teacher_BTK.masked_fill(absent_BTK, 0.0)
    gap_BTK = teacher_BTK - student_BTK  # log p - log q, 0 off the support
    forward_BT = (teacher_BTK.exp() * gap_BTK).masked_fill(absent_BTK, 0.0).sum(dim=-1)
    reverse_BT = (student_BTK.exp() * -gap_BTK).masked_fill(absent_BTK, 0.0).sum(dim=-1)
    if kl_type == "forward":
        kl_BT = forward_BT
    elif kl_type == "reverse":
        kl_BT = reverse_BT
    else:
        kl_BT = mixed_weight * forward_BT + (1.0 - mixed_weight) * reverse_BT
    return torch.where(has_BT, kl_BT, torch.zeros_like(kl_BT))
