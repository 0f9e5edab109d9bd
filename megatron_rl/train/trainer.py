"""The RL trainer: rollout -> rewards -> old log-probs -> N updates -> weight sync, per step.

One screen per phase (see ``step``); the engine behind ``self.engine`` is configuration only, and
so is routing replay (``self.replay`` decides what each pass records or replays). Each component
is built from its own config (``TrainConfig.*_config()``).

Data parallelism: every data-parallel replica generates and trains on its own prompts; losses use
the global token/sequence counts of each optimizer step, so summing the replicas' gradients
(megatron's DDP averages, hence the ``* dp`` below) reproduces the full-batch gradient. Every
tensor the model, the loss or a collective sees is on ``self.device``.

Token balancing (`megatron_rl/train/balance.py`): with ``--balance-data`` the samples of every
mini-batch are gathered over the data-parallel ranks and re-split by token count (Karmarkar-Karp,
equal sample counts), so mini-batch ``j`` is the same global set and the step the same gradient;
with ``--max-tokens-per-gpu`` a rank's micro-batches are formed by a padded-token budget, so ranks
may run different numbers of micro-batches (the gradient reduction still happens once, after
each rank's last one). Micro-batches are padded; THD packing (cu_seqlens) needs Transformer
Engine's attention and is not implemented.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import time
from collections.abc import Callable

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.backend import destroy_distributed, init_distributed
from megatron_rl.backend.optimizer_config import step_lr
from megatron_rl.collectives import (
    all_gather_objects,
    all_ranks_agree,
    broadcast_object,
    max_over_ranks,
    mean_over_ranks,
    sum_over_ranks,
)
from megatron_rl.losses import rollout_correction
from megatron_rl.losses.clip_positions import clip_profile_from_counts
from megatron_rl.moe_layers import moe_layer_numbers, num_routed_experts
from megatron_rl.rollout.protocol import RolloutEngine
from megatron_rl.routing.passes import TokenLayout, build_replay_passes
from megatron_rl.threads import configure_threads
from megatron_rl.train.balance import karmarkar_karp, token_budget_micro_batches
from megatron_rl.train.batch import MicroBatch, TrainSample, make_micro_batch, split
from megatron_rl.train.colocate import Colocation, release_generation_memory
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.engines import build_engine
from megatron_rl.train.learning_guard import LearningGuard
from megatron_rl.train.logprobs import token_entropy, token_logprobs
from megatron_rl.train.merged_pass import forward_only_pass, forward_token_budget
from megatron_rl.train.nonfinite import NonFiniteGuard
from megatron_rl.train.objective import objective
from megatron_rl.train.offload import TrainerOffload
from megatron_rl.train.pipeline import run_pass
from megatron_rl.train.policy import build_policy, build_reference
from megatron_rl.train.rollout_dump import rollout_only_step
from megatron_rl.train.rollout_manager import RolloutManager, rank_place
from megatron_rl.train.sync_wait import SyncWait, remote_sync_timeout_s
from megatron_rl.train.task import Task, build_task
from megatron_rl.train.token_versions import fresh_token_mask, token_staleness_metrics
from megatron_rl.train.weight_publisher import PolicyShard, build_weight_publisher

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(
        self,
        config: TrainConfig,
        *,
        task: Task | None = None,
        rank=None,
        world_size=None,
        init_method=None,
    ):
        """``task``: the built task (`build_task`, e.g. by ``python -m megatron_rl.train``, which
        checks it before megatron starts); built here from ``config`` when None."""
        self.config = config
        parallel = config.parallel
        world = world_size if world_size is not None else _env_world_size()
        self.dp = config.data_parallel_size(world)  # validates before anything is built
        local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)  # ranks sharing this machine
        if config.rollout.schedule.overlap:  # each rank's generation thread shares the cores too
            local *= 2
        self.num_threads = configure_threads(config.runtime.torch_threads, local_processes=local)
        self.device = init_distributed(
            parallel,
            rank=rank,
            world_size=world,
            init_method=init_method,
            device=config.runtime.device,
        )
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.dp_group = parallel_state.get_data_parallel_group()
        self.mp_group = parallel_state.get_model_parallel_group()
        self.pp = parallel_state.get_pipeline_model_parallel_world_size()
        self.pp_group = parallel_state.get_pipeline_model_parallel_group()
        self.last_stage = parallel_state.is_pipeline_last_stage()
        self.mp_src = parallel_state.get_model_parallel_src_rank()
        self.is_generator = dist.get_rank() == self.mp_src
        self.seq_multiple = parallel.tensor_parallel if parallel.sequence_parallel else 1
        task = task if task is not None else build_task(config.task)
        self.tokenizer, self.hf_config = task.tokenizer, task.hf_config
        # remote servers first (an SGLang client touches no RNG): colocated, they release
        # their generation memory before the model is built; the in-process engine is built
        # after the model, whose initialisation it must not move
        engine_config = config.engine
        self.engine: RolloutEngine | None = self._build_engine() if engine_config.remote else None
        # remote servers receive the whole model from rank 0; an in-process engine, its own
        self.pushes_weights = engine_config.remote and dist.get_rank() == 0
        if engine_config.colocate:  # the servers leave the GPUs to the model about to be built
            release_generation_memory(self.engine if self.pushes_weights else None)
        self.model, self.optimizer = build_policy(config, self.hf_config, task.checkpoint_dir)
        self.objective = config.objective
        self.reference = build_reference(config, self.hf_config, self.model.module, self.device)
        self.replay = build_replay_passes(
            self.model,
            config.replay,
            num_experts=num_routed_experts(self.hf_config),
            topk=self.hf_config.num_experts_per_tok,
            moe_layer_numbers=moe_layer_numbers(self.hf_config),
            layout=TokenLayout(
                tp_size=parallel.tensor_parallel,
                tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                sequence_parallel=bool(parallel.sequence_parallel),
            ),
            pipeline_group=self.pp_group if self.pp > 1 else None,
        )
        self.nonfinite = NonFiniteGuard(config.schedule.max_bad_steps)
        self.learning = LearningGuard.from_config(config)
        if self.is_generator and not engine_config.remote:
            self.engine = self._build_engine()
            self.pushes_weights = True
        sync_timeout_s = remote_sync_timeout_s(config, self.hf_config)  # None: in-process
        # this rank's part in every weight sync, chosen once (train/weight_publisher.py)
        self.publisher = build_weight_publisher(
            engine_config,
            PolicyShard(self.model.module, self.hf_config),
            self.engine,
            owns_engine=self.pushes_weights,
            pipeline_group=self.pp_group if self.pp > 1 else None,
            timeout_s=sync_timeout_s,
        )
        self.step_index = 0
        self.weight_version = 0
        # prompts, generation schedule, refill, carry-over (train/rollout_manager.py)
        place = rank_place(self.dp, self.dp_rank, self.dp_group, self.mp_src, self.mp_group)
        self.rollouts = RolloutManager(config, task, self.engine, place)
        # remote: the other ranks wait for rank 0's push (see train/sync_wait.py)
        self.sync_wait = SyncWait(sync_timeout_s) if engine_config.remote else None
        self.colocation = self._colocation()  # --colocate: who holds the GPUs, when
        self.sync_weights(version=0)

    # ------------------------------------------------------------------ phases
    def step(self, should_stop: Callable[[], bool] | None = None) -> dict[str, float] | None:
        """One RL step; returns this step's metrics (averaged over all ranks).

        The rollout comes from ``self.rollouts`` (`megatron_rl.train.rollout_source`): generated
        now, or with ``--async-rollout`` generated while the previous step trained, the next one
        generating while this one trains (`megatron_rl.train.async_rollout`).
        ``should_stop`` (a collective, e.g. `PreemptionHandler.agreed`) is asked after the rollout
        and before every update, so a stop signal is served within one update, not one step:
        after the rollout the step is abandoned (the prompts are drawn again after a resume) and
        None is returned; before an update the remaining updates are skipped and the step ends.
        """
        if self.config.rollout.rollout_only:  # no update, no sync (train/rollout_dump.py)
            return rollout_only_step(self)
        start = time.perf_counter()
        if self.colocation is not None:  # the trainer leaves the GPUs to the servers
            self.colocation.before_rollout()
        batch = self.rollouts.take(self.step_index, self.weight_version)
        if self.colocation is not None:  # and takes them back
            self.colocation.before_train()
        if should_stop is not None and should_stop():
            self.rollouts.abandon(batch)  # drawn again after a resume
            return None
        metrics = batch.metrics
        metrics["time/rollout"] = time.perf_counter() - start
        if self.step_index + 1 < self.config.schedule.train_iters:  # not after the run's last step
            self.rollouts.start_next(self.step_index + 1)
        lr = step_lr(self.config.optimizer, self.step_index)
        self.optimizer.set_lr(lr)
        metrics["lr"] = lr
        train_start = time.perf_counter()
        metrics.update(self.train_on(batch.samples, should_stop))
        self.rollouts.finish(train=(train_start, time.perf_counter()))
        t = time.perf_counter()
        if self.colocation is not None:  # the servers load into their own weights
            self.colocation.before_sync()
        self.sync_weights(version=self.weight_version + 1)
        self.rollouts.resume()
        metrics["time/sync"] = time.perf_counter() - t
        metrics.update(self.sync_metrics)
        if self.colocation is not None:
            metrics.update(self.colocation.metrics())
        metrics.update(self.replay.metrics())
        self.replay.end_step()
        metrics["time/step"] = time.perf_counter() - start
        metrics.update(self.rollouts.step_metrics(metrics))
        metrics["staleness/updates_per_rollout"] = float(self.config.updates_per_rollout)
        self.step_index += 1
        reduced = mean_over_ranks(metrics)
        # the step's position-wise clip profile from its (averaged) counts, not mean fractions
        reduced.update(clip_profile_from_counts(reduced))
        self.learning.record(reduced, self.step_index)  # the same decision on every rank
        if self.learning.reward_exhausted:  # name the first error any generator rank saw
            errors = all_gather_objects(self.rollouts.reward_error)
            self.learning.first_error = next((e for e in errors if e is not None), None)
        return reduced

    def rollout(self) -> tuple[list[TrainSample], dict[str, float]]:
        """This data-parallel rank's samples of the next prompt batch, and rollout metrics."""
        batch = self.rollouts.take(self.step_index, self.weight_version)
        return batch.samples, batch.metrics

    def _build_engine(self) -> RolloutEngine:
        """The configured engine, once its servers answer (`train.engines.build_engine`)."""
        config = self.config
        engine = build_engine(
            config.engine, self.hf_config, self.tokenizer.pad_token_id, config.parallel.seed
        )
        # SGLang listens only once its model is loaded: wait before the first sync
        waited = engine.wait_until_ready()
        if waited > 1.0:
            logger.info("rollout servers ready after %.0f s", waited)
        return engine

    def _colocation(self) -> Colocation | None:
        """``--colocate`` (`megatron_rl.train.colocate`): the trainer's offload on every rank;
        the rank that pushes the weights also drives the servers' memory."""
        if not self.config.engine.colocate:
            return None
        offload = TrainerOffload(self.model, self.optimizer, device=self.device)
        return Colocation(offload, self.engine if self.pushes_weights else None)

    def train_on(
        self, samples: list[TrainSample], should_stop: Callable[[], bool] | None = None
    ) -> dict[str, float]:
        """Old-logprob pass and the N optimizer steps over this rank's ``samples``.

        Each data-parallel rank passes its own share of the global batch (consecutive chunks of
        ``global_batch_size / dp`` samples: chunk ``j`` of every rank makes mini-batch ``j``);
        returns this rank's metrics (not yet averaged over ranks). ``should_stop``: see `step`.
        """
        metrics: dict[str, float] = {}
        minibatches = split(samples, self.config.schedule.global_batch_size // self.dp)
        if self.config.schedule.balance_data and self.dp > 1:
            minibatches = self._balance(minibatches, metrics)
        batches = [self._micro_batches(minibatch) for minibatch in minibatches]
        real = sum(sum(mb.lengths) for row in batches for mb in row)
        padded = sum(mb.tokens_BS.numel() for row in batches for mb in row)
        metrics["batch/padding_waste"] = padded / real - 1.0 if real else 0.0  # pad per real token
        metrics["batch/micro_batches"] = float(sum(len(row) for row in batches))
        t = time.perf_counter()
        behaviour = self._old_logprob_pass(batches, metrics)
        metrics["time/old_logprob"] = time.perf_counter() - t
        t = time.perf_counter()
        for j, minibatch in enumerate(batches):
            if self.nonfinite.exhausted:  # the run stops after this step; apply nothing more
                _count(metrics, "update/skipped_stopping")
                continue
            if should_stop is not None and should_stop():
                _count(metrics, "update/skipped_preempted")
                continue
            self._update(j, minibatch, behaviour[j], metrics)
        metrics["time/update"] = time.perf_counter() - t
        if self.pp > 1:  # the losses, log-probs and entropies were computed on the last stage
            last = parallel_state.get_pipeline_model_parallel_last_rank()
            metrics = broadcast_object(metrics, src=last, group=self.pp_group)
        return metrics

    def _balance(self, minibatches: list[list[TrainSample]], metrics) -> list[list[TrainSample]]:
        """This rank's token-balanced share of every mini-batch (``--balance-data``).

        Mini-batch ``j`` is the union of every rank's chunk ``j``; it is gathered (samples with
        their routing blobs: every rank holds the whole rollout for a moment) and split by
        token count into ``dp`` parts of equal sample counts, the same on every rank (the
        partition is deterministic); rank ``r`` keeps part ``r``, longest samples first.
        """
        gathered = all_gather_objects(minibatches, group=self.dp_group)
        if len({len(theirs) for theirs in gathered}) != 1:
            raise RuntimeError(
                f"data-parallel ranks hold different numbers of mini-batches "
                f"{[len(theirs) for theirs in gathered]}; they must pass equal sample counts"
            )
        mine, before, after = [], [], []
        for j in range(len(minibatches)):
            chunks = [theirs[j] for theirs in gathered]
            pool = [sample for chunk in chunks for sample in chunk]
            parts = karmarkar_karp([s.length for s in pool], self.dp, equal_size=True)
            share = sorted(parts[self.dp_rank], key=lambda i: (-pool[i].length, i))
            mine.append([pool[i] for i in share])
            before.append(_imbalance([sum(s.length for s in chunk) for chunk in chunks]))
            after.append(_imbalance([sum(pool[i].length for i in part) for part in parts]))
        metrics["batch/dp_token_imbalance_unbalanced"] = sum(before) / len(before)
        metrics["batch/dp_token_imbalance"] = sum(after) / len(after)
        return mine

    def _micro_batches(self, samples: list[TrainSample]) -> list[MicroBatch]:
        """One mini-batch share as padded micro-batches on ``self.device``: ``micro_batch_size``
        rows each, or by token budget (``--max-tokens-per-gpu``; longest samples first)."""
        budget = self.config.schedule.token_budget
        if budget:
            groups = token_budget_micro_batches(
                [s.length for s in samples], budget, self.seq_multiple
            )
            chunks = [[samples[i] for i in group] for group in groups]
        else:
            chunks = split(samples, self.config.schedule.micro_batch_size)
        return [
            make_micro_batch(chunk, self.tokenizer.pad_token_id, self.seq_multiple).to(self.device)
            for chunk in chunks
        ]

    def _old_logprob_pass(self, batches, metrics) -> list[list[dict | None]]:
        """Per micro-batch: trainer log-probs, behaviour log-probs, weights/masks, ref log-probs.

        R2 records each micro-batch's routing here; R3 replays the engine's routes. With pipeline
        parallelism the entries exist on the last stage (elsewhere they are None); the
        reference's log-probs come from their own pass through the schedule.
        """
        flat = [mb for minibatch in batches for mb in minibatch]
        keys = [(j, i) for j, minibatch in enumerate(batches) for i in range(len(minibatch))]
        entries: list[dict | None] = [None] * len(flat)
        # per-token staleness (megatron_rl/train/token_versions.py): every stage holds the token
        # versions, so every stage checks them and reports the same keys, before any collective
        rollout = self.config.rollout
        metrics.update(
            token_staleness_metrics(
                [mb.token_versions_BT for mb in flat],
                [mb.loss_mask_BT for mb in flat],
                self.weight_version,
                rollout.max_staleness,
                mask_stale=rollout.mask_stale_tokens,
            )
        )
        # forward-only: the micro-batches run merged, up to this many padded tokens a forward
        merged = dict(
            max_tokens=forward_token_budget(self.config.schedule.token_budget),
            group=self.dp_group if self.dp > 1 else None,
        )
        gaps: list = [None] * len(flat)  # by index: merged forwards call on_logits out of order
        entropies: list = [None] * len(flat)
        refs: list = [None] * len(flat)
        if self.reference is not None:
            with self.reference.resident():
                refs = self.reference.logprobs(flat, self.config.rollout.temperature, **merged)

        def on_logits(k: int, logits: torch.Tensor) -> None:
            mb = flat[k]
            entry = self._behaviour_entry(mb, logits, refs[k])
            gaps[k] = (entry["old"] - mb.rollout_logprobs_BT)[mb.loss_mask_BT]
            entropies[k] = token_entropy(logits, self.config.rollout.temperature)[mb.loss_mask_BT]
            entries[k] = entry

        self.model.eval()
        with torch.no_grad():
            forward_only_pass(self.model, flat, keys, self.replay, on_logits, **merged)
        self.model.train()
        if self.last_stage:
            gap = torch.cat(gaps).clamp(-20, 20)  # log(pi_train / mu_rollout) per response token
            metrics["mismatch/train_rollout_logprob_abs_gap"] = float(gap.abs().mean())
            metrics["mismatch/train_rollout_k3"] = float((torch.expm1(-gap) + gap).mean())
            metrics["entropy"] = float(torch.cat(entropies).mean())
        out, k = [], 0
        for minibatch in batches:
            out.append(entries[k : k + len(minibatch)])
            k += len(minibatch)
        return out

    def _behaviour_entry(self, mb: MicroBatch, logits, ref_logprobs) -> dict:
        """What the updates of one micro-batch need from the old-logprob pass.

        ``--mask-stale-tokens``: tokens more than ``--max-staleness`` versions behind the
        trainer's version at this pass (``self.weight_version``, which the rollout's N updates
        share) leave the loss mask before the rollout correction sees it.
        """
        config = self.config
        old = token_logprobs(logits, mb.tokens_BS, config.rollout.temperature)
        behaviour = (
            old if config.objective.behavior_logprobs == "trainer" else mb.rollout_logprobs_BT
        )
        mask = mb.loss_mask_BT
        if config.rollout.mask_stale_tokens:
            fresh = fresh_token_mask(
                mb.token_versions_BT, self.weight_version, config.rollout.max_staleness
            )
            mask = mask & fresh
        entry = {"old": old, "behaviour": behaviour, "mask": mask, "weights": None}
        if config.objective.rollout_correction != "none":
            correction = rollout_correction(
                config.objective.rollout_correction,
                old_logprobs=old,
                rollout_logprobs=mb.rollout_logprobs_BT,
                loss_mask=mask,
            )
            entry.update(weights=correction.weights, mask=correction.loss_mask)
        if ref_logprobs is not None:
            entry["ref"] = ref_logprobs
        return entry

    def _update(self, j: int, minibatch: list[MicroBatch], behaviour: list, metrics) -> None:
        """One optimizer step over the micro-batches of mini-batch ``j``."""
        # this mini-batch's response tokens and sequences, summed over data-parallel ranks (the
        # masks live on the last pipeline stage; the other stages learn the totals from it)
        local = [0.0, 0.0]
        if self.last_stage:
            local = [
                sum(float(e["mask"].sum()) for e in behaviour),
                sum(float(e["mask"].any(dim=-1).sum()) for e in behaviour),
            ]
        num_tokens, num_seqs = sum_over_ranks(local, group=self.dp_group)
        if self.pp > 1:
            num_tokens, num_seqs = max_over_ranks([num_tokens, num_seqs], group=self.pp_group)
        if num_tokens == 0:
            _count(metrics, "update/skipped_empty")
            return
        self.optimizer.zero_grad()
        finite, loss_metrics = True, []

        def on_logits(i: int, logits: torch.Tensor) -> torch.Tensor | None:
            nonlocal finite
            entry, mb = behaviour[i], minibatch[i]
            logprobs = token_logprobs(logits, mb.tokens_BS, self.config.rollout.temperature)
            if not self.nonfinite.finite(logprobs, entry["mask"]):
                finite = False  # keep running forwards: peers wait in collectives
                return None
            out = objective(
                self.objective,
                logprobs_BT=logprobs,
                old_logprobs_BT=entry["behaviour"],
                advantages_B=mb.advantages_B,
                loss_mask_BT=entry["mask"],
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                token_weights_BT=entry["weights"],
                ref_logprobs_BT=entry.get("ref"),
            )
            loss_metrics.append(out.metrics)
            return out.loss * self.dp

        keys = [(j, i) for i in range(len(minibatch))]
        run_pass(self.model, minibatch, keys, self.replay, on_logits, phase="update")
        if all_ranks_agree(finite):
            grad_norm = self.optimizer.step()
        else:  # the reductions the backward launched still complete, on every rank and stage
            self.optimizer.skip()
            grad_norm = None
        self.nonfinite.record(grad_norm is not None, f"step {self.step_index} update {j}")
        if grad_norm is None:
            self.optimizer.zero_grad()
            _count(metrics, "update/skipped_nonfinite")
            return
        metrics["grad_norm"] = grad_norm
        _accumulate(metrics, loss_metrics, 1.0 / self.config.updates_per_rollout)

    # ------------------------------------------------------------------ helpers
    def sync_weights(self, version: int) -> None:
        """Push the policy to the engine as weight ``version`` (every rank streams its shard)."""
        self.publisher.publish(version)
        self.weight_version = version
        # remote server membership (dead servers are dropped, the run goes on): rank 0's
        # numbers on every rank, so every rank reports the same metric keys
        self.sync_metrics: dict[str, float] = {}
        if self.sync_wait is not None:
            membership = self.engine.membership_metrics() if self.pushes_weights else None
            self.sync_metrics = dict(self.sync_wait.share(membership) or {})

    def state_dict(self) -> dict:
        """The JSON state of a checkpoint (a collective with ``--carry-over-groups``: every
        data-parallel rank's carried groups are gathered)."""
        state = {
            "step": self.step_index,
            "weight_version": self.weight_version,
            "bad_steps": self.nonfinite.consecutive,
            "learning": self.learning.state_dict(),
            "config": _jsonable(dataclasses.asdict(self.config)),
        }
        state.update(self.rollouts.state_dict(self.step_index))
        return state

    def load_state_dict(self, state: dict) -> None:
        self.step_index = int(state["step"])
        self.rollouts.load_state_dict(state, self.step_index)
        self.nonfinite.consecutive = int(state.get("bad_steps", 0))
        # a checkpoint from before the guard: assume the run had learned (never a false stop)
        self.learning.load_state_dict(state.get("learning", {"signal_seen": True}))
        # the engine gets the restored weights under their version
        self.sync_weights(version=int(state["weight_version"]))

    def close(self) -> None:
        self.rollouts.close()  # a generation still running (an error mid-step) ends first
        if getattr(self, "colocation", None) is not None:  # the servers get back their memory
            self.colocation.close()
        self.replay.close()
        if getattr(self, "publisher", None) is not None:
            self.publisher.close()
        if self.engine is not None:
            self.engine.close()
        destroy_distributed()


def _env_world_size() -> int:
    return int(os.environ.get("WORLD_SIZE", 1))


def _count(metrics: dict, key: str) -> None:
    metrics[key] = metrics.get(key, 0.0) + 1


def _imbalance(tokens: list[int]) -> float:
    """Largest share over the mean share (1.0: perfectly balanced)."""
    mean = sum(tokens) / len(tokens)
    return max(tokens) / mean if mean else 1.0


def _accumulate(metrics: dict, loss_metrics: list[dict], weight: float) -> None:
    """Add the mean over micro-batches of every loss metric, scaled by ``weight``."""
    if not loss_metrics:
        return
    for key in loss_metrics[0]:
        values = [float(m[key]) for m in loss_metrics if key in m]
        metrics[key] = metrics.get(key, 0.0) + weight * sum(values) / len(values)


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
