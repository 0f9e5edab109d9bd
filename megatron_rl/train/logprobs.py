"""Per-token log-probs (and entropy) of the taken tokens from a megatron GPT model.

``log pi(y_t) = log softmax(logits_{t-1} / T)[y_t]`` computed with the steps of megatron's
``vocab_parallel_cross_entropy`` on the tensor-parallel vocabulary shards. ``T`` is the rollout
temperature, so the trainer's numbers are comparable to the engines' (SGLang's convention:
log-probs of ``softmax(logits / T)``); ``T`` of 0 or 1 leaves the logits unscaled.

Memory. Neither function gathers the vocabulary, and both work on tiles of at most
``chunk_tokens`` token positions (a block of batch rows times a block of sequence positions): each
tile is copied to float32 (``[tile, V / tp]``, the only vocabulary-sized intermediates), reduced
to per-token vectors and freed before the next tile. The transient memory is therefore a couple of
``chunk_tokens x V / tp`` float32 buffers plus ``[b, s]`` vectors, instead of several
``b x s x V`` (entropy) or ``b x s x V / tp`` (log-probs) float32 tensors; at 18k tokens and a
151,936-token vocabulary the old full-size copies came to ~44 GiB. The backward of
``token_logprobs`` recomputes each tile's softmax instead of keeping it, so it is bounded the same
way (plus the gradient itself, which has the logits' shape and dtype).
"""

from __future__ import annotations

from collections.abc import Iterator

import torch
from megatron.core import parallel_state
from megatron.core.tensor_parallel.cross_entropy import VocabParallelCrossEntropy
from megatron.core.tensor_parallel.utils import VocabUtility
from torch.autograd.function import once_differentiable

DEFAULT_CHUNK_TOKENS = 4096


def forward_logits(
    model, tokens_BS: torch.Tensor, padding_mask_BS: torch.Tensor | None = None
) -> torch.Tensor:
    """This rank's vocabulary shard of the logits, ``[b, s, V / tp]``.

    ``padding_mask_BS`` (bool, True at padded positions; `megatron_rl.model.router_padding.
    padding_mask_BS`) goes to megatron's MoE routers, which leave those tokens out of their
    expert-bias counts and aux losses; the logits do not depend on it."""
    batch, seq = tokens_BS.shape
    position_ids = torch.arange(seq, device=tokens_BS.device).expand(batch, seq)
    return model(
        input_ids=tokens_BS,
        position_ids=position_ids,
        attention_mask=None,
        padding_mask=padding_mask_BS,
    )


