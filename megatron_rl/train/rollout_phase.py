"""The rollout phase of an RL step: generate, score, and turn samples into `TrainSample`s.

Runs on one rank per data-parallel replica (the model-parallel source rank); the others receive
the result by broadcast. Each replica generates only its own prompts, so each data-parallel rank
holds only its shard of samples and routes.
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
    params = SamplingParams(
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        max_new_tokens=config.max_response_length,
        stop_token_ids=(tokenizer.eos_token_id,),
        seed=seed,
    )
    n = config.n_samples_per_prompt
    generated = engine.generate(
        [list(r.prompt_ids) for r in records], params, n=n, return_routed_experts=return_routes
    )
    responses = [_decode(tokenizer, s.response_ids_R.tolist()) for s in generated]
    answers = [records[s.prompt_index].answer for s in generated]
    scored = compute_rewards(reward_fn, responses, answers)
    rewards = torch.tensor(scored.rewards, dtype=torch.float32)
    advantages, zero_variance = group_advantages(rewards, n, config.advantage_estimator)
    samples = [
        TrainSample(
            prompt_ids=s.prompt_ids_P.to(torch.int64),
            response_ids=s.response_ids_R.to(torch.int64),
            rollout_logprobs=s.logprobs_R.to(torch.float32),
            advantage=float(advantages[i]),
            reward=float(rewards[i]),
            in_loss=not (config.filter_zero_variance_groups and bool(zero_variance[i])),
            routes=s.routes,
            weight_version=s.weight_version,
        )
        for i, s in enumerate(generated)
    ]
    lengths = torch.tensor([float(s.response_ids_R.numel()) for s in generated])
    metrics = {
        "reward/mean": float(rewards.mean()),
        "reward/std": float(rewards.std(unbiased=False)),
        "accuracy": float((rewards > 0.5).float().mean()),
        "reward/failed_frac": sum(scored.failed) / len(generated),
        "response_length/mean": float(lengths.mean()),
        "response_length/max": float(lengths.max()),
        "rollout/truncated_frac": sum(s.finish_reason == "length" for s in generated)
        / len(generated),
        "rollout/zero_variance_group_frac": float(zero_variance.float().mean()),
        "rollout/weight_version": float(min(s.weight_version for s in generated)),
        # samples a server aborted (abort_all, a pause in abort mode) and generated again
        "rollout/aborted": float(engine.take_aborted()),
    }
    return RolloutResult(samples, metrics)


def _decode(tokenizer, ids: list[int]) -> str:
    """Decode a response; ids beyond the tokenizer (the model's vocabulary padding) are dropped.

    A model whose embedding table is padded (to a multiple of the tensor-parallel size) can
    sample those ids; they mean nothing, so the text (and the reward) ignores them.
    """
    return tokenizer.decode([i for i in ids if i < tokenizer.vocab_size])
