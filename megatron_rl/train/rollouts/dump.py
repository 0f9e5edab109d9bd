"""Rollout dumps: each step's batch written to disk, and training replayed from it.

``--save-rollouts DIR`` writes, after every step's rollout, one file per step and data-parallel
rank (the generator rank of each model-parallel group writes; the other ranks of the group hold
the same samples)::

    DIR/step_<n>/rank_<r>.pt     n = 1-based step (the metrics row's step), r = data-parallel rank

each a ``torch.save`` of plain tensors and dicts (read back with ``weights_only=True``), written
atomically (`megatron_rl.atomic_io`): ``{"header", "samples", "metrics", "prompts",
"reward_error"}``. A sample keeps everything the trainer uses (`TrainSample`): prompt and
response ids (int64 ``[P]``, ``[R]``), engine log-probs (float32 ``[R]``), reward, advantage,
``in_loss`` (the loss mask of its response tokens), weight versions and, with R3, its routes in
their codec form (`RoutingBlob`: ``data``, ``codec``, ``num_tokens``, ``num_layers``). The
header names the model (vocab size, layers, experts, top-k, hidden size), the tokenizer's
vocabulary, the data-parallel size, the seed and the run's flags.

``--load-rollouts DIR`` makes `RolloutManager.take` return step ``n``'s stored batch instead of
drawing prompts and generating; the engine is still built and receives every weight sync but
never generates. Every rank reads its own data-parallel rank's file (so a refusal is raised on
every rank alike). Training on the same batches from the same initial weights and optimizer
gives the writing run's training metrics and weights bit for bit. A header whose model,
tokenizer or data-parallel size differs from this run's is refused (ValueError naming the
field); a missing step file is a ValueError naming the step.

``--rollout-only``: `rollout_only_step` stands in for `Trainer.step` (rollout and its metrics,
no update, no weight sync).
"""

from __future__ import annotations

import dataclasses
import io
import os
import time

import torch

from megatron_rl.atomic_io import atomic_write_bytes, fsync_dir
from megatron_rl.collectives import mean_over_ranks
from megatron_rl.moe_layers import num_routed_experts
from megatron_rl.routing import RoutingBlob
from megatron_rl.train.batch import TrainSample
from megatron_rl.train.rollouts.source import RolloutBatch

FORMAT = 1  # the layout of a step file; bumped when a field changes meaning
# header fields a replay must match: the samples' token ids, routes and per-rank split
CHECKED = ("format", "model", "tokenizer_vocab_size", "data_parallel_size")


def dump_header(config, hf_config, tokenizer_vocab_size: int, dp: int) -> dict:
    """What a dump was written by: model fingerprint, tokenizer, layout, seed and flags."""
    model = {
        "model_type": str(getattr(hf_config, "model_type", "")),
        "vocab_size": int(hf_config.vocab_size),
        "num_hidden_layers": int(hf_config.num_hidden_layers),
        "hidden_size": int(hf_config.hidden_size),
        "num_experts": num_routed_experts(hf_config),
        "num_experts_per_tok": int(getattr(hf_config, "num_experts_per_tok", 0) or 0),
    }
    return {
        "format": FORMAT,
        "model": model,
        "tokenizer_vocab_size": int(tokenizer_vocab_size),
        "data_parallel_size": int(dp),
        "seed": int(config.parallel.seed),
        "flags": _plain(dataclasses.asdict(config)),
    }


def step_path(root: str, index: int, dp_rank: int) -> str:
    """The file of rollout ``index`` (0-based; its folder is the 1-based step) for ``dp_rank``."""
    return os.path.join(root, f"step_{index + 1:08d}", f"rank_{dp_rank:05d}.pt")


def sample_to_dict(sample: TrainSample) -> dict:
    """``sample`` as plain tensors, numbers and strings (loadable with ``weights_only``)."""
    out = {f.name: getattr(sample, f.name) for f in dataclasses.fields(TrainSample)}
    out["weight_versions"] = [list(v) for v in sample.weight_versions]
    if sample.routes is not None:
        out["routes"] = dataclasses.asdict(sample.routes)
    return out


def sample_from_dict(data: dict) -> TrainSample:
    """The `TrainSample` that `sample_to_dict` wrote."""
    data = dict(data)
    data["weight_versions"] = tuple(tuple(v) for v in data["weight_versions"])
    if data["routes"] is not None:
        data["routes"] = RoutingBlob(**data["routes"])
    return TrainSample(**data)


