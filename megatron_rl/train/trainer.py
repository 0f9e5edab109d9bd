"""The RL trainer: rollout -> rewards -> old log-probs -> N updates -> weight sync, per step.

One screen per phase (see ``step``); the engine behind ``self.engine`` is configuration only, and
so is routing replay (``self.replay`` decides what each pass records or replays). Each component
is built from its own config (``TrainConfig.*_config()``).

Data parallelism: every data-parallel replica generates and trains on its own prompts; losses use
the global token/sequence counts of each optimizer step, so summing the replicas' gradients
(megatron's DDP averages, hence the ``* dp`` below) reproduces the full-batch gradient. Every
tensor the model, the loss or a collective sees is on ``self.device``.

Batching, token balancing and padding: `megatron_rl/train/minibatches.py`; the old-logprob pass:
`megatron_rl/train/old_logprob.py`; this rank's process groups: `RankTopology`.
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

from megatron_rl import stop_signal
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
from megatron_rl.lora.checkpoint import base_identity, check_same_base
from megatron_rl.losses.clip_positions import clip_profile_from_counts
from megatron_rl.model.chunks import as_chunks
from megatron_rl.moe_layers import moe_layer_numbers, num_routed_experts
from megatron_rl.rollout.build import ready_engine
from megatron_rl.rollout.protocol import RolloutEngine
from megatron_rl.routing.passes import TokenLayout, build_replay_passes
from megatron_rl.threads import configure_threads
from megatron_rl.train.batch import MicroBatch, TrainSample
from megatron_rl.train.colocate import Colocation, release_generation_memory
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.distillation_kl import topk_kl
from megatron_rl.train.learning_guard import LearningGuard
from megatron_rl.train.minibatches import plan_minibatches
from megatron_rl.train.nonfinite import NonFiniteGuard
from megatron_rl.train.objective import objective
from megatron_rl.train.offload import TrainerOffload
from megatron_rl.train.old_logprob import OldLogprobs, fold_blocker, old_logprob_pass
from megatron_rl.train.pipeline import run_pass
from megatron_rl.train.policy import build_policy, build_reference
from megatron_rl.train.rank_topology import RankTopology
from megatron_rl.train.ratio_quantiles import NUM_BINS, log_ratio_counts, quantile_metrics
from megatron_rl.train.rollouts.dump import rollout_only_step
from megatron_rl.train.rollouts.manager import RolloutManager
from megatron_rl.train.support_logprobs import policy_logprobs
from megatron_rl.train.sync_wait import SyncWait, remote_sync_timeout_s
from megatron_rl.train.task import Task, build_task
from megatron_rl.train.teacher import Teacher, distillation_advantages
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
        world = world_size if world_size is not None else _env_world_size()
        dp = config.data_parallel_size(world)  # validates before anything is built
        self.num_threads = _configure_threads(config, world)
        device = config.runtime.device
        self.device = init_distributed(
            config.parallel, rank=rank, world_size=world, init_method=init_method, device=device
        )
        self.ranks = RankTopology.current(dp, config.parallel)
        task = task if task is not None else build_task(config.task)
        self.tokenizer, self.hf_config = task.tokenizer, task.hf_config
        # remote servers first (an SGLang client touches no RNG): colocated, they release their
        # generation memory before the model is built; the in-process engine is built after the
        # model, whose initialisation it must not move. Remote servers receive the whole model
        # from rank 0; an in-process engine, its own generator rank's.
        remote = config.engine.remote
        self.engine: RolloutEngine | None = self._build_engine() if remote else None
        self.pushes_weights = remote and dist.get_rank() == 0
        if config.engine.colocate:  # the servers leave the GPUs to the model about to be built
            self.generation_bytes = release_generation_memory(
                self.engine if self.pushes_weights else None, device=self.device
            )
        self.model, self.optimizer = build_policy(config, self.hf_config, task.checkpoint_dir)
        self.lora_base = (  # the base a LoRA checkpoint's adapters must resume on
            base_identity(task.checkpoint_dir, self.hf_config, config.parallel.seed)
            if config.lora.enabled
            else None
        )
        self.objective = config.objective
        self.reference = build_reference(config, self.hf_config, self.model.module, self.device)
        self.replay = self._build_replay()
        # the first update's old log-probs from its own forward (train/old_logprob.py), or why not
        blocker = fold_blocker(config, self.model.module.config)
        self.fold_first_update = blocker is None
        if blocker is not None and config.objective.first_update_old_logprobs == "update":
            logger.info("old log-probs: every update's from the old-logprob pass (%s)", blocker)
        # --loss-teacher: the distillation teacher, built beside the policy (train/teacher.py)
        self.teacher = (
            Teacher(config.teacher, int(self.hf_config.vocab_size))
            if config.teacher.enabled
            else None
        )
        self.nonfinite = NonFiniteGuard(config.schedule.max_bad_steps)
        self.learning = LearningGuard.from_config(config)
        if self.ranks.is_generator and not remote:
            self.engine, self.pushes_weights = self._build_engine(), True
        sync_timeout_s = remote_sync_timeout_s(config, self.hf_config)  # None: in-process
        # this rank's part in every weight sync, chosen once (train/weight_publisher.py)
        self.publisher = build_weight_publisher(
            config.engine,
            PolicyShard(self.model.module, self.hf_config),
            self.engine,
            owns_engine=self.pushes_weights,
            pipeline_group=self.ranks.pipeline_group,
            timeout_s=sync_timeout_s,
            adapter_sync=config.lora.lora_sync == "adapter",
        )
        self.step_index = self.weight_version = 0
        # prompts, generation schedule, refill, carry-over (train/rollouts/manager.py)
        self.rollouts = RolloutManager(config, task, self.engine, self.ranks)
        # remote: the other ranks wait for rank 0's push (see train/sync_wait.py)
        self.sync_wait = SyncWait(sync_timeout_s) if remote else None
        self.colocation = self._colocation()  # --colocate: who holds the GPUs, when
        self.sync_weights(version=0)

    # ------------------------------------------------------------------ phases
    def step(self, should_stop: Callable[[], bool] | None = None) -> dict[str, float] | None:
        """One RL step; returns this step's metrics (averaged over all ranks).

        The rollout comes from ``self.rollouts`` (`megatron_rl.train.rollouts.source`): generated
        now, or with ``--async-rollout`` generated while the previous step trained, the next one
        generating while this one trains (`megatron_rl.train.rollouts.async_rollout`).
        ``should_stop`` (a collective, e.g. `PreemptionHandler.agreed`) is asked after the rollout
        and before every update, so a stop signal is served within one update, not one step:
        after the rollout the step is abandoned (the prompts are drawn again after a resume) and
        None is returned; before an update the remaining updates are skipped and the step ends.
        """
        if self.config.rollout.rollout_only:  # no update, no sync (train/rollouts/dump.py)
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
        if self.teacher is not None:  # every sampled token scored before the updates
            t = time.perf_counter()
            metrics.update(self.teacher.annotate(batch.samples))
            metrics["time/teacher"] = time.perf_counter() - t
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
        """The configured engine, once its servers answer (`megatron_rl.rollout.build`)."""
        config = self.config
        pad_id, seed = self.tokenizer.pad_token_id, config.parallel.seed
        return ready_engine(config.engine, self.hf_config, pad_id, seed)

    def _build_replay(self):
        """Routing replay's passes (`megatron_rl.routing.passes`): what each pass records or
        replays, from ``--routing-replay`` and this rank's token layout."""
        parallel, hf = self.config.parallel, self.hf_config
        return build_replay_passes(
            as_chunks(self.model),
            self.config.replay,
            num_experts=num_routed_experts(hf),
            topk=hf.num_experts_per_tok,
            moe_layer_numbers=moe_layer_numbers(hf),
            layout=TokenLayout(
                tp_size=parallel.tensor_parallel,
                tp_rank=parallel_state.get_tensor_model_parallel_rank(),
                sequence_parallel=bool(parallel.sequence_parallel),
            ),
            pipeline_group=self.ranks.pipeline_group,
        )

    def _colocation(self) -> Colocation | None:
        """``--colocate`` (`megatron_rl.train.colocate`): the trainer's offload on every rank;
        the rank that pushes the weights also drives the servers' memory."""
        if not self.config.engine.colocate:
            return None
        offload = TrainerOffload(self.model, self.optimizer, device=self.device)
        engine = self.engine if self.pushes_weights else None
        return Colocation(offload, engine, generation_bytes=self.generation_bytes)

    def train_on(
        self, samples: list[TrainSample], should_stop: Callable[[], bool] | None = None
    ) -> dict[str, float]:
        """Old-logprob pass and the N optimizer steps over this rank's ``samples``.

        Each data-parallel rank passes its own share of the global batch (consecutive chunks of
        ``global_batch_size / dp`` samples: chunk ``j`` of every rank makes mini-batch ``j``);
        returns this rank's metrics (not yet averaged over ranks). ``should_stop``: see `step`.
        """
        metrics: dict[str, float] = {}
        batches = plan_minibatches(
            samples,
            self.config.schedule,
            self.ranks,
            self.tokenizer.pad_token_id,
            self.device,
            metrics,
        )
        t = time.perf_counter()
        old = old_logprob_pass(
            batches,
            metrics,
            model=self.model,
            reference=self.reference,
            replay=self.replay,
            config=self.config,
            weight_version=self.weight_version,
            ranks=self.ranks,
            fold_first=self.fold_first_update,
        )
        metrics["time/old_logprob"] = time.perf_counter() - t
        t = time.perf_counter()
        ratios = {
            name: torch.zeros(NUM_BINS, dtype=torch.int64, device=self.device)
            for name in ("pi_old", "pi_mu")
        }
        norms = []
        for j, minibatch in enumerate(batches):
            if self.nonfinite.exhausted:  # the run stops after this step; apply nothing more
                _count(metrics, "update/skipped_stopping")
                continue
            if should_stop is not None and should_stop():
                _count(metrics, "update/skipped_preempted")
                continue
            norm = self._update(j, minibatch, old, metrics, ratios)
            if norm is not None:
                norms.append(norm)
        metrics["time/update"] = time.perf_counter() - t
        if norms:  # every update's, not only the last one's (``grad_norm``)
            metrics["grad_norm/max"] = max(norms)
            metrics["grad_norm/mean"] = sum(norms) / len(norms)
        if self.ranks.last_stage:  # the global step's ratio quantiles (train/ratio_quantiles.py)
            for name, counts in ratios.items():
                summed = sum_over_ranks(counts.tolist(), group=self.ranks.dp_group)
                metrics.update(quantile_metrics(name, summed))
        if self.ranks.last_stage:  # the mismatch and entropy, folded micro-batches included
            old.finish(metrics, group=self.ranks.dp_group)
        if self.ranks.pp > 1:  # the losses, log-probs and entropies came from the last stage
            last = parallel_state.get_pipeline_model_parallel_last_rank()
            metrics = broadcast_object(metrics, src=last, group=self.ranks.pp_group)
        return metrics

    def _update(
        self, j: int, minibatch: list[MicroBatch], old: OldLogprobs, metrics, ratios
    ) -> float | None:
        """One optimizer step over the micro-batches of mini-batch ``j``; its gradient norm
        (None: skipped). ``ratios``: the step's log-ratio histograms, counted into."""
        behaviour = old.entries[j]
        # this mini-batch's response tokens and sequences, summed over data-parallel ranks (the
        # masks live on the last pipeline stage; the other stages learn the totals from it)
        local = [0.0, 0.0]
        if self.ranks.last_stage:
            local = [
                sum(float(e["mask"].sum()) for e in behaviour),
                sum(float(e["mask"].any(dim=-1).sum()) for e in behaviour),
            ]
        num_tokens, num_seqs = sum_over_ranks(local, group=self.ranks.dp_group)
        if self.ranks.pp > 1:
            num_tokens, num_seqs = max_over_ranks([num_tokens, num_seqs], group=self.ranks.pp_group)
        if num_tokens == 0:
            _count(metrics, "update/skipped_empty")
            return None
        self.optimizer.zero_grad()
        finite, loss_metrics = True, []

        def on_logits(i: int, logits: torch.Tensor) -> torch.Tensor | None:
            nonlocal finite
            entry, mb = behaviour[i], minibatch[i]
            logprobs = policy_logprobs(logits, mb, self.config.rollout.temperature)
            if not self.nonfinite.finite(logprobs, entry["mask"]):
                finite = False  # keep running forwards: peers wait in collectives
                return None
            entry = old.complete(j, i, mb, logits, logprobs)  # a folded entry gets its old ones
            mask, detached = entry["mask"].bool(), logprobs.detach()
            ratios["pi_old"] += log_ratio_counts((detached - entry["old"])[mask])
            ratios["pi_mu"] += log_ratio_counts((detached - mb.rollout_logprobs_BT)[mask])
            advantages, teacher = mb.advantages_B, self.config.teacher
            if mb.teacher_topk_ids_BTK is not None:  # a KL loss term (train/distillation_kl.py)
                advantages = teacher.task_weight * mb.advantages_B
            elif mb.teacher_logprobs_BT is not None:  # per token (train/teacher.py)
                advantages = distillation_advantages(
                    mb.advantages_B,
                    entry["behaviour"],
                    mb.teacher_logprobs_BT,
                    entry["mask"],
                    kl_coef=teacher.kl_coef,
                    task_weight=teacher.task_weight,
                )
            out = objective(
                self.objective,
                logprobs_BT=logprobs,
                old_logprobs_BT=entry["behaviour"],
                advantages_B=advantages,
                loss_mask_BT=entry["mask"],
                num_tokens=num_tokens,
                num_seqs=num_seqs,
                token_weights_BT=entry["weights"],
                ref_logprobs_BT=entry.get("ref"),
            )
            out.metrics.update(entry.get("correction_metrics", {}))
            loss = out.loss
            if mb.teacher_topk_ids_BTK is not None:
                kl_BT = topk_kl(
                    logits,
                    mb.teacher_topk_ids_BTK,
                    mb.teacher_topk_logprobs_BTK,
                    teacher.kl_type,
                    teacher.mixed_kl_weight,
                )
                kl_sum = (kl_BT * mask).sum()
                loss = loss + teacher.kl_coef * kl_sum / num_tokens
                out.metrics["teacher/topk_kl"] = kl_sum.detach() / mask.sum().clamp(min=1)
            loss_metrics.append(out.metrics)
            return loss * self.ranks.dp

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
            return None
        metrics["grad_norm"] = grad_norm  # the step's last update's (grad_norm/max, /mean: all)
        _accumulate(metrics, loss_metrics, 1.0 / self.config.updates_per_rollout)
        return float(grad_norm)

    # ------------------------------------------------------------------ helpers
    def sync_weights(self, version: int) -> None:
        """Push the policy to the engine as weight ``version`` (every rank streams its shard).

        A stop signal during the sync ends the process at once (`stop_signal.hard_wait`): the
        other ranks wait in C for rank 0's push, which can take minutes."""
        with stop_signal.hard_wait(f"syncing weight version {version}"):
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
        if self.lora_base is not None:
            state["lora_base"] = self.lora_base
        return state

    def load_state_dict(self, state: dict) -> None:
        if self.lora_base is not None:
            check_same_base(state.get("lora_base"), self.lora_base)
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


