"""Token balancing keeps the update exact: same global mini-batches, global loss denominators.

Sixteen synthetic samples with a long tail of lengths (5 to 60 tokens) make N = 2 mini-batches
of 8. The reference is one rank, fixed micro-batches of 2 rows. Two gloo ranks then start from
the same weights and train on the same mini-batches:

* with ``--balance-data --max-tokens-per-gpu``: every mini-batch is re-split over the ranks by
  token count and cut into token-budget micro-batches (the ranks run different numbers of
  micro-batches); parameters and grad norm must equal the reference's to float tolerance, also
  with the distributed optimizer and overlapped gradient reduction, and with R3 routing replay
  (the routes travel with their samples);
* without balancing, rank 0 holds the long samples of every mini-batch (3x rank 1's tokens):
  still equal, because the loss divides by the mini-batch's global token count. The same run
  with per-rank denominators (the counts' all-reduce patched out) must differ: the test can
  tell.
"""

from __future__ import annotations

import os

import pytest
import torch
from qwen3_moe_testing import spawn_ranks

GLOBAL_BATCH = 8
VOCAB = 16  # the built-in task's tokenizer (the tiny model is sized to it); 0 is the pad id
OVERRIDES = dict(
    rollout_batch_size=4,
    n_samples_per_prompt=4,
    global_batch_size=GLOBAL_BATCH,
    micro_batch_size=2,
    max_response_length=64,
    # Adam divides by |g|: a gradient entry near 0 turns rounding noise (micro-batches of other
    # shapes sum in another order) into a full step; eps keeps such an entry's step small
    adam_eps=1e-6,
)
# per mini-batch: the first half (rank 0's slice without balancing) long, the second half short
LENGTHS = [
    *((4, 56), (6, 30), (3, 40), (5, 22), (2, 6), (3, 4), (1, 7), (4, 3)),
    *((5, 44), (2, 35), (7, 25), (3, 18), (2, 3), (1, 5), (3, 6), (2, 2)),
]


def _samples(replay: str) -> list:
    from megatron_rl.model import preset_config
    from megatron_rl.moe_layers import moe_layer_numbers
    from megatron_rl.routing.codec import RoutingCodec
    from megatron_rl.train.batch import TrainSample

    hf = preset_config("tiny")
    codec = RoutingCodec(hf.num_experts, hf.num_experts_per_tok)
    layers = len(moe_layer_numbers(hf))
    generator = torch.Generator().manual_seed(3)
    samples = []
    for i, (p, r) in enumerate(LENGTHS):
        routes = None
        if replay == "r3":
            scores = torch.rand(p + r - 1, layers, hf.num_experts, generator=generator)
            routes = codec.encode(scores.argsort(dim=-1)[..., : hf.num_experts_per_tok])
        samples.append(
            TrainSample(
                prompt_ids=torch.randint(1, VOCAB, (p,), generator=generator),
                response_ids=torch.randint(1, VOCAB, (r,), generator=generator),
                rollout_logprobs=-torch.rand(r, generator=generator) * 3,
                advantage=float(torch.randn(1, generator=generator)),
                reward=float(i % 2),
                in_loss=i != 5,
                routes=routes,
            )
        )
    return samples


def _train_worker(rank, world_size, init_method, tmp_dir, samples_path, overrides, local) -> None:
    from pathlib import Path

    from trainer_testing import rank_share, small_config

    import megatron_rl.backend.optimizer as optimizer_module
    import megatron_rl.train.trainer as trainer_module
    from megatron_rl.train.trainer import Trainer

    grads = []  # every update's reduced gradients (whole on every rank without the dist. opt.)
    finalize = optimizer_module.finalize_model_grads

    def recording_finalize(models, *args, **kwargs):
        finalize(models, *args, **kwargs)
        grads.append(
            {n: p.main_grad.detach().clone() for n, p in models[0].module.named_parameters()}
        )

    optimizer_module.finalize_model_grads = recording_finalize
    if local:  # per-rank loss denominators: the counts are not summed over ranks
        trainer_module.sum_over_ranks = lambda values, group=None: [float(v) for v in values]
    config = small_config(Path(tmp_dir), loss="grpo", **{**OVERRIDES, **overrides})
    trainer = Trainer(config, rank=rank, world_size=world_size, init_method=init_method)
    try:
        samples = torch.load(samples_path, weights_only=False)
        before = {
            k: v.clone() for k, v in trainer.model.module.state_dict().items() if torch.is_tensor(v)
        }
        share = rank_share(samples, rank, world_size, GLOBAL_BATCH)
        metrics = trainer.train_on(share)
        after = trainer.model.module.state_dict()
        torch.save(
            {
                "before": before,
                "after": {k: v for k, v in after.items() if torch.is_tensor(v)},
                "metrics": metrics,
                "grads": grads,
                "share_tokens": sum(s.length for s in share),
            },
            os.path.join(tmp_dir, f"result_rank{rank}.pt"),
        )
    finally:
        trainer.close()


