"""The rollout phase of an RL step: generate, score, and turn samples into `TrainSample`s.

Runs on one rank per data-parallel replica (the model-parallel source rank); the others receive
the result by broadcast. Each replica generates only its own prompts, so each data-parallel rank
holds only its shard of samples and routes.

A sample whose reward fails (the function raised, or returned NaN, inf or no number: see
`megatron_rl.rewards.compute_rewards`) leaves the loss (``in_loss=False``, advantage 0) and its
group's advantages and reward metrics are taken over the group's scored samples only, so a broken
score neither crashes the run nor drags its group's baseline. Whether a run goes on when too many
fail, or when nothing carries a signal, is `megatron_rl.train.learning_guard`'s decision.

Metrics (this replica's rollout; the trainer averages them over ranks):
    reward/mean, reward/std, accuracy: over the scored samples (accuracy: reward > 0.5); 0 when
        none was scored.
    reward/failed_frac: share of samples whose reward failed.
    rollout/zero_variance_group_frac: share of groups whose scored samples' rewards are all equal
        (a group of at most one scored sample included).
    rollout/learning_signal_frac: share of samples in the loss with a non-zero advantage; 0
        means this rollout gives the policy nothing to learn from.
    response_length/mean, response_length/max, rollout/truncated_frac, rollout/weight_version,
    rollout/aborted: generation statistics.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from megatron_rl.rewards import compute_rewards
from megatron_rl.rollout import SamplingParams
from megatron_rl.train.advantages import group_advantages
from megatron_rl.train.batch import TrainSample
from megatron_rl.train.rollout_config import RolloutConfig


@dataclass(slots=True)
class RolloutResult:
    samples: list[TrainSample]
    metrics: dict[str, float]
    reward_error: str | None = None  # the first failed reward's message, None if none failed


def run_rollout(
    engine,
    records,
    tokenizer,
    reward_fn,
    config: RolloutConfig,
    *,
    seed: int,
    return_routes: bool,
) -> RolloutResult:
    """Generate ``n`` samples for each record, reward them and compute group advantages."""
    generated = engine.generate(
        [list(r.prompt_ids) for r in records],
        rollout_params(config, tokenizer, seed),
        n=config.n_samples_per_prompt,
        return_routed_experts=return_routes,
    )
    return score_rollout(generated, records, tokenizer, reward_fn, config, engine=engine)


def rollout_params(config: RolloutConfig, tokenizer, seed: int) -> SamplingParams:
    """The rollout's sampling parameters (the training temperature, the length limit)."""
    return SamplingParams(
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        max_new_tokens=config.max_response_length,
        stop_token_ids=(tokenizer.eos_token_id,),
        seed=seed,
    )


def score_rollout(
    generated: list,
    records,
    tokenizer,
    reward_fn,
    config: RolloutConfig,
    *,
    engine,
    prompt_indices: list[int] | None = None,
) -> RolloutResult:
    """Reward generated samples (``n`` per record, prompt-major) into `TrainSample`s with group
    advantages, and the rollout metrics (``engine``: asked for its aborted-sample count;
    ``prompt_indices``: the records' dataset indices, kept in `TrainSample.prompt_index`)."""
    n = config.n_samples_per_prompt
    responses = [_decode(tokenizer, s.response_ids_R.tolist()) for s in generated]
    answers = [records[s.prompt_index].answer for s in generated]
    scored = compute_rewards(reward_fn, responses, answers)
    rewards = torch.tensor(scored.rewards, dtype=torch.float32)
    ok = ~torch.tensor(scored.failed, dtype=torch.bool)
    advantages, zero_variance = scored_group_advantages(rewards, ok, n, config.advantage_estimator)
    in_loss = ok & ~(zero_variance & config.filter_zero_variance_groups)
    samples = [
        TrainSample(
            prompt_ids=s.prompt_ids_P.to(torch.int64),
            response_ids=s.response_ids_R.to(torch.int64),
            rollout_logprobs=s.logprobs_R.to(torch.float32),
            advantage=float(advantages[i]),
            reward=float(rewards[i]),
            in_loss=bool(in_loss[i]),
            routes=s.routes,
            weight_version=s.weight_version,
            truncated=s.finish_reason == "length",
            weight_versions=tuple(s.weight_versions),  # per segment when it spans an update
            prompt_index=-1 if prompt_indices is None else prompt_indices[s.prompt_index],
        )
        for i, s in enumerate(generated)
    ]
    lengths = torch.tensor([float(s.response_ids_R.numel()) for s in generated])
    good = rewards[ok] if bool(ok.any()) else torch.zeros(1)  # no scored sample: zeros
    metrics = {
        "reward/mean": float(good.mean()),
        "reward/std": float(good.std(unbiased=False)),
        "accuracy": float((good > 0.5).float().mean()),
        "reward/failed_frac": scored.num_failed / len(generated),
        "rollout/learning_signal_frac": float((in_loss & (advantages != 0)).float().mean()),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in generated)
        / len(generated),
        "rollout/zero_variance_group_frac": float(zero_variance.float().mean()),
        "rollout/weight_version": float(min(s.weight_version for s in generated)),
        # samples a server aborted (abort_all, a pause in abort mode) and generated again
        "rollout/aborted": float(engine.take_aborted()),
    }
    first_error = next((e for e in scored.errors if e is not None), None)
    return RolloutResult(samples, metrics, first_error)


def scored_group_advantages(
    rewards_B: torch.Tensor, scored_B: torch.Tensor, group_size: int, estimator: str
) -> tuple[torch.Tensor, torch.Tensor]:
    """`group_advantages` with each group's statistics over its scored samples only.

    Args:
        rewards_B: float ``[num_groups * group_size]``, prompt-major; any value where unscored.
        scored_B: bool ``[num_groups * group_size]``: the sample's reward was computed.

    Returns:
        ``(advantages_B, zero_variance_B)``: an unscored sample has advantage 0 and its group's
        zero-variance flag; a group with at most one scored sample has zero variance.
    """
    if bool(scored_B.all()):
        return group_advantages(rewards_B, group_size, estimator)
    advantages_B = torch.zeros(rewards_B.shape, dtype=torch.float32)
    zero_variance_B = torch.ones(rewards_B.shape, dtype=torch.bool)
    for start in range(0, rewards_B.numel(), group_size):
        rows = torch.arange(start, start + group_size)
        kept = rows[scored_B[rows]]
        if kept.numel() == 0:
            continue
        group_adv, group_zero = group_advantages(rewards_B[kept], kept.numel(), estimator)
        advantages_B[kept] = group_adv
        zero_variance_B[rows] = bool(group_zero[0])
    return advantages_B, zero_variance_B


def _decode(tokenizer, ids: list[int]) -> str:
    """Decode a response; ids beyond the tokenizer (the model's vocabulary padding) are dropped.

    A model whose embedding table is padded (to a multiple of the tensor-parallel size) can
    sample those ids; they mean nothing, so the text (and the reward) ignores them.
    """
    return tokenizer.decode([i for i in ids if i < tokenizer.vocab_size])
