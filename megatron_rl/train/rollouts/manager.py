"""Rollout scheduling as one subsystem: the trainer asks for a step's batch and gets it finished.

`RolloutManager` is built once from the config and owns everything between the prompt set and a
trained batch (slime's rollout manager plays the same part):

- prompt drawing and its per-rank split (each data-parallel rank its consecutive share);
- when the batch is generated: at the step (`SyncRollouts`), or ahead of it on a producer thread,
  K = ``--max-staleness`` batches deep, with partial rollouts paused at each sync
  (`megatron_rl.train.rollouts.async_rollout`);
- ``--dynamic-sampling``: the over-sampled first draw and the refill rounds that replace groups
  without signal (`megatron_rl.train.rollouts.dynamic_sampling`);
- ``--carry-over-groups``: the pool of unfinished groups that go on at the next rollout
  (`megatron_rl.train.rollouts.carry_over`);
- generation and scoring on the generator rank (the rollout's sampling seed, the rewards), and
  the samples shared with the other ranks of its model-parallel group;
- the resumable part of all this (sampler position, carried groups) in checkpoints.

The trainer calls `take` once per step, then `start_next` / `finish` / `resume` around its
update and weight sync, and reads `trained_prompts`; it never sees a sampler, a pool or a thread.
"""

from __future__ import annotations

import functools
import logging

from megatron_rl.collectives import all_gather_objects, broadcast_object
from megatron_rl.moe_layers import num_routed_experts
from megatron_rl.routing import RoutingCodec
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.rank_topology import RankTopology
from megatron_rl.train.rollout_function import (
    DEFAULT_ROLLOUT_FUNCTION,
    RolloutRequest,
    resolve_rollout_function,
)
from megatron_rl.train.rollouts.async_rollout import AsyncRollouts, generator_barrier
from megatron_rl.train.rollouts.carry_over import CarryOver
from megatron_rl.train.rollouts.config import check_custom_schedule
from megatron_rl.train.rollouts.dump import build_rollout_dump
from megatron_rl.train.rollouts.dynamic_sampling import DynamicSampling, first_draw
from megatron_rl.train.rollouts.phase import rollout_params, run_rollout_function, score_rollout
from megatron_rl.train.rollouts.source import RolloutBatch, RolloutHooks, SyncRollouts

logger = logging.getLogger(__name__)


