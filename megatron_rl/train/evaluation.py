"""Evaluation during training: held-out prompts generated with the current weights, scored.

After every ``--eval-interval``-th step (and before the first step of a fresh run with
``--eval-before-train``) each held-out set is generated on the rollout engine that trains (the
in-process engine or the SGLang servers, already holding the step's weights), with the
evaluation's own sampling options, ``n = --n-samples-per-eval-prompt`` samples per prompt, and
scored with the evaluation reward. The samples never reach the loss.

Metrics (one row of metrics.jsonl; the step-0 evaluation is a row of its own at step 0):
    eval/<set>/mean@n: the mean over prompts of ``c / n`` (``c`` correct samples of ``n``, correct
        meaning reward > 0.5 as for the training ``accuracy``), EPIC's "mean@8";
    eval/<set>/pass@k: the mean over prompts of the unbiased estimator of "one of k samples is
        correct" from ``n >= k`` samples (Chen et al. 2021, "Evaluating Large Language Models
        Trained on Code", eq. 1): ``1 - C(n - c, k) / C(n, k)``; k is ``--eval-pass-k``
        (default n);
    eval/<set>/response_length: response tokens per sample;
    eval/mean@n, eval/pass@k: the equal-weight averages over sets (each set counts once,
        whatever its size);
    eval/aborted: samples the engine aborted and generated again during evaluation (taken from
        the engine, so they never count in the training ``rollout/aborted``);
    eval/<set>/exact_p, eval/<set>/exact_logp, eval/exact_p, eval/exact_logp: the teacher-forced
        sets of ``--eval-exact-p-data`` (`megatron_rl.train.exact_p`), at every evaluation;
    time/eval: seconds the evaluation took (this rank's wall clock).

With ``--eval-sampled-interval M`` the sampled sets are generated only at the evaluations of
steps that are multiples of M (and step 0); the others carry the teacher-forced metrics alone.

Determinism: every (step, set, data-parallel replica) samples with its own seed, a hash of the
run's ``--seed``, the step, the set name and the replica (`eval_seed`). Seeded sampling draws
from per-sample generators, never from torch's global RNG, so a run with evaluation trains
exactly as one without, and a resumed run evaluates at the same steps with the same samples as an
uninterrupted one (the weights being the same). The samples depend on the data-parallel size:
each replica generates a strided share of every set's prompts (prompt ``i`` on replica
``i mod dp``, on its generator rank); the per-prompt counts are gathered over all ranks, so every
rank computes the same metrics.
"""

from __future__ import annotations

import hashlib
import logging
import math
import time
from collections.abc import Callable, Mapping, Sequence
from typing import NamedTuple

from megatron_rl.collectives import all_gather_objects
from megatron_rl.rewards import compute_rewards
from megatron_rl.rollout.types import SamplingParams
from megatron_rl.train.eval_config import EvalConfig

logger = logging.getLogger(__name__)


class PromptScore(NamedTuple):
    """One evaluated prompt: ``correct`` of ``n`` samples, ``response_tokens`` over them."""

    index: int  # the prompt's position in its set
    n: int
    correct: int
    response_tokens: int


# ---------------------------------------------------------------------------------- metric math
def pass_at_k(n: int, c: int, k: int) -> float:
    """Unbiased estimate of pass@k from ``n`` samples of which ``c`` are correct.

    ``1 - C(n - c, k) / C(n, k)`` (Chen et al. 2021, eq. 1): the chance that ``k`` samples
    drawn without replacement from the ``n`` hold a correct one, computed as
    ``(C(n, k) - C(n - c, k)) / C(n, k)``: exact integer binomials, one correctly rounded division.
    """
    if not 0 <= c <= n or not 1 <= k <= n:
        raise ValueError(f"pass_at_k(n={n}, c={c}, k={k}): need 0 <= c <= n and 1 <= k <= n")
    total = math.comb(n, k)
    return (total - math.comb(n - c, k)) / total


def set_metrics(scores: Sequence[PromptScore], k: int) -> tuple[float, float, float]:
    """``(mean@n, pass@k, response tokens per sample)`` of one set's prompts: the means over
    prompts of ``c / n`` and `pass_at_k`."""
    if not scores:
        raise ValueError("set_metrics: no evaluated prompt")
    mean = sum(s.correct / s.n for s in scores) / len(scores)
    passed = sum(pass_at_k(s.n, s.correct, k) for s in scores) / len(scores)
    length = sum(s.response_tokens for s in scores) / sum(s.n for s in scores)
    return mean, passed, length


def eval_metrics(per_set: Mapping[str, Sequence[PromptScore]], n: int, k: int) -> dict[str, float]:
    """The ``eval/*`` metrics (see the module docstring) of every set and their equal-weight
    averages over sets."""
    out: dict[str, float] = {}
    means, passes = [], []
    for name, scores in per_set.items():
        mean, passed, length = set_metrics(scores, k)
        out[f"eval/{name}/mean@{n}"] = mean
        out[f"eval/{name}/pass@{k}"] = passed
        out[f"eval/{name}/response_length"] = length
        means.append(mean)
        passes.append(passed)
    out[f"eval/mean@{n}"] = sum(means) / len(means)
    out[f"eval/pass@{k}"] = sum(passes) / len(passes)
    return out