def write_step(path: str, header: dict, batch: RolloutBatch, reward_error: str | None) -> None:
    """Write one step's batch to ``path`` atomically (a reader sees all of it or nothing)."""
    payload = {
        "header": header,
        "samples": [sample_to_dict(s) for s in batch.samples],
        "metrics": {k: float(v) for k, v in batch.metrics.items()},
        "prompts": [int(i) for i in batch.prompts],
        "reward_error": reward_error,
    }
    buffer = io.BytesIO()
    torch.save(payload, buffer)
    folder = os.path.dirname(path)
    os.makedirs(folder, exist_ok=True)
    atomic_write_bytes(path, buffer.getvalue())
    fsync_dir(folder)


def read_step(path: str, header: dict, step: int) -> dict:
    """The payload at ``path`` (step ``step``, 1-based), its header checked against ``header``."""
    if not os.path.isfile(path):
        raise ValueError(
            f"--load-rollouts: step {step} has no file {path}; the dump holds the steps its "
            "--save-rollouts run took: lower --train-iters or replay from a longer dump"
        )
    payload = torch.load(path, map_location="cpu", weights_only=True)
    check_header(payload["header"], header, where=f"{path} (step {step})")
    return payload


def check_header(stored: dict, mine: dict, where: str) -> None:
    """ValueError naming the first ``CHECKED`` field where the dump and this run differ."""
    for name in CHECKED:
        theirs, ours = stored.get(name), mine[name]
        if isinstance(ours, dict):
            for key, value in ours.items():
                if (theirs or {}).get(key) != value:
                    _mismatch(f"{name}.{key}", (theirs or {}).get(key), value, where)
        elif theirs != ours:
            _mismatch(name, theirs, ours, where)


def _mismatch(field: str, theirs, ours, where: str) -> None:
    raise ValueError(
        f"--load-rollouts: {where} was written with {field}={theirs!r}, this run has "
        f"{field}={ours!r}; replay a dump with the model, tokenizer and data-parallel size "
        "that wrote it"
    )


class RolloutDump:
    """The store/replay hook of `RolloutManager.take` (module docstring)."""

    def __init__(self, config, header: dict, dp_rank: int, writes: bool) -> None:
        rollout = config.rollout
        self.save_dir, self.load_dir = rollout.save_rollouts, rollout.load_rollouts
        self.header, self.dp_rank, self.writes = header, dp_rank, writes

    @property
    def replaying(self) -> bool:
        return self.load_dir is not None

    def store(self, index: int, batch: RolloutBatch, reward_error: str | None) -> None:
        """Write rollout ``index``'s batch (``--save-rollouts``; the generator rank only)."""
        if self.save_dir is not None and self.writes:
            path = step_path(self.save_dir, index, self.dp_rank)
            write_step(path, self.header, batch, reward_error)

    def replay(self, index: int, sampler_state: dict) -> tuple[RolloutBatch, str | None]:
        """Rollout ``index``'s stored batch and reward error (``--load-rollouts``); no prompt
        is drawn, so ``sampler_before`` is the sampler's present state."""
        path = step_path(self.load_dir, index, self.dp_rank)
        payload = read_step(path, self.header, step=index + 1)
        batch = RolloutBatch(
            samples=[sample_from_dict(s) for s in payload["samples"]],
            metrics=dict(payload["metrics"]),
            prompts=list(payload["prompts"]),
            sampler_before=sampler_state,
        )
        return batch, payload["reward_error"]


def build_rollout_dump(config, task, place) -> RolloutDump | None:
    """The hook for ``--save-rollouts`` / ``--load-rollouts``, or None when neither is given."""
    rollout = config.rollout
    if rollout.save_rollouts is None and rollout.load_rollouts is None:
        return None
    header = dump_header(config, task.hf_config, task.tokenizer.vocab_size, place.dp)
    return RolloutDump(config, header, place.dp_rank, writes=place.is_generator)


def rollout_only_step(trainer) -> dict[str, float]:
    """``--rollout-only``: one step's rollout (written with ``--save-rollouts``) and its metrics
    averaged over ranks; no update and no weight sync."""
    start = time.perf_counter()
    if trainer.colocation is not None:
        trainer.colocation.before_rollout()
    batch = trainer.rollouts.take(trainer.step_index, trainer.weight_version)
    if trainer.colocation is not None:
        trainer.colocation.before_train()
    metrics = dict(batch.metrics)
    metrics["time/rollout"] = time.perf_counter() - start
    trainer.step_index += 1
    return mean_over_ranks(metrics)


def _plain(value):
    """``value`` with tuples as lists (a header holds only what ``weights_only`` loads)."""
    if isinstance(value, dict):
        return {str(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if value is None or isinstance(value, (bool, int, float, str)):
        return value
    return str(value)