class RolloutManager:
    """Hands the trainer finished batches (module docstring); one per rank."""

    def __init__(self, config: TrainConfig, task, engine, place: RankTopology) -> None:
        self.config = config
        self.place = place
        self.engine = engine
        self.tokenizer, self.records, self.reward_fn = task.tokenizer, task.records, task.reward_fn
        self.sampler = task.new_sampler()
        self.hf_config = task.hf_config
        self.rollout_function = self._rollout_function(task)  # (name, function)
        self.reward_error: str | None = None  # the latest rollout's first failed reward, if any
        self.trained_prompts: list[int] = []  # this rank's prompts of the last batch taken
        self._index = 0  # the rollout being taken (its refill rounds' sampling seeds)
        self.carry_over = self._carry_over()
        # --carry-over-groups: False until the pool holds its M carried groups (the first draw
        # after it is empty draws B + M prompts, later ones B)
        self.carry_primed = False
        self._share = functools.partial(broadcast_object, src=place.mp_src, group=place.mp_group)
        self.source = self._source()
        self.dynamic_sampling = self._dynamic_sampling()
        objective = config.objective
        if config.rollout.schedule.overlap and (
            objective.behavior_logprobs == "trainer" and objective.rollout_correction == "none"
        ):
            logger.warning(
                "--async-rollout with --behavior-logprobs trainer and no --rollout-correction: "
                "the loss's ratio is taken against the current weights, not the policy that "
                "generated the (one version old) samples; see "
                "megatron_rl/train/rollouts/async_rollout.py"
            )
        self.dump = build_rollout_dump(config, task, place)  # --save/--load-rollouts, or None

    # ------------------------------------------------------------------ the step's batch
    def take(self, index: int, weight_version: int) -> RolloutBatch:
        """Rollout ``index``'s batch for this rank, refilled (``--dynamic-sampling``)."""
        self._index = index
        if self.dump is not None and self.dump.replaying:  # the stored batch, nothing drawn
            batch, self.reward_error = self.dump.replay(index, self.sampler.state_dict())
            self.trained_prompts = batch.prompts
            return batch
        batch = self.source.take(index, weight_version)
        if self.dynamic_sampling is not None:  # drop groups without signal, refill the batch
            batch = self.dynamic_sampling.fill(batch)
        if self.dump is not None:  # --save-rollouts (train/rollouts/dump.py)
            self.dump.store(index, batch, self.reward_error)
        self.trained_prompts = batch.prompts
        if self.config.rollout.schedule.carry_over:  # the finished groups, not the drawn ones
            n = self.config.rollout.n_samples_per_prompt
            self.trained_prompts = [s.prompt_index for s in batch.samples[::n]]
        return batch

    def abandon(self, batch: RolloutBatch) -> None:
        """Forget ``batch`` and what was drawn ahead: a resume draws them again."""
        self.source.clear()
        self.sampler.load_state_dict(batch.sampler_before)

    def start_next(self, index: int) -> None:
        self.source.start_next(index)

    def finish(self, train: tuple[float, float]) -> None:
        self.source.finish(train=train)

    def resume(self) -> None:
        self.source.resume()

    def step_metrics(self, metrics: dict[str, float]) -> dict[str, float]:
        return self.source.step_metrics(metrics)

    def close(self) -> None:
        self.source.close()

    # ------------------------------------------------------------------ checkpoints
    def state_dict(self, step_index: int) -> dict:
        """Sampler position of the last trained batch, and (a collective with
        ``--carry-over-groups``) every data-parallel rank's carried groups."""
        state = {"sampler": self.source.trained_sampler_state()}
        if self.config.rollout.schedule.carry_over:
            mine = None
            if self.carry_over is not None:  # as of the last trained step
                mine = (self.place.dp_rank, self.carry_over.state_after(step_index - 1))
            pools = dict(p for p in all_gather_objects(mine) if p is not None)
            state["carry_over"] = [pools[r] for r in range(self.place.dp)]
        return state

    def load_state_dict(self, state: dict, step_index: int) -> None:
        self.source.clear()  # a batch drawn ahead (--async-rollout) is drawn again
        self.sampler.load_state_dict(state["sampler"])
        if not self.config.rollout.schedule.carry_over:
            return
        dp = self.place.dp
        pools = state.get("carry_over") or [{"groups": []}] * dp
        if len(pools) != dp:
            raise ValueError(
                f"the checkpoint carries groups of {len(pools)} data-parallel ranks, this "
                f"run has {dp}: resume --carry-over-groups runs at the same DP size"
            )
        self.carry_primed = bool(pools[0]["groups"])
        if self.carry_over is not None:
            self.carry_over.load_state_dict(pools[self.place.dp_rank], step_index - 1)

    # ------------------------------------------------------------------ parts
    def _source(self):
        """Rollouts generated when a step asks, or ahead of it (``--rollout-schedule async``)."""
        place, rollout = self.place, self.config.rollout
        schedule = rollout.schedule
        hooks = RolloutHooks(
            sampler=self.sampler,
            draw=self._draw_prompts,
            generate=self._generate if place.is_generator else None,
            share=self._share,
        )
        if not schedule.overlap:
            return SyncRollouts(hooks)
        # shared servers: rank 0's pause at the sync reaches every rank's requests
        shared = self.config.engine.remote
        return AsyncRollouts(
            hooks,
            max_staleness=rollout.max_staleness,
            last_index=self.config.schedule.train_iters,
            partial=schedule.partial,
            regenerate_stale=not schedule.carry_over,
            barrier=generator_barrier(place.is_generator) if shared else None,
        )

    def _dynamic_sampling(self) -> DynamicSampling | None:
        """The refill of ``--dynamic-sampling`` (`megatron_rl.train.rollouts.dynamic_sampling`), or
        None."""
        rollout, place = self.config.rollout, self.place
        if not rollout.dynamic_sampling:
            return None

        def generate(prompts: list[int], round_index: int):
            mine = self._generate(prompts, self._index, round_index) if place.is_generator else None
            return self._share(mine)

        return DynamicSampling(
            batch_groups=rollout.rollout_batch_size,
            group_size=rollout.n_samples_per_prompt,
            ratio=rollout.over_sampling_ratio,
            max_rounds=rollout.dynamic_sampling_max_rounds,
            drop_overlong=rollout.drop_overlong_groups,
            dp=place.dp,
            dp_rank=place.dp_rank,
            dp_group=place.dp_group if place.dp > 1 else None,
            draw=self._draw_prompts,
            generate=generate,
        )

    def _carry_over(self) -> CarryOver | None:
        """The generator's rollout pool of ``--carry-over-groups`` (None when off or not the
        generator rank); M and B must split evenly over data-parallel ranks."""
        rollout, dp = self.config.rollout, self.place.dp
        if not rollout.schedule.carry_over:
            return None
        if rollout.carry_over_groups % dp:
            raise ValueError(
                f"--carry-over-groups {rollout.carry_over_groups} does not split over "
                f"{dp} data-parallel ranks; use a multiple of {dp}"
            )
        if not self.place.is_generator:
            return None
        hf = self.hf_config
        codec = None
        if self.config.replay.mode == "r3":
            codec = RoutingCodec(
                num_routed_experts(hf),
                int(hf.num_experts_per_tok),
                self.config.engine.routing_dtype,
            )
        return CarryOver(
            self.engine,
            prompt_ids=lambda i: self.records[i].prompt_ids,
            batch_groups=rollout.rollout_batch_size // dp,
            carry_groups=rollout.carry_over_groups // dp,
            group_size=rollout.n_samples_per_prompt,
            round_tokens=rollout.round_tokens,
            max_response_length=rollout.max_response_length,
            codec=codec,
        )

    def _rollout_function(self, task):
        """``(name, function)`` of ``--rollout-function`` or, while it keeps its default, of the
        built-in task's own (`megatron_rl.train.rollout_function`)."""
        name = self.config.rollout.rollout_function
        if name == DEFAULT_ROLLOUT_FUNCTION and getattr(task, "rollout_function", None):
            name = task.rollout_function
        if name != DEFAULT_ROLLOUT_FUNCTION:
            check_custom_schedule(name, self.config.rollout.schedule)
        return name, resolve_rollout_function(name)

    def _draw_prompts(self, count: int | None = None) -> list[int]:
        """This data-parallel rank's share of the next ``count`` prompts (default: a rollout's,
        ``rollout_batch_size``, or its over-sampled first draw with ``--dynamic-sampling``, or
        the pool's M more with ``--carry-over-groups`` while it is empty)."""
        dp = self.place.dp
        if count is None:
            rollout = self.config.rollout
            count = rollout.rollout_batch_size
            if rollout.dynamic_sampling:
                count = first_draw(count, rollout.over_sampling_ratio, dp)
            if rollout.schedule.carry_over and not self.carry_primed:
                count += rollout.carry_over_groups
                self.carry_primed = True
        indices = self.sampler.next_batch(count)
        per_rank = count // dp
        return indices[self.place.dp_rank * per_rank : (self.place.dp_rank + 1) * per_rank]

    def _generate(self, mine: list[int], rollout_index: int, round_index: int = 0):
        """Generator rank: ``(samples, metrics)`` of prompts ``mine`` for rollout ``rollout_index``
        and its refill round ``round_index`` (together, its sampling seed)."""
        config = self.config
        seed = config.parallel.seed * 1_000_003 + rollout_index * 1009 + self.place.dp_rank
        if self.carry_over is not None:  # the pool's first finished groups
            params = rollout_params(config.rollout, self.tokenizer, seed)
            prompts, generated, pool_metrics = self.carry_over.generate(mine, rollout_index, params)
            result = score_rollout(
                generated,
                [self.records[i] for i in prompts],
                self.tokenizer,
                self.reward_fn,
                config.rollout,
                engine=self.engine,
                prompt_indices=prompts,
            )
            result.metrics.update(pool_metrics)
        else:  # --rollout-function (the task's own while at its default)
            name, fn = self.rollout_function
            records = [self.records[i] for i in mine]
            request = RolloutRequest(
                records=records,
                n=config.rollout.n_samples_per_prompt,
                engine=self.engine,
                params=rollout_params(config.rollout, self.tokenizer, seed + round_index * 7_919),
                return_routes=config.replay.mode == "r3",
                tokenizer=self.tokenizer,
                rollout=config.rollout,
                config=config,
            )
            vocab = int(self.hf_config.vocab_size)
            result = run_rollout_function(fn, name, request, self.reward_fn, vocab_size=vocab)
        if result.reward_error is not None:
            self.reward_error = result.reward_error
        return result.samples, result.metrics
