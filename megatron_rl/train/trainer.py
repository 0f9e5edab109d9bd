"""The RL trainer: rollout -> rewards -> old log-probs -> N updates -> weight sync, per step.

One screen per phase (see ``step``); the engine behind ``self.engine`` is configuration only.
Data parallelism: every data-parallel replica generates and trains on its own prompts; losses use
the global token/sequence counts of each optimizer step, so summing the replicas' gradients
(megatron's DDP averages, hence the ``* dp`` below) reproduces the full-batch gradient.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import math
import time

import torch
import torch.distributed as dist
from megatron.core import parallel_state

from megatron_rl.backend import ParallelConfig, destroy_distributed, init_distributed
from megatron_rl.backend.optimizer import OptimizerConfig, build_optimizer, wrap_for_training
from megatron_rl.losses import compute_policy_loss, kl_penalty, rollout_correction
from megatron_rl.losses.aggregation import aggregate_padded
from megatron_rl.model import ModelOptions, build_model
from megatron_rl.model.config import moe_layer_numbers
from megatron_rl.model.conversion import iter_hf_tensors
from megatron_rl.routing import local_token_sources
from megatron_rl.routing.replay import ReplayConfig, RoutingReplay
from megatron_rl.train.batch import MicroBatch, make_micro_batch, split
from megatron_rl.train.config import TrainConfig
from megatron_rl.train.logprobs import forward_logits, token_entropy, token_logprobs
from megatron_rl.train.rollout_phase import run_rollout
from megatron_rl.train.setup import build_task, load_policy_config

logger = logging.getLogger(__name__)


class Trainer:
    def __init__(self, config: TrainConfig, *, rank=None, world_size=None, init_method=None):
        self.config = config
        parallel = ParallelConfig(
            tensor_parallel=config.tensor_model_parallel_size,
            expert_parallel=config.expert_model_parallel_size,
            sequence_parallel=config.sequence_parallel,
            seed=config.seed,
        )
        world = world_size if world_size is not None else _env_world_size()
        self.dp = config.data_parallel_size(world)  # validates before anything is built
        self.device = init_distributed(
            parallel, rank=rank, world_size=world, init_method=init_method, device=config.device
        )
        self.dp_rank = parallel_state.get_data_parallel_rank()
        self.mp_group = parallel_state.get_model_parallel_group()
        self.mp_src = parallel_state.get_model_parallel_src_rank()
        self.is_generator = dist.get_rank() == self.mp_src
        self.sp = parallel.sequence_parallel
        self.tokenizer, self.records, self.reward_fn, self.sampler = build_task(config)
        self.hf_config, checkpoint_dir = load_policy_config(config, self.tokenizer)
        self.moe_layers = moe_layer_numbers(self.hf_config)
        options = ModelOptions(
            dtype="bfloat16" if config.bf16 else "float32",
            routing_replay=config.routing_replay != "off",
            recompute=config.recompute_granularity == "full",
        )
        model = build_model(self.hf_config, options)
        if checkpoint_dir is not None:
            from megatron_rl.model.conversion import load_checkpoint

            load_checkpoint(model, checkpoint_dir, self.hf_config)
        self.model = wrap_for_training(model)
        self.optimizer = build_optimizer(self.model, _optimizer_config(config, self.device))
        self.reference = self._build_reference(options) if config.kl_coef > 0 else None
        self.replay = None
        if config.routing_replay != "off":
            self.replay = RoutingReplay(
                self.model,
                ReplayConfig(
                    mode=config.routing_replay,
                    record_only=config.routing_record_only,
                    dtype=config.routing_dtype,
                ),
                num_experts=self.hf_config.num_experts,
                topk=self.hf_config.num_experts_per_tok,
                moe_layer_numbers=self.moe_layers,
            )
        self.engine = None
        if self.is_generator or config.rollout_engine == "sglang":
            from megatron_rl.train.engines import build_engine

            self.engine = build_engine(
                config, self.hf_config, self.tokenizer.pad_token_id, seed=config.seed
            )
        self.loss_params = dict(config.loss_params)
        self.step_index = 0
        self.weight_version = 0
        self.sync_weights(version=0)

    # ------------------------------------------------------------------ phases
    def step(self) -> dict[str, float]:
        """One RL step; returns this step's metrics (averaged over data-parallel ranks)."""
        config, timings = self.config, {}
        start = time.perf_counter()
        samples, metrics = self._rollout()
        timings["time/rollout"] = time.perf_counter() - start
        mini = config.global_batch_size // self.dp
        plan = [split(chunk, config.micro_batch_size) for chunk in split(samples, mini)]
        batches = [
            [make_micro_batch(m, self.tokenizer.pad_token_id, self._seq_multiple()) for m in mb]
            for mb in plan
        ]
        t = time.perf_counter()
        behaviour = self._old_logprob_pass(batches, metrics)
        timings["time/old_logprob"] = time.perf_counter() - t
        t = time.perf_counter()
        for j, minibatch in enumerate(batches):
            self._update(j, minibatch, behaviour[j], metrics)
        timings["time/update"] = time.perf_counter() - t
        t = time.perf_counter()
        self.sync_weights(version=self.weight_version + 1)
        timings["time/sync"] = time.perf_counter() - t
        if self.replay is not None:
            metrics.update(self.replay.metrics())
            self.replay.end_step()
        timings["time/step"] = time.perf_counter() - start
        metrics.update(timings)
        metrics["staleness/updates_per_rollout"] = float(config.updates_per_rollout)
        self.step_index += 1
        return _mean_over_ranks(metrics)

    def _rollout(self):
        config = self.config
        indices = self.sampler.next_batch(config.rollout_batch_size)
        per_rank = config.rollout_batch_size // self.dp
        mine = indices[self.dp_rank * per_rank : (self.dp_rank + 1) * per_rank]
        payload = [None]
        if self.is_generator:
            result = run_rollout(
                self.engine,
                [self.records[i] for i in mine],
                self.tokenizer,
                self.reward_fn,
                config,
                seed=config.seed * 1_000_003 + self.step_index * 1009 + self.dp_rank,
                return_routes=config.routing_replay == "r3",
            )
            payload = [(result.samples, result.metrics)]
        if self.mp_group.size() > 1:
            dist.broadcast_object_list(payload, src=self.mp_src, group=self.mp_group)
        return payload[0]

    def _old_logprob_pass(self, batches, metrics) -> list[list[dict]]:
        """Per micro-batch: trainer log-probs, behaviour log-probs, weights/masks, ref log-probs.

        R2 records each micro-batch's routing here; R3 replays the engine's routes.
        """
        kind = "record" if self.config.routing_replay == "r2" else "replay"
        out, gaps, entropies = [], [], []
        self.model.eval()
        with torch.no_grad():
            for j, minibatch in enumerate(batches):
                row = []
                for i, mb in enumerate(minibatch):
                    with self._routing(kind, (j, i), mb):
                        logits = forward_logits(self.model, mb.tokens_BS)
                    entry = self._behaviour_entry(mb, logits)
                    gaps.append((entry["old"] - mb.rollout_logprobs_BT)[mb.loss_mask_BT])
                    entropies.append(
                        token_entropy(logits, self.config.temperature)[mb.loss_mask_BT]
                    )
                    row.append(entry)
                out.append(row)
        self.model.train()
        gap = torch.cat(gaps).clamp(-20, 20)  # log(pi_train / mu_rollout) per response token
        metrics["mismatch/train_rollout_logprob_abs_gap"] = float(gap.abs().mean())
        metrics["mismatch/train_rollout_k3"] = float((torch.expm1(-gap) + gap).mean())
        metrics["entropy"] = float(torch.cat(entropies).mean())
        return out

    def _behaviour_entry(self, mb: MicroBatch, logits) -> dict:
        """What the updates of one micro-batch need from the old-logprob pass."""
        config = self.config
        old = token_logprobs(logits, mb.tokens_BS, config.temperature)
        behaviour = old if config.behavior_logprobs == "trainer" else mb.rollout_logprobs_BT
        entry = {"old": old, "behaviour": behaviour, "mask": mb.loss_mask_BT, "weights": None}
        if config.rollout_correction != "none":
            correction = rollout_correction(
                config.rollout_correction,
                old_logprobs=old,
                rollout_logprobs=mb.rollout_logprobs_BT,
                loss_mask=mb.loss_mask_BT,
            )
            entry.update(weights=correction.weights, mask=correction.loss_mask)
        if self.reference is not None:
            ref_logits = forward_logits(self.reference, mb.tokens_BS)
            entry["ref"] = token_logprobs(ref_logits, mb.tokens_BS, config.temperature)
        return entry

    def _update(self, j: int, minibatch: list[MicroBatch], behaviour: list[dict], metrics) -> None:
        """One optimizer step over the micro-batches of mini-batch ``j``."""
        config = self.config
        totals = torch.tensor(
            [
                sum(float(e["mask"].sum()) for e in behaviour),
                sum(float(e["mask"].any(dim=-1).sum()) for e in behaviour),
            ],
            dtype=torch.float64,
        )  # this mini-batch's response tokens and sequences, summed over data-parallel ranks
        dist.all_reduce(totals, group=parallel_state.get_data_parallel_group())
        num_tokens, num_seqs = float(totals[0]), float(totals[1])
        if num_tokens == 0:
            metrics["update/skipped_empty"] = metrics.get("update/skipped_empty", 0.0) + 1
            return
        self.optimizer.zero_grad()
        finite, loss_metrics = True, []
        for i, (mb, entry) in enumerate(zip(minibatch, behaviour, strict=True)):
            with self._routing("replay", (j, i), mb):
                logits = forward_logits(self.model, mb.tokens_BS)
                logprobs = token_logprobs(logits, mb.tokens_BS, config.temperature)
                mask = entry["mask"]
                if not bool(torch.isfinite(logprobs.detach()[mask]).all()):
                    finite = False  # keep running forwards: peers wait in collectives
                    continue
                out = compute_policy_loss(
                    config.loss,
                    logprobs=logprobs,
                    old_logprobs=entry["behaviour"],
                    advantages=mb.advantages_B,
                    loss_mask=mask,
                    loss_agg_mode=config.loss_agg_mode,
                    global_num_tokens=num_tokens,
                    global_num_seqs=num_seqs,
                    max_response_length=config.max_response_length,
                    token_weights=entry["weights"],
                    **self.loss_params,
                )
                loss = out.loss
                if self.reference is not None:
                    kl_BT = kl_penalty(logprobs, entry["ref"], mask, config.kl_estimator)
                    kl = aggregate_padded(
                        kl_BT,
                        mask,
                        config.loss_agg_mode or self._default_agg(),
                        global_num_tokens=num_tokens,
                        global_num_seqs=num_seqs,
                        max_response_length=config.max_response_length,
                    )
                    loss = loss + config.kl_coef * kl
                    out.metrics["kl/value"] = kl.detach()
                (loss * self.dp).backward()
                loss_metrics.append(out.metrics)
        grad_norm = self.optimizer.step() if _all_ranks_agree(finite) else None
        finite = grad_norm is not None
        if not finite:
            self.optimizer.zero_grad()
            self._bad_steps += 1
            logger.warning(
                "step %d update %d: non-finite log-probs or gradient norm; update skipped "
                "(%d in a row)",
                self.step_index,
                j,
                self._bad_steps,
            )
            metrics["update/skipped_nonfinite"] = metrics.get("update/skipped_nonfinite", 0.0) + 1
            return
        self._bad_steps = 0
        metrics["grad_norm"] = grad_norm
        _accumulate(metrics, loss_metrics, 1.0 / self.config.updates_per_rollout)

    # ------------------------------------------------------------------ helpers
    def _routing(self, kind: str, key, mb: MicroBatch):
        """The replay context of one micro-batch (a no-op without routing replay)."""
        if self.replay is None:
            return contextlib.nullcontext()
        mode = self.config.routing_replay
        if mode == "r2":
            return self.replay.record(key) if kind == "record" else self.replay.replay(key=key)
        sources = local_token_sources(
            mb.lengths,
            seq_len=mb.tokens_BS.shape[1],
            tp_size=self.config.tensor_model_parallel_size,
            tp_rank=parallel_state.get_tensor_model_parallel_rank(),
            sequence_parallel=self.sp,
        )
        blobs = [s.routes for s in mb.samples]
        if any(b is None for b in blobs):
            raise RuntimeError("R3 needs routes on every sample; the engine returned none")
        routes = self.replay.routes_for_micro_batch(blobs, mb.lengths, sources)
        return self.replay.replay(routes=routes)

    def _seq_multiple(self) -> int:
        return self.config.tensor_model_parallel_size if self.sp else 1

    def _default_agg(self) -> str:
        from megatron_rl.losses import get_loss_spec

        return get_loss_spec(self.config.loss).default_agg_mode

    def _build_reference(self, options: ModelOptions):
        """A frozen copy of the initial policy for the KL term (no routing replay)."""
        reference = build_model(self.hf_config, dataclasses.replace(options, routing_replay=False))
        reference.load_state_dict(self.model.module.state_dict(), strict=False)
        reference.eval().requires_grad_(False)
        return reference

    def sync_weights(self, version: int) -> None:
        """Push the policy to the engine as weight ``version`` (every rank streams its shard)."""
        stream = iter_hf_tensors(self.model.module, self.hf_config)
        pushes = self.engine is not None and (
            self.config.rollout_engine == "local" or dist.get_rank() == 0
        )
        if pushes:
            self.engine.update_weights(stream, version=version)
        else:
            for _ in stream:  # the gathers are collectives: take part, drop the tensors
                pass
        self.weight_version = version

    def state_dict(self) -> dict:
        return {
            "step": self.step_index,
            "weight_version": self.weight_version,
            "sampler": self.sampler.state_dict(),
            "bad_steps": self._bad_steps,
            "config": _jsonable(dataclasses.asdict(self.config)),
        }

    def load_state_dict(self, state: dict) -> None:
        self.step_index = int(state["step"])
        self.sampler.load_state_dict(state["sampler"])
        self._bad_steps = int(state.get("bad_steps", 0))
        # the engine gets the restored weights under their version
        self.sync_weights(version=int(state["weight_version"]))

    _bad_steps = 0

    def close(self) -> None:
        if self.replay is not None:
            self.replay.close()
        close = getattr(self.engine, "close", None)
        if close is not None:
            close()
        destroy_distributed()