def eval_seed(run_seed: int, step: int, set_name: str, replica: int) -> int:
    """The sampling seed of set ``set_name`` at ``step`` on data-parallel ``replica``: a hash
    (BLAKE2b, 31 bits) of the four, unrelated to the training rollouts' seeds."""
    key = f"{run_seed}/{step}/{set_name}/{replica}".encode()
    digest = hashlib.blake2b(key, digest_size=4, person=b"megatron_rl.eval").digest()
    return int.from_bytes(digest, "big") >> 1


# ---------------------------------------------------------------------------------- evaluator
class Evaluator:
    """Evaluates the held-out sets on ``engine`` (None on ranks that do not generate: they only
    take part in the gather). Call `evaluate` on every rank at the same point of the run."""

    def __init__(
        self,
        config: EvalConfig,
        sets: Mapping[str, Sequence],
        reward_fn: Callable[[str, str], float],
        tokenizer,
        *,
        engine,
        dp: int = 1,
        dp_rank: int = 0,
        scorer=None,  # `megatron_rl.train.exact_p.ReferenceScorer` (the teacher-forced sets)
    ) -> None:
        if not sets and scorer is None:
            raise ValueError("Evaluator: no held-out set (build the task with the eval config)")
        self.scorer = scorer
        self.config = config
        self.sets = dict(sets)
        self.reward_fn = reward_fn
        self.tokenizer = tokenizer
        self.engine = engine
        self.dp, self.dp_rank = dp, dp_rank

    @classmethod
    def for_trainer(cls, trainer, task) -> Evaluator:
        """The evaluator of a `Trainer` and the task holding its held-out sets."""
        from megatron_rl.train.exact_p import ReferenceScorer  # megatron: after the trainer

        generates = trainer.engine is not None and trainer.ranks.is_generator
        return cls(
            trainer.config.eval,
            task.eval_sets,
            task.eval_reward_fn,
            trainer.tokenizer,
            engine=trainer.engine if generates else None,
            dp=trainer.ranks.dp,
            dp_rank=trainer.ranks.dp_rank,
            scorer=ReferenceScorer.for_trainer(trainer, task),
        )

    @property
    def headline(self) -> tuple[str, ...]:
        """The averages over sets, for the progress line and the learning-curve picture."""
        n, k = self.config.n_samples_per_eval_prompt, self.config.pass_k
        sampled = (f"eval/mean@{n}", f"eval/pass@{k}") if self.sets else ()
        return sampled + (("eval/exact_p",) if self.scorer is not None else ())

    def evaluate(self, step: int) -> dict[str, float]:
        """The ``eval/*`` metrics and ``time/eval`` of the current weights (a collective)."""
        start = time.perf_counter()
        metrics = self.scorer.score() if self.scorer is not None else {}
        if self.sets and self.config.samples_at(step):
            metrics.update(self._sampled(step))
        metrics["time/eval"] = time.perf_counter() - start
        return metrics

    def _sampled(self, step: int) -> dict[str, float]:
        """The sampled sets' metrics and ``eval/aborted`` (a collective)."""
        mine: dict[str, list[PromptScore]] = {}
        aborted = 0
        if self.engine is not None:
            for name, records in self.sets.items():
                share = list(range(self.dp_rank, len(records), self.dp))
                mine[name] = self._score(name, records, share, step)
            aborted = int(self.engine.take_aborted())  # not the next training rollout's
        gathered = all_gather_objects((mine, aborted))
        per_set = {
            name: sorted(s for theirs, _ in gathered for s in theirs.get(name, []))
            for name in self.sets
        }
        config = self.config
        metrics = eval_metrics(per_set, config.n_samples_per_eval_prompt, config.pass_k)
        metrics["eval/aborted"] = float(sum(a for _, a in gathered))
        return metrics

    def _score(self, name: str, records, share: list[int], step: int) -> list[PromptScore]:
        """Generate and score this replica's prompts ``share`` of set ``name``."""
        if not share:
            return []
        config, n = self.config, self.config.n_samples_per_eval_prompt
        params = SamplingParams(
            temperature=config.temperature,
            top_p=config.top_p,
            top_k=config.top_k,
            max_new_tokens=config.max_response_length,
            stop_token_ids=(self.tokenizer.eos_token_id,),
            seed=eval_seed(config.seed, step, name, self.dp_rank),
        )
        generated = self.engine.generate(
            [list(records[i].prompt_ids) for i in share], params, n=n, return_routed_experts=False
        )
        responses = [_decode(self.tokenizer, s.response_ids_R.tolist()) for s in generated]
        answers = [records[share[s.prompt_index]].answer for s in generated]
        scored = compute_rewards(self.reward_fn, responses, answers)
        correct = [0] * len(share)
        tokens = [0] * len(share)
        for sample, reward, failed in zip(generated, scored.rewards, scored.failed, strict=True):
            correct[sample.prompt_index] += int(not failed and reward > 0.5)
            tokens[sample.prompt_index] += int(sample.response_ids_R.numel())
        return [PromptScore(index, n, correct[i], tokens[i]) for i, index in enumerate(share)]


def _decode(tokenizer, ids: list[int]) -> str:
    """A response's text, as the rollout phase decodes it (vocabulary padding ids dropped)."""
    return tokenizer.decode([i for i in ids if i < tokenizer.vocab_size])
