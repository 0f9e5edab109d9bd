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
from megatron_rl.rollout import RolloutSample, SamplingParams
from megatron_rl.train.advantages import group_advantages
from megatron_rl.train.batch import TrainSample
from megatron_rl.train.rollout_function import (
    RolloutFunction,
    RolloutOutput,
    RolloutRequest,
    call_rollout_function,
)
from megatron_rl.train.rollouts.config import RolloutConfig


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
    request = RolloutRequest(
        records=records,
        n=config.n_samples_per_prompt,
        engine=engine,
        params=rollout_params(config, tokenizer, seed),
        return_routes=return_routes,
        tokenizer=tokenizer,
        rollout=config,
    )
    return score_rollout(
        single_turn_rollout(request), records, tokenizer, reward_fn, config, engine=engine
    )


def single_turn_rollout(request: RolloutRequest) -> list[RolloutSample]:
    """The built-in rollout function (``--rollout-function`` default): one ``generate`` of
    ``n`` samples per prompt; every response token trained, the run's reward scores them."""
    return request.engine.generate(
        [list(r.prompt_ids) for r in request.records],
        request.params,
        n=request.n,
        return_routed_experts=request.return_routes,
    )


def run_rollout_function(
    fn: RolloutFunction,
    name: str,
    request: RolloutRequest,
    reward_fn,
    *,
    vocab_size: int,
) -> RolloutResult:
    """`run_rollout` with rollout function ``fn`` (named ``name`` in errors): its samples checked
    (`megatron_rl.train.rollout_function.check_outputs`), then scored like the built-in's."""
    outputs = call_rollout_function(fn, name, request, vocab_size=vocab_size)
    return score_rollout(
        outputs,
        request.records,
        request.tokenizer,
        reward_fn,
        request.rollout,
        engine=request.engine,
    )


