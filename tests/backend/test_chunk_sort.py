"""The dispatcher's chunk sort as one gather is megatron's unfused sort, bit for bit."""

from __future__ import annotations

import importlib

import pytest
import torch
from megatron.core.transformer.moe import moe_utils

from megatron_rl.backend.chunk_sort import (
    TOKEN_DISPATCHER,
    chunk_gather_index,
    sort_chunks_by_index,
    use_gather_chunk_sort,
)
from megatron_rl.backend.without_te import define_missing_te_symbols


def _chunks(seed: int, chunks: int):
    gen = torch.Generator().manual_seed(seed)
    sizes = torch.randint(0, 6, (chunks,), generator=gen)
    sizes[0] = 0  # an empty chunk (an expert no token chose)
    order = torch.randperm(chunks, generator=gen)
    rows = int(sizes.sum())
    tokens = torch.randn(rows, 8, generator=gen, requires_grad=True)
    probs = torch.rand(rows, generator=gen, requires_grad=True)
    return tokens, probs, sizes, order


@pytest.mark.parametrize("seed", range(5))
def test_the_gather_equals_megatrons_split_and_cat_with_gradients(seed):
    tokens, probs, sizes, order = _chunks(seed, chunks=2 * 64)  # EP 2 x 64 local experts
    weight_out, weight_probs = torch.randn(tokens.shape), torch.randn(probs.shape)

    def run(sort):
        out, out_probs = sort(tokens, sizes, order, probs=probs)
        return (out, out_probs, *torch.autograd.grad(
            (out * weight_out).sum() + (out_probs * weight_probs).sum(), (tokens, probs)
        ))  # fmt: skip

    got_want = zip(run(sort_chunks_by_index), run(moe_utils.sort_chunks_by_idxs), strict=True)
    for got, want in got_want:
        assert torch.equal(got, want)
    out, none = sort_chunks_by_index(tokens, sizes, order)
    assert none is None and torch.equal(out, moe_utils.sort_chunks_by_idxs(tokens, sizes, order)[0])


def test_the_identity_order_returns_the_inputs_themselves():
    tokens, probs, sizes, _ = _chunks(0, chunks=64)
    out, out_probs = sort_chunks_by_index(tokens, sizes, torch.arange(64), probs=probs)
    assert out is tokens and out_probs is probs


def test_the_gather_index_lays_the_chunks_out_in_order():
    # chunks [0, 1], [2], [3, 4, 5] in the order 2, 0, 1
    index = chunk_gather_index(torch.tensor([2, 1, 3]), torch.tensor([2, 0, 1]), 6)
    assert index.tolist() == [3, 4, 5, 0, 1, 2]


def test_the_fused_path_stays_megatrons():
    define_missing_te_symbols()  # no TE here: megatron refuses the fused sort, and so do we
    tokens, _, sizes, order = _chunks(0, chunks=4)
    with pytest.raises(ValueError, match="fused_sort_chunks_by_index is not available"):
        sort_chunks_by_index(tokens, sizes, order, fused=True)


def test_models_built_without_te_use_the_gather(ws1, monkeypatch):
    from megatron_rl.model import build_model, preset_config

    dispatcher = importlib.import_module(TOKEN_DISPATCHER)
    monkeypatch.setattr(dispatcher, "sort_chunks_by_idxs", moe_utils.sort_chunks_by_idxs)
    build_model(preset_config("tiny"))
    assert dispatcher.sort_chunks_by_idxs is sort_chunks_by_index
    use_gather_chunk_sort()  # idempotent
    assert dispatcher.sort_chunks_by_idxs is sort_chunks_by_index