def _run(tmp_path, name: str, world_size: int, samples_path: str, overrides: dict, local=False):
    folder = tmp_path / name
    folder.mkdir()
    spawn_ranks(_train_worker, folder, world_size, samples_path, overrides, local)
    return [
        torch.load(folder / f"result_rank{r}.pt", weights_only=False) for r in range(world_size)
    ]


def _same_update(one: dict, two: dict, whole_grads: bool = True) -> None:
    """Same gradients (first update: same starting weights) and grad norms to float tolerance;
    same parameters after both updates to a tolerance Adam allows: it divides by |g|, so the
    rounding of a near-zero gradient entry (micro-batches of other shapes sum in another order)
    moves that entry by a fraction of a step (1e-5 is 0.3% of one step at lr 3e-3)."""
    assert len(one["grads"]) == len(two["grads"]) == 2
    if whole_grads:
        for name, grad in one["grads"][0].items():
            torch.testing.assert_close(two["grads"][0][name], grad, rtol=1e-5, atol=1e-7)
    moved = 0
    for name, value in one["after"].items():
        if not value.is_floating_point():
            continue
        assert torch.equal(one["before"][name], two["before"][name]), name
        torch.testing.assert_close(two["after"][name], value, rtol=1e-5, atol=1e-5)
        moved += int(not torch.equal(value, one["before"][name]))
    assert moved > 0
    assert two["metrics"]["grad_norm"] == pytest.approx(one["metrics"]["grad_norm"], rel=1e-5)


def _max_param_diff(one: dict, two: dict) -> float:
    return max(
        float((two["after"][k] - v).abs().max())
        for k, v in one["after"].items()
        if v.is_floating_point()
    )


@pytest.mark.slow
@pytest.mark.distributed
@pytest.mark.parametrize(
    "options",
    [
        {},
        {"use_distributed_optimizer": True, "overlap_grad_reduce": True},
        {"routing_replay": "r3"},
    ],
    ids=["adam", "distributed_adam_overlap", "r3"],
)
def test_balanced_token_budget_update_equals_the_unbalanced_fixed_run(tmp_path, options):
    replay = options.get("routing_replay", "off")
    samples_path = str(tmp_path / "samples.pt")
    torch.save(_samples(replay), samples_path)
    (one,) = _run(tmp_path, "dp1", 1, samples_path, options)
    balanced = {**options, "balance_data": True, "max_tokens_per_gpu": 64}
    twos = _run(tmp_path, "dp2", 2, samples_path, balanced)
    # the ranks really were rebalanced, and cut into different numbers of micro-batches (5 and 6)
    assert twos[0]["metrics"]["batch/dp_token_imbalance_unbalanced"] > 1.4
    assert twos[0]["metrics"]["batch/dp_token_imbalance"] < 1.1
    counts = [two["metrics"]["batch/micro_batches"] for two in twos]
    assert counts[0] != counts[1], counts
    assert twos[0]["metrics"]["batch/padding_waste"] < one["metrics"]["batch/padding_waste"]
    for two in twos:
        _same_update(one, two, whole_grads=not options.get("use_distributed_optimizer"))


@pytest.mark.slow
@pytest.mark.distributed
def test_loss_denominators_are_global_under_unequal_token_shares(tmp_path):
    samples_path = str(tmp_path / "samples.pt")
    torch.save(_samples("off"), samples_path)
    (one,) = _run(tmp_path, "dp1", 1, samples_path, {})
    budget = {"max_tokens_per_gpu": 64}
    twos = _run(tmp_path, "dp2", 2, samples_path, budget)
    assert twos[0]["share_tokens"] > 3 * twos[1]["share_tokens"]  # unequal shares
    for two in twos:
        _same_update(one, two)
    # per-rank denominators would weight rank 1's few tokens 3x more: a different update
    local = _run(tmp_path, "dp2_local", 2, samples_path, budget, local=True)
    assert _max_param_diff(one, local[0]) > 1e-4
    grad = one["grads"][0]
    assert max(float((local[0]["grads"][0][k] - g).abs().max()) for k, g in grad.items()) > 1e-4
