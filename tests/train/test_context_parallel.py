"""Context parallelism leaves every loss unchanged: sharded by megatron's own
``get_batch_on_this_cp_rank`` over 2 and 4 gloo ranks, gathered by `gather_sequence`, each
registered loss (and the KL term) gives the unsharded value and, summed over ranks, the unsharded
gradient. Transformer Engine's ring attention is CUDA only, so the model is left out: the
per-token log-probs stand for its output."""

from __future__ import annotations

import pytest
import torch
import torch.distributed as dist

from megatron_rl.losses import available_losses
from megatron_rl.train.context_parallel import gather_sequence, loss_scale, shard_sequence
from megatron_rl.train.objective import ObjectiveConfig, objective

B, T = 3, 16
AGG_MODES = ("token-mean", "seq-mean-token-mean", "seq-mean-token-sum")


def full_inputs(seed: int) -> dict[str, torch.Tensor]:
    gen = torch.Generator().manual_seed(seed)
    old = -torch.rand(B, T, generator=gen, dtype=torch.float64) * 3
    mask = torch.zeros(B, T, dtype=torch.bool)
    for row, (start, end) in enumerate([(2, 15), (5, 9), (1, 16)]):
        mask[row, start:end] = True
    return {
        "logprobs": old + 0.3 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        "old": old,
        "ref": old + 0.2 * torch.randn(B, T, generator=gen, dtype=torch.float64),
        "mask": mask,
        "advantages": torch.randn(B, generator=gen, dtype=torch.float64),
    }


def run_objective(config, inputs, logprobs, num_tokens, num_seqs):
    return objective(
        config,
        logprobs_BT=logprobs,
        old_logprobs_BT=inputs["old"],
        advantages_B=inputs["advantages"],
        loss_mask_BT=inputs["mask"],
        num_tokens=num_tokens,
        num_seqs=num_seqs,
        ref_logprobs_BT=inputs["ref"] if config.kl_coef else None,
    ).loss


def cp_worker(rank: int, world_size: int, init_method: str) -> None:
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=init_method, rank=rank, world_size=world_size)
    try:
        group = dist.group.WORLD
        for case, (loss, agg, kl) in enumerate(_cases()):
            config = ObjectiveConfig(loss=loss, loss_agg_mode=agg, kl_coef=kl)
            inputs = full_inputs(seed=case)
            num_tokens = float(inputs["mask"].sum())
            num_seqs = float(inputs["mask"].any(-1).sum())
            full_lp = inputs["logprobs"].clone().requires_grad_()
            want = run_objective(config, inputs, full_lp, num_tokens, num_seqs)
            want.backward()

            per_token = {k: v for k, v in inputs.items() if k != "advantages"}
            local = shard_sequence(per_token, group)
            local_lp = local["logprobs"].clone().requires_grad_()
            gathered = {k: gather_sequence(v, group) for k, v in local.items()}
            gathered["advantages"] = inputs["advantages"]
            got = run_objective(
                config, gathered, gather_sequence(local_lp, group), num_tokens, num_seqs
            )
            got.backward()
            assert torch.allclose(got, want, rtol=1e-12, atol=1e-12), (loss, agg, got, want)
            # the gradient of every rank's own positions, reassembled, is the full gradient
            grad = gather_sequence(local_lp.grad, group)
            assert torch.allclose(grad, full_lp.grad, rtol=1e-10, atol=1e-12), (loss, agg, kl)
            mine = shard_sequence({"g": full_lp.grad}, group)["g"]
            assert torch.equal(local_lp.grad, mine)  # nothing of another rank's positions
    finally:
        dist.destroy_process_group()


def _cases():
    for loss in available_losses():
        for agg in AGG_MODES:
            yield loss, agg, 0.0
    yield "grpo", "token-mean", 0.1
    yield "vespo", "seq-mean-token-mean", 0.05


@pytest.mark.distributed
@pytest.mark.parametrize("cp", [2, 4])
def test_every_loss_is_unchanged_under_context_parallel_sharding(cp, tmp_path):
    init_method = f"file://{tmp_path}/rendezvous"
    torch.multiprocessing.spawn(cp_worker, args=(cp, init_method), nprocs=cp)


def test_rank_r_holds_chunks_r_and_its_mirror_and_the_loss_scale_undoes_ddps_mean():
    from megatron_rl.train.context_parallel import _chunk_order

    assert [_chunk_order(4, r) for r in range(4)] == [(0, 7), (1, 6), (2, 5), (3, 4)]
    assert loss_scale(dp=8, cp=2) == 16


def test_a_sequence_not_divisible_by_twice_cp_is_refused(tmp_path):
    dist.init_process_group("gloo", init_method=f"file://{tmp_path}/rdzv", rank=0, world_size=1)
    try:
        sharded = shard_sequence({"x": torch.arange(6).view(1, 6)}, dist.group.WORLD)
        assert torch.equal(sharded["x"], torch.arange(6).view(1, 6))  # cp = 1: unchanged
        with pytest.raises(ValueError, match=r"x: sequence length 5 .* multiple of 2 x"):
            shard_sequence({"x": torch.zeros(1, 5)}, dist.group.WORLD)
    finally:
        dist.destroy_process_group()
