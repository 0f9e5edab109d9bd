"""Two gloo ranks, each holding half of the sequences, reproduce the full-batch gradient of a
small policy when losses use global denominators and gradients are all-reduced with SUM."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist
from forked_ranks import forkserver_context

from megatron_rl.losses import compute_policy_loss

pytestmark = pytest.mark.distributed

NUM_SEQS, MAX_LEN, VOCAB, HIDDEN = 8, 12, 11, 6


def _data(seed: int = 0):
    gen = torch.Generator().manual_seed(seed)
    features = torch.randn(NUM_SEQS, MAX_LEN, HIDDEN, generator=gen, dtype=torch.float64)
    tokens = torch.randint(0, VOCAB, (NUM_SEQS, MAX_LEN), generator=gen)
    lengths = torch.randint(2, MAX_LEN + 1, (NUM_SEQS,), generator=gen)
    mask = torch.arange(MAX_LEN)[None] < lengths[:, None]
    advantages = torch.randn(NUM_SEQS, generator=gen, dtype=torch.float64)
    weight = torch.randn(HIDDEN, VOCAB, generator=gen, dtype=torch.float64) * 0.3
    old_weight = weight + 0.05 * torch.randn(HIDDEN, VOCAB, generator=gen, dtype=torch.float64)
    return features, tokens, mask, advantages, weight, old_weight


def _logprobs(weight, features, tokens):
    return torch.log_softmax(features @ weight, -1).gather(-1, tokens[..., None]).squeeze(-1)


def _grad(name, mode, rows, global_counts):
    features, tokens, mask, adv, weight, old_weight = _data()
    weight = weight.clone().requires_grad_()
    with torch.no_grad():
        old = _logprobs(old_weight, features[rows], tokens[rows])
    out = compute_policy_loss(
        name,
        logprobs=_logprobs(weight, features[rows], tokens[rows]),
        old_logprobs=old,
        advantages=adv[rows],
        loss_mask=mask[rows],
        loss_agg_mode=mode,
        **global_counts,
    )
    out.loss.backward()
    return weight.grad, mask


def _worker(rank: int, init_method: str, cases, queue) -> None:
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=2)
    try:
        results = []
        for name, mode in cases:
            _, mask = _grad(name, mode, slice(0, 1), {})
            counts = dict(
                global_num_tokens=int(mask.sum()), global_num_seqs=int(mask.any(-1).sum())
            )
            rows = slice(0, NUM_SEQS // 2) if rank == 0 else slice(NUM_SEQS // 2, NUM_SEQS)
            grad, _ = _grad(name, mode, rows, counts)
            dist.all_reduce(grad, op=dist.ReduceOp.SUM)
            full, _ = _grad(name, mode, slice(0, NUM_SEQS), {})
            results.append((name, mode, (grad - full).abs().max().item(), full.abs().max().item()))
        queue.put((rank, results))
    finally:
        dist.destroy_process_group()


@pytest.mark.slow
def test_two_rank_data_parallel_matches_full_batch_gradient(tmp_path):
    cases = [
        ("grpo", "seq-mean-token-mean"),
        ("dapo", "token-mean"),
        ("vespo", "token-mean"),
        ("epic", "seq-mean-token-mean"),
        ("gspo", "seq-mean-token-sum"),
        ("topr", "seq-mean-token-sum-norm"),
    ]
    ctx = forkserver_context()  # ranks forked from a pre-imported server (tests/forked_ranks.py)
    queue = ctx.Queue()
    init_method = f"file://{tmp_path}/rdzv"  # a file rendezvous: no port to pick
    procs = [ctx.Process(target=_worker, args=(rank, init_method, cases, queue)) for rank in (0, 1)]
    for p in procs:
        p.start()
    outputs = dict(queue.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(timeout=60)
        assert p.exitcode == 0
    for rank in (0, 1):
        for name, mode, diff, scale in outputs[rank]:
            assert scale > 0, (name, mode)
            assert diff <= 1e-12 * max(1.0, scale), (rank, name, mode, diff)