def token_logprobs(
    logits_BSv: torch.Tensor,
    tokens_BS: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """``[b, s - 1]`` float32 log-probs of ``tokens[:, 1:]`` under ``softmax(logits[:, :-1] / T)``.

    ``logits_BSv`` is this rank's vocabulary shard ``[b, s, V / tp]`` (any float dtype);
    ``tokens_BS`` the full-vocabulary ids ``[b, s]``. Per tile of at most ``chunk_tokens``
    positions (see ``_tiles``) a fresh float32 copy ``[c, r, V / tp]`` of ``logits / T`` goes
    through the steps of megatron's ``vocab_parallel_cross_entropy`` (``_tile_nll``: max,
    ``sum exp`` and the target logit all-reduced over the tensor-parallel group), which give
    ``-log p``. They work in place on that copy, so ``logits_BSv`` itself is never modified.

    Differentiable in ``logits_BSv``. The graph keeps only the logits (already alive as the
    model's output) and the tokens: backward recomputes each tile's softmax with the same kernel,
    so it allocates the ``[b, s, V / tp]`` gradient (logits' dtype, zero at the last position)
    plus one float32 tile at a time, not a float32 softmax of every token.

    With at most ``chunk_tokens`` positions (``b * (s - 1)``) the kernel sees exactly the tensor
    the unchunked computation would, so results and gradients are bitwise those of one unchunked
    call. With more, each token's numbers are still computed from its own row, but the order of a
    ``sum`` over the vocabulary may depend on how many rows share the call (CUDA's launch
    configuration; on CPU only a single-row tile of at least 32k entries split over threads), so
    they can differ at float32 rounding (~1e-6).
    """
    _check_chunk_tokens(chunk_tokens)
    return _TokenLogprobs.apply(logits_BSv, tokens_BS, temperature, chunk_tokens)


@torch.no_grad()
def token_entropy(
    logits_BSv: torch.Tensor,
    temperature: float = 1.0,
    *,
    chunk_tokens: int = DEFAULT_CHUNK_TOKENS,
) -> torch.Tensor:
    """``[b, s - 1]`` float32 entropy of ``softmax(logits[:, :-1] / T)``, from vocabulary shards.

    Per tile of at most ``chunk_tokens`` positions, with ``l = logits / T`` on this rank's shard:
    ``m = max l`` (all-reduce MAX over the tensor-parallel group), ``d = l - m``,
    ``Z = sum exp(d)`` and ``S = sum exp(d) * d`` (one all-reduce SUM of both), and

        ``H = -sum p log p = log Z - S / Z``  with ``p = exp(d) / Z``,

    i.e. ``log Z + m - sum p * l`` written on the shifted logits, which avoids cancelling ``m``
    against ``sum p * l``. The vocabulary is never gathered; the tile's float32 ``d`` and
    ``exp(d)`` (``2 x chunk_tokens x V / tp``) are the largest intermediates.
    """
    _check_chunk_tokens(chunk_tokens)
    batch, seq = logits_BSv.shape[:2]
    positions = max(seq - 1, 0)
    entropy_BT = torch.empty(batch, positions, dtype=torch.float32, device=logits_BSv.device)
    group = _tp_group()
    for rows, cols in _tiles(batch, positions, chunk_tokens):
        shifted = _float32_tile(logits_BSv, rows, cols, temperature)  # [c, r, v]: l
        max_ = shifted.amax(dim=-1)
        if group is not None:
            torch.distributed.all_reduce(max_, op=torch.distributed.ReduceOp.MAX, group=group)
        shifted.sub_(max_.unsqueeze(-1))  # d = l - m <= 0
        exp = torch.exp(shifted)
        sums = torch.stack([exp.sum(dim=-1), exp.mul_(shifted).sum(dim=-1)])  # Z, S
        del exp, shifted
        if group is not None:
            torch.distributed.all_reduce(sums, op=torch.distributed.ReduceOp.SUM, group=group)
        z, s = sums
        entropy_BT[rows, cols] = (torch.log(z) - s / z).transpose(0, 1)
    return entropy_BT


class _TokenLogprobs(torch.autograd.Function):
    """``token_logprobs`` per tile; backward recomputes each tile instead of saving its softmax."""

    @staticmethod
    def forward(ctx, logits_BSv, tokens_BS, temperature, chunk_tokens):
        ctx.save_for_backward(logits_BSv, tokens_BS)
        ctx.temperature, ctx.chunk_tokens = temperature, chunk_tokens
        batch, seq = tokens_BS.shape
        positions = max(seq - 1, 0)
        out_BT = torch.empty(batch, positions, dtype=torch.float32, device=logits_BSv.device)
        group = _tp_group()
        for rows, cols in _tiles(batch, positions, chunk_tokens):
            logits_TBv = _float32_tile(logits_BSv, rows, cols, temperature)
            nll_TB, _ = _tile_nll(logits_TBv, _target_tile(tokens_BS, rows, cols), group)
            out_BT[rows, cols] = -nll_TB.transpose(0, 1)
            del logits_TBv, nll_TB  # before the next tile is allocated
        return out_BT

    @staticmethod
    @once_differentiable
    def backward(ctx, grad_BT):
        logits_BSv, tokens_BS = ctx.saved_tensors
        logits_BSv = logits_BSv.detach()  # the recomputation below is a graph of its own
        temperature = ctx.temperature
        batch, seq = tokens_BS.shape
        positions = max(seq - 1, 0)
        grad_BSv = torch.empty_like(logits_BSv)  # the tiles below cover every row of [:, :-1]
        grad_BSv[:, positions:].zero_()  # the last position predicts nothing
        group = _tp_group()
        for rows, cols in _tiles(batch, positions, ctx.chunk_tokens):
            logits_TBv = _float32_tile(logits_BSv, rows, cols, temperature)
            _, saved = _tile_nll(logits_TBv, _target_tile(tokens_BS, rows, cols), group)
            # d(log p)/d(nll) = -1; the softmax tile becomes the gradient in place
            grad_TBv = _tile_nll_grad(saved, -grad_BT[rows, cols].transpose(0, 1))
            if _scales(temperature):
                grad_TBv.div_(temperature)  # as the autograd of ``logits / T`` would
            grad_BSv[rows, cols].copy_(grad_TBv.transpose(0, 1))  # casts to the logits' dtype
            del logits_TBv, saved, grad_TBv
        return grad_BSv, None, None, None


def _tile_nll(logits_TBv: torch.Tensor, target_TB: torch.Tensor, group) -> tuple:
    """``-log softmax(logits)[target]`` ``[c, r]`` of one float32 tile, and what its gradient
    needs; ``logits_TBv`` becomes the softmax in place.

    The forward of megatron's ``_VocabParallelCrossEntropy`` step by step (its own
    ``VocabParallelCrossEntropy`` kernels, so the arithmetic is megatron's), with the three
    all-reduces over the tensor-parallel ``group`` skipped when it is None (TP = 1: a reduction
    over one rank is the identity; at this model size the three gloo calls per tile cost more
    than the tile's arithmetic).
    """
    logits_TBv, max_TB = VocabParallelCrossEntropy.calculate_logits_max(logits_TBv)
    if group is not None:
        torch.distributed.all_reduce(max_TB, op=torch.distributed.ReduceOp.MAX, group=group)
    start, end = VocabUtility.vocab_range_from_per_partition_vocab_size(
        logits_TBv.size(-1),
        parallel_state.get_tensor_model_parallel_rank(),
        parallel_state.get_tensor_model_parallel_world_size(),
    )
    target_mask, masked_target_1d, predicted_TB, sum_exp_TB, exp_TBv = (
        VocabParallelCrossEntropy.calculate_predicted_logits(
            logits_TBv, target_TB, max_TB, start, end
        )
    )
    if group is not None:
        torch.distributed.all_reduce(predicted_TB, op=torch.distributed.ReduceOp.SUM, group=group)
        torch.distributed.all_reduce(sum_exp_TB, op=torch.distributed.ReduceOp.SUM, group=group)
    softmax_TBv, nll_TB = VocabParallelCrossEntropy.calculate_cross_entropy_loss(
        exp_TBv, predicted_TB, sum_exp_TB
    )
    return nll_TB, (softmax_TBv, target_mask, masked_target_1d)


def _tile_nll_grad(saved: tuple, grad_nll_TB: torch.Tensor) -> torch.Tensor:
    """``d nll / d logits`` ``[c, r, v]`` times ``grad_nll_TB``: megatron's backward of the same
    function (``softmax - onehot(target)`` on this shard), written into the saved softmax."""
    softmax_TBv, target_mask, masked_target_1d = saved
    grad_2d, arange_1d, softmax_update, grad_TBv = (
        VocabParallelCrossEntropy.prepare_gradient_calculation_operands(softmax_TBv, target_mask)
    )
    return VocabParallelCrossEntropy.calculate_gradients(
        grad_2d, arange_1d, masked_target_1d, softmax_update, grad_TBv, grad_nll_TB
    )


def _check_chunk_tokens(chunk_tokens) -> None:
    if isinstance(chunk_tokens, bool) or not isinstance(chunk_tokens, int) or chunk_tokens < 1:
        raise ValueError(f"chunk_tokens must be an integer >= 1, got {chunk_tokens!r}")


def _scales(temperature: float) -> bool:
    return temperature not in (0.0, 1.0)


def _tiles(batch: int, positions: int, chunk_tokens: int) -> Iterator[tuple[slice, slice]]:
    """``(rows, cols)`` tiles covering ``[batch, positions]``, each of at most ``chunk_tokens``.

    A tile takes ``r = min(batch, chunk_tokens)`` rows and ``chunk_tokens // r`` positions, so a
    batch of at most ``chunk_tokens`` tokens is one tile: the whole ``[:, :-1]`` slice.
    """
    if batch == 0 or positions == 0:
        return
    num_rows = min(batch, chunk_tokens)
    num_cols = max(1, chunk_tokens // num_rows)
    for r0 in range(0, batch, num_rows):
        for t0 in range(0, positions, num_cols):
            yield slice(r0, r0 + num_rows), slice(t0, min(t0 + num_cols, positions))


def _float32_tile(
    logits_BSv: torch.Tensor, rows: slice, cols: slice, temperature: float
) -> torch.Tensor:
    """A new contiguous float32 ``[c, r, v]`` copy of ``logits[rows, cols] / T`` (megatron's
    ``[s, b, v]`` layout); it never shares storage with ``logits_BSv``."""
    tile_TBv = logits_BSv[rows, cols].transpose(0, 1)
    out = torch.empty(tile_TBv.shape, dtype=torch.float32, device=tile_TBv.device)
    out.copy_(tile_TBv)
    if _scales(temperature):
        out.div_(temperature)
    return out


def _target_tile(tokens_BS: torch.Tensor, rows: slice, cols: slice) -> torch.Tensor:
    """``[c, r]`` next-token targets of the positions in ``cols``: ``tokens[rows, 1 + cols]``."""
    return tokens_BS[rows, 1:][:, cols].transpose(0, 1).contiguous()


def _tp_group():
    """The tensor-parallel group, or ``None`` at TP=1 (nothing to reduce)."""
    if parallel_state.get_tensor_model_parallel_world_size() == 1:
        return None
    return parallel_state.get_tensor_model_parallel_group()
