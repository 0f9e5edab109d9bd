"""Padded tokens out of megatron-core's MoE router statistics.

The trainer pads each micro-batch: rows to its longest row and, under sequence parallelism, the
width to a multiple of TP (`megatron_rl.train.batch.make_micro_batch`). Megatron-core's
``GPTModel.forward(padding_mask=...)`` (bool ``[b, s]``, True at a padded position: the
convention its code uses, although its docstrings say True marks valid tokens) carries a mask to
every MoE router, which then leaves the padded tokens out of its aux losses and z-loss
(``compute_routing_scores_for_aux_loss``, ``get_tokens_per_expert_and_token_count``) and should
leave them out of the aux-loss-free expert-bias counts (DeepSeek-V3's and GLM-4.5's sigmoid
routers). Without the mask those counts include the padded tokens' routes, so a layout that pads
otherwise (TP 2 + SP) moves ``expert_bias`` otherwise than world 1.

Two megatron-core 0.16.1 gaps on that path, bridged here:

1. ``TopKRouter._apply_expert_bias`` computes ``routing_map & ~padding_mask`` with the routing
   map ``[N, E]`` and the flattened mask ``[N]``: broadcasting aligns the mask with the *expert*
   axis, so it raises ("The size of tensor a (E) must match the size of tensor b (N)") unless
   N == E, and with N == E it silently drops expert j's count where token j is padded.
   `ExpertBiasPaddingRouter` masks per token (``padding_mask[:, None]``).
2. ``GPTModel._preprocess`` scatters the mask over the sequence (SP) only on the first pipeline
   stage; a later stage's routers would get the whole ``[b, s]`` mask for their ``[s / TP, b]``
   tokens. `padding_mask_BS` hands a later stage its own chunk instead.
"""

from __future__ import annotations

from collections.abc import Sequence

import torch
from megatron.core.tensor_parallel.mappings import scatter_to_sequence_parallel_region
from megatron.core.transformer.moe.router import TopKRouter


class ExpertBiasPaddingRouter(TopKRouter):
    """`TopKRouter` whose expert-bias token counts leave out padded tokens (see the module).

    Counts, as megatron's, only in forwards with grad enabled (not in no-grad passes, once under
    activation recompute): ``local_tokens_per_expert += sum over unpadded tokens n of
    routing_map[n]`` (``[E]``), with ``routing_map`` ``[N, E]`` bool and ``padding_mask`` ``[N]``.
    """

    def _apply_expert_bias(self, routing_map: torch.Tensor, padding_mask=None) -> None:
        if self.enable_expert_bias and torch.is_grad_enabled():
            with torch.no_grad():
                if padding_mask is not None:
                    routing_map = routing_map & ~padding_mask.reshape(-1, 1)
                self.local_tokens_per_expert += routing_map.sum(dim=0)


def mask_padding_in_expert_bias(model: torch.nn.Module) -> int:
    """Make every ``TopKRouter`` of ``model`` with an expert bias an `ExpertBiasPaddingRouter`.

    Only the class changes (one method), not the parameters or buffers; returns how many."""
    count = 0
    for module in model.modules():
        if type(module) is TopKRouter and module.enable_expert_bias:
            module.__class__ = ExpertBiasPaddingRouter
            count += 1
    return count


def padding_mask_BS(model, lengths: Sequence[int], seq: int, device) -> torch.Tensor:
    """Megatron's ``padding_mask`` for rows of ``lengths`` tokens padded to ``seq``: bool
    ``[b, s]``, True at position t >= length. On a pipeline stage after the first under sequence
    parallelism, this rank's sequence chunk ``[b, s / TP]`` (megatron scatters it on the first
    stage only: the model chunk that embeds, ``model.pre_process``)."""
    lengths_B1 = torch.as_tensor(list(lengths), device=device).unsqueeze(1)
    mask_BS = torch.arange(seq, device=device).unsqueeze(0) >= lengths_B1
    first_stage = getattr(model, "module", model).pre_process  # model may be DDP-wrapped
    if model.config.sequence_parallel and not first_stage:
        mask_SB = scatter_to_sequence_parallel_region(mask_BS.transpose(0, 1).contiguous())
        mask_BS = mask_SB.transpose(0, 1).contiguous()
    return mask_BS