def _env_world_size() -> int:
    import os

    return int(os.environ.get("WORLD_SIZE", 1))


def _optimizer_config(config: TrainConfig, device) -> OptimizerConfig:
    clip = config.clip_grad
    model_parallel = config.tensor_model_parallel_size * config.expert_model_parallel_size
    if device.type == "cpu" and model_parallel > 1 and clip > 0:
        logger.warning("--clip-grad is ignored on CPU with tensor/expert parallelism (CUDA-only)")
        clip = 0.0
    return OptimizerConfig(
        lr=config.lr,
        weight_decay=config.weight_decay,
        adam_beta1=config.adam_beta1,
        adam_beta2=config.adam_beta2,
        adam_eps=config.adam_eps,
        clip_grad=clip,
    )


def _all_ranks_agree(flag: bool) -> bool:
    value = torch.tensor([1.0 if flag else 0.0])
    dist.all_reduce(value, op=dist.ReduceOp.MIN)
    return bool(value.item())


def _accumulate(metrics: dict, loss_metrics: list[dict], weight: float) -> None:
    """Add the mean over micro-batches of every loss metric, scaled by ``weight``."""
    if not loss_metrics:
        return
    for key in loss_metrics[0]:
        values = [float(m[key]) for m in loss_metrics if key in m]
        metrics[key] = metrics.get(key, 0.0) + weight * sum(values) / len(values)


def _mean_over_ranks(metrics: dict[str, float]) -> dict[str, float]:
    """Average every metric over all ranks (same keys everywhere), max for timings."""
    keys = sorted(metrics)
    values = torch.tensor([float(metrics[k]) for k in keys], dtype=torch.float64)
    if dist.get_world_size() > 1:
        dist.all_reduce(values)
        values /= dist.get_world_size()
    out = dict(zip(keys, values.tolist(), strict=True))
    return {k: (v if math.isfinite(v) else float("nan")) for k, v in out.items()}


def _jsonable(value):
    if isinstance(value, dict):
        return {k: _jsonable(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_jsonable(v) for v in value]
    return value
