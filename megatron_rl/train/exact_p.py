"""The teacher-forced held-out metric: the probability that the policy writes the reference.

For a task whose every prompt ``x`` has exactly one correct response ``r`` (the record's
``answer``, e.g. ``--task addition-trace``), sampling from the policy at temperature ``T``
without truncation (top-p 1, no top-k) writes ``r`` followed by ``<eos>`` with probability

    p(r | x) = prod_t softmax(z_t / T)[r_t] = exp( sum_t log pi_T(r_t | x, r_<t) ),

``t`` over the reference's tokens and the closing ``<eos>``. One forward-only pass over
``x + r + <eos>`` computes it exactly, with the trainer's own model and kernels: no sampling, so
no sampling noise. The sampled ``eval/<set>/mean@n`` at top-p 1 and the same temperature is an
unbiased estimate of this number (each of its ``n`` samples is right with probability ``p``);
``exact_p`` is its expectation. At top-p < 1 the sampled score is another quantity (the
truncated distribution's), typically higher.

Metrics (``--eval-exact-p-data``; one row per evaluation, step 0 included):
    eval/<set>/exact_p: the mean over prompts of ``p(r | x)``;
    eval/<set>/exact_logp: the mean over prompts of ``log p(r | x)`` (nats; finite even when
        ``p`` underflows, and sensitive where ``exact_p`` is near 0);
    eval/exact_p, eval/exact_logp: their equal-weight averages over sets.

Ranks: every data-parallel replica scores a strided share of each set (prompt ``i`` on replica
``i mod dp``) through megatron's forward (tensor, pipeline and expert parallel as in training);
the per-prompt sums are gathered, so every rank returns the same metrics. The engine is not used
and routing replay is off for these forwards (the policy routes itself).
"""

from __future__ import annotations

import math
from collections.abc import Mapping, Sequence

import torch

from megatron_rl.collectives import all_gather_objects
from megatron_rl.routing.passes import ReplayPasses
from megatron_rl.train.batch import TrainSample, make_micro_batch
from megatron_rl.train.logprobs import token_logprobs
from megatron_rl.train.merged_pass import forward_only_pass, forward_token_budget

ROWS_PER_MICRO_BATCH = 32
"""Rows per micro-batch of the scoring pass (merged further up to the forward token budget)."""


def reference_sample(record, tokenizer) -> TrainSample:
    """``record``'s prompt with its reference response (``answer`` encoded, then ``<eos>``) as
    a sample whose response tokens are the ones to score."""
    response = [*tokenizer.encode(record.answer), tokenizer.eos_token_id]
    return TrainSample(
        prompt_ids=torch.tensor(record.prompt_ids, dtype=torch.int64),
        response_ids=torch.tensor(response, dtype=torch.int64),
        rollout_logprobs=torch.zeros(len(response), dtype=torch.float32),
        advantage=0.0,
        reward=0.0,
        in_loss=True,
        prompt_index=record.index,
    )


def exact_metrics(per_set: Mapping[str, Sequence[float]]) -> dict[str, float]:
    """The ``eval/*exact*`` metrics (module docstring) from each set's per-prompt ``log p``."""
    out: dict[str, float] = {}
    probs, logps = [], []
    for name, logp in per_set.items():
        if not logp:
            raise ValueError(f"exact_metrics: set {name!r} has no scored prompt")
        bad = [x for x in logp if math.isnan(x) or x > 1e-6]
        if bad:
            raise ValueError(f"exact_metrics: set {name!r} has log-probabilities {bad[:3]} (> 0)")
        p = sum(math.exp(min(x, 0.0)) for x in logp) / len(logp)
        mean_logp = sum(logp) / len(logp)
        out[f"eval/{name}/exact_p"] = p
        out[f"eval/{name}/exact_logp"] = mean_logp
        probs.append(p)
        logps.append(mean_logp)
    if per_set:
        out["eval/exact_p"] = sum(probs) / len(probs)
        out["eval/exact_logp"] = sum(logps) / len(logps)
    return out


class ReferenceScorer:
    """Scores held-out sets by teacher forcing on the trainer's model (a collective: call
    `score` on every rank of the run at the same point)."""

    def __init__(
        self, sets: Mapping[str, Sequence], tokenizer, *, model, ranks, schedule, temperature
    ):
        for name, records in sets.items():
            if len(records) < ranks.dp:
                raise ValueError(
                    f"--eval-exact-p-data {name}: {len(records)} prompts for {ranks.dp} "
                    "data-parallel replicas; every replica scores its own share, so give at "
                    "least one prompt per replica"
                )
        self.sets = {
            name: [reference_sample(r, tokenizer) for r in records]
            for name, records in sets.items()
        }
        self.pad_id = tokenizer.pad_token_id
        self.model, self.ranks, self.temperature = model, ranks, temperature
        self.max_tokens = forward_token_budget(schedule.token_budget)

    @classmethod
    def for_trainer(cls, trainer, task) -> ReferenceScorer | None:
        """The scorer of ``task.exact_sets`` on ``trainer``'s model; None without such sets."""
        if not task.exact_sets:
            return None
        return cls(
            task.exact_sets,
            trainer.tokenizer,
            model=trainer.model,
            ranks=trainer.ranks,
            schedule=trainer.config.schedule,
            temperature=trainer.config.eval.temperature,
        )

    def score(self) -> dict[str, float]:
        """The ``eval/*exact*`` metrics of the current weights, the same on every rank."""
        mine = {name: self._score_share(samples) for name, samples in self.sets.items()}
        gathered = all_gather_objects(mine)
        per_set = {}
        for name, samples in self.sets.items():
            logp: dict[int, float] = {}
            for theirs in gathered:  # tensor-parallel peers report the same sums: keep one
                for index, value in theirs[name].items():
                    logp.setdefault(index, value)
            missing = len(samples) - len(logp)
            if missing:
                raise RuntimeError(f"exact_p: {missing} prompts of set {name!r} were not scored")
            per_set[name] = [logp[i] for i in sorted(logp)]
        return exact_metrics(per_set)

    def _score_share(self, samples: list[TrainSample]) -> dict[int, float]:
        """``{position in the set: log p}`` of this replica's share (empty off the last
        pipeline stage: the others only run their part of the forwards)."""
        share = list(range(self.ranks.dp_rank, len(samples), self.ranks.dp))
        share.sort(key=lambda i: (-samples[i].length, i))  # equal widths merge bitwise
        groups = [
            share[k : k + ROWS_PER_MICRO_BATCH] for k in range(0, len(share), ROWS_PER_MICRO_BATCH)
        ]
        device = next(self.model.parameters()).device
        batches = [
            make_micro_batch([samples[i] for i in g], self.pad_id, self.ranks.seq_multiple).to(
                device
            )
            for g in groups
        ]
        out: dict[int, float] = {}

        def on_logits(n: int, logits: torch.Tensor) -> None:
            mb = batches[n]
            logprobs = token_logprobs(logits, mb.tokens_BS, self.temperature)
            sums = (logprobs.double() * mb.loss_mask_BT).sum(dim=-1)
            for row, index in enumerate(groups[n]):
                out[index] = float(sums[row])

        self.model.eval()
        with torch.no_grad():
            forward_only_pass(
                self.model,
                batches,
                [("exact_p", n) for n in range(len(batches))],
                ReplayPasses(),
                on_logits,
                max_tokens=self.max_tokens,
                pad_widths=True,
                group=self.ranks.data_parallel_group,
            )
        self.model.train()
        return out if self.ranks.last_stage else {}