def rollout_params(config: RolloutConfig, tokenizer, seed: int) -> SamplingParams:
    """The rollout's sampling parameters (the training temperature, the length limit)."""
    return SamplingParams(
        temperature=config.temperature,
        top_p=config.top_p,
        top_k=config.top_k,
        max_new_tokens=config.max_response_length,
        stop_token_ids=(tokenizer.eos_token_id,),
        seed=seed,
        return_sampling_support=config.logprobs_on_sampling_support,
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
    """Reward generated samples (``n`` per record, prompt-major; engine `RolloutSample`s or a
    rollout function's `RolloutOutput`s, whose loss masks and own rewards are kept) into
    `TrainSample`s with group advantages, and the rollout metrics (``engine``: asked for its
    aborted-sample count; ``prompt_indices``: the records' dataset indices, kept in
    `TrainSample.prompt_index`)."""
    n = config.n_samples_per_prompt
    outputs = [g if isinstance(g, RolloutOutput) else RolloutOutput(sample=g) for g in generated]
    generated = [o.sample for o in outputs]
    rewards, failed, errors = _rewards(outputs, records, tokenizer, reward_fn)
    ok = ~failed
    advantages, zero_variance = scored_group_advantages(rewards, ok, n, config.advantage_estimator)
    in_loss = ok & ~(zero_variance & config.filter_zero_variance_groups)
    advantage_list, reward_list, in_loss_list = (
        advantages.tolist(),
        rewards.tolist(),
        in_loss.tolist(),
    )
    masks = _partial_masks([o.loss_mask_R for o in outputs])  # None: every token trained
    if config.logprobs_on_sampling_support:
        _check_supports(generated)
    samples = []
    for i, (s, mask) in enumerate(zip(generated, masks, strict=True)):
        samples.append(
            TrainSample(
                prompt_ids=s.prompt_ids_P.to(torch.int64),
                response_ids=s.response_ids_R.to(torch.int64),
                rollout_logprobs=_behaviour_logprobs(s.logprobs_R, mask),
                advantage=advantage_list[i],
                reward=reward_list[i],
                in_loss=in_loss_list[i],
                routes=s.routes,
                weight_version=s.weight_version,
                truncated=s.finish_reason == "length",
                weight_versions=tuple(s.weight_versions),  # per segment when it spans an update
                prompt_index=-1 if prompt_indices is None else prompt_indices[s.prompt_index],
                response_mask=mask,
                support_RK=s.support_RK,
            )
        )
    lengths = torch.tensor([float(s.response_ids_R.numel()) for s in generated])
    good = rewards[ok] if bool(ok.any()) else torch.zeros(1)  # no scored sample: zeros
    metrics = {
        "reward/mean": float(good.mean()),
        "reward/std": float(good.std(unbiased=False)),
        "accuracy": float((good > 0.5).float().mean()),
        "reward/failed_frac": int(failed.sum()) / len(generated),
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
    first_error = next((e for e in errors if e is not None), None)
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


def _rewards(outputs: list[RolloutOutput], records, tokenizer, reward_fn):
    """``(rewards_B float32, failed_B bool, errors)``: a sample's own reward where its rollout
    function gave one, else ``reward_fn`` on its decoded response (`compute_rewards`)."""
    rewards = [o.reward for o in outputs]
    errors: list[str | None] = [None] * len(outputs)
    failed = [False] * len(outputs)
    todo = [i for i, r in enumerate(rewards) if r is None]
    if todo:
        responses = [_decode(tokenizer, outputs[i].sample.response_ids_R.tolist()) for i in todo]
        answers = [records[outputs[i].sample.prompt_index].answer for i in todo]
        scored = compute_rewards(reward_fn, responses, answers)
        for k, i in enumerate(todo):
            rewards[i], failed[i], errors[i] = scored.rewards[k], scored.failed[k], scored.errors[k]
    return (
        torch.tensor(rewards, dtype=torch.float32),
        torch.tensor(failed, dtype=torch.bool),
        errors,
    )


def _check_supports(generated: list) -> None:
    """ValueError unless every sample carries its tokens' sampling supports: without them the
    trainer would compare full-vocabulary log-probs with the engine's renormalised ones."""
    for s in generated:
        if s.support_RK is None:
            raise ValueError(
                f"--logprobs-on-sampling-support: sample (prompt {s.prompt_index}, sample "
                f"{s.sample_index}) has no support_RK; the rollout function must keep the "
                "engine's RolloutSample.support_RK (one row per response token) or run without "
                "the option"
            )


def _behaviour_logprobs(logprobs_R: torch.Tensor, mask_R: torch.Tensor | None) -> torch.Tensor:
    """float32 ``[R]``: the engine's log-probs of trained tokens, 0 on masked ones (a tool's
    tokens, which the policy did not sample: never behaviour log-probs); ``mask_R`` None: all
    trained."""
    logprobs_R = logprobs_R.to(torch.float32)
    if mask_R is None:
        return logprobs_R
    return torch.where(mask_R, logprobs_R, torch.zeros_like(logprobs_R))


def _partial_masks(masks: list[torch.Tensor | None]) -> list[torch.Tensor | None]:
    """The response mask each `TrainSample` keeps: None when every token is trained (one
    reduction over all the masks, not one per sample)."""
    given = [i for i, mask_R in enumerate(masks) if mask_R is not None]
    out: list[torch.Tensor | None] = [None] * len(masks)
    if not given:
        return out
    flat = torch.cat([masks[i] for i in given]).bool()  # [R] each
    owner = torch.repeat_interleave(
        torch.arange(len(given)), torch.tensor([masks[i].numel() for i in given])
    )
    untrained = torch.zeros(len(given), dtype=torch.int64).index_add_(0, owner, (~flat).long())
    for i, count in zip(given, untrained.tolist(), strict=True):
        if count:
            out[i] = masks[i].clone()
    return out


def _decode(tokenizer, ids: list[int]) -> str:
    """Decode a response; ids beyond the tokenizer (the model's vocabulary padding) are dropped.

    A model whose embedding table is padded (to a multiple of the tensor-parallel size) can
    sample those ids; they mean nothing, so the text (and the reward) ignores them.
    """
    return tokenizer.decode([i for i in ids if i < tokenizer.vocab_size])
