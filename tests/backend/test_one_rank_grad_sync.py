"""A data-parallel group of one rank reduces its gradients without a collective, to the same
bits as megatron's all-reduce / reduce-scatter (megatron_rl/backend/one_rank_grad_sync.py)."""

from __future__ import annotations

import contextlib

import pytest
import torch
from megatron.core import tensor_parallel
from megatron.core.distributed import finalize_model_grads
from megatron.core.distributed.param_and_grad_buffer import _ParamAndGradBucketGroup

from megatron_rl.backend.one_rank_grad_sync import OneRankBucketGroup
from megatron_rl.backend.optimizer import wrap_for_training
from megatron_rl.model import build_model, causal_lm_logits, preset_config

LAYOUTS = [
    {"use_distributed_optimizer": False, "overlap_grad_reduce": False},
    {"use_distributed_optimizer": True, "overlap_grad_reduce": False},
    {"use_distributed_optimizer": True, "overlap_grad_reduce": True},
]


def _reduced_grads(skip: bool, micro_batches: int, **layout) -> dict[str, torch.Tensor]:
    torch.manual_seed(0)
    tensor_parallel.model_parallel_cuda_manual_seed(0)  # the same initial weights in both arms
    config = preset_config("tiny")
    model = wrap_for_training(build_model(config), **layout)
    groups = [*model.bucket_groups, *model.expert_parallel_bucket_groups]
    assert groups and all(type(g) is OneRankBucketGroup for g in groups)
    if not skip:  # megatron's own method: the collective over the one-rank group
        for group in groups:
            group.__class__ = _ParamAndGradBucketGroup
    for step in range(2):  # the first batch and a later one (overlap: hooks launch the sync)
        model.zero_grad_buffer()
        for i in range(micro_batches):
            gen = torch.Generator().manual_seed(10 * step + i)
            tokens = torch.randint(0, config.vocab_size, (2, 9), generator=gen)
            last = i == micro_batches - 1
            with contextlib.nullcontext() if last else model.no_sync():
                logits = causal_lm_logits(model, tokens[:, :-1]).float()
                loss = torch.nn.functional.cross_entropy(
                    logits.reshape(-1, config.vocab_size), tokens[:, 1:].ravel()
                )
                loss.backward()
        finalize_model_grads([model])
    return {n: p.main_grad.clone() for n, p in model.named_parameters()}


@pytest.mark.parametrize("layout", LAYOUTS, ids=lambda x: "-".join(k for k in x if x[k]) or "plain")
def test_one_rank_reduction_leaves_the_collectives_bits(ws1, layout):
    got = _reduced_grads(True, micro_batches=2, **layout)
    want = _reduced_grads(False, micro_batches=2, **layout)
    assert got.keys() == want.keys()
    assert any(g.abs().sum() > 0 for g in want.values())
    for name in want:
        assert torch.equal(got[name], want[name]), name