def _configure_threads(config: TrainConfig, world: int) -> int:
    """Torch threads of this rank: the cores shared by the ranks on this machine and, with an
    overlapping rollout schedule, their generation threads (`megatron_rl.threads`)."""
    local = int(os.environ.get("LOCAL_WORLD_SIZE") or world)  # ranks sharing this machine
    if config.rollout.schedule.overlap:  # each rank's generation thread shares the cores too
        local *= 2
    return configure_threads(config.runtime.torch_threads, local_processes=local)


def _count(metrics: dict, key: str) -> None:
    metrics[key] = metrics.get(key, 0.0) + 1


def _accumulate(metrics: dict, loss_metrics: list[dict], weight: float) -> None:
    """Add the mean over micro-batches of every loss metric, scaled by ``weight``."""
    if not loss_metrics:
        return
    # each micro-batch's values read out at once (one copy, not one item() per metric)
    floats = [dict(zip(m, _as_floats(list(m.values())), strict=True)) for m in loss_metrics]
    for key in floats[0]:
        values = [m[key] for m in floats if key in m]
        metrics[key] = metrics.get(key, 0.0) + weight * sum(values) / len(values)


def _as_floats(values: list) -> list[float]:
    """Python floats of 0-dim tensors and numbers: the tensors of each dtype and device stacked
    and read out once (the same values ``float(v)`` gives, without one item() each)."""
    out = [v if not torch.is_tensor(v) else None for v in values]
    groups: dict[tuple, list[int]] = {}
    for k, v in enumerate(values):
        if torch.is_tensor(v):
            if v.dim():
                out[k] = v  # float() of a one-element tensor, below
            else:
                groups.setdefault((v.dtype, v.device), []).append(k)
    for members in groups.values():
        with torch.no_grad():
            read = torch.stack([values[k] for k in members]).tolist()
        for k, value in zip(members, read, strict=True):
            out[k] = value
    return [float(v) for v in out]


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
