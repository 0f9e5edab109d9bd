"""The warm start of the long-response study: supervised steps on worked addition traces.

    python -m megatron_rl.study.warm_start --out runs/warm --seed 1 [--steps 650]

RL in the papers starts from a model that already knows the answer format; a randomly
initialised policy on ``--task addition-trace`` (a correct response is 32-83 exact tokens) never
samples a rewarded response, so GRPO has no signal. This command trains the study's model (the
same megatron-core model the trainer builds: ``--model`` preset with the task's vocabulary,
`init_from_seed` with ``--seed``, megatron's optimizer from `build_optimizer`) with token-mean
cross-entropy on the response tokens (``<eos>`` included) of worked solutions drawn from the
task's *training* pairs only (`addition_trace_task`; held-out pairs never appear), then saves an
HF checkpoint that ``python -m megatron_rl.train --model OUT --task addition-trace`` loads:

    loss = - sum_{b, t in response_b} log p(y_bt | y_b<t) / sum_b |response_b|

The learning rate warms up linearly over ``--warmup`` steps to ``--lr`` and decays by a cosine
to ``lr / 10`` at the last step. Deterministic: batches come from a NumPy generator seeded with
``--seed``, the initial weights from `init_from_seed`, and the CPU run is single-process, so two
runs with the same flags write identical checkpoint bytes (tested).

Atomic and cached: the checkpoint is written to ``OUT.tmp`` and renamed to ``OUT``, with
``warm_start.json`` (the recipe and what it reached); a second run with the same recipe finds it
and does nothing, one with another recipe stops with an error naming the difference. Unless
``--no-eval``, the checkpoint is then scored with the trainer's own evaluation
(`megatron_rl.train.evaluation.Evaluator`, the in-process engine loading ``OUT``) on the fixed
held-out set (``--eval-prompt-data builtin``: ``addition-trace-heldout``), and the mean per-token
entropy of the policy over the held-out worked solutions' response tokens is measured; both go
into ``warm_start.json``.
"""

from __future__ import annotations

import argparse
import json
import logging
import math
import os
import shutil
import sys
import time
from dataclasses import asdict, dataclass

import numpy as np
import torch

from megatron_rl.atomic_io import atomic_write_text
from megatron_rl.data.addition_trace import (
    AdditionTraceConfig,
    addition_trace_heldout,
    addition_trace_task,
)
from megatron_rl.data.addition_trace_tokenizer import EOS_ID, PAD_ID

logger = logging.getLogger(__name__)

RECIPE_FILE = "warm_start.json"


@dataclass(frozen=True, kw_only=True, slots=True)
class WarmStartConfig:
    """The recipe: every field changes the checkpoint (and is recorded in ``warm_start.json``)."""

    seed: int
    steps: int = 650  # seed 1: held-out mean@8 0.23, pass@8 0.46 (docs/study.md, the scan)
    batch_size: int = 32
    lr: float = 3e-3
    warmup: int = 50
    num_examples: int = 16384
    model: str = "tiny-mismatch"

    def __post_init__(self) -> None:
        for name in ("steps", "batch_size", "num_examples"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, int) or value < 1:
                raise ValueError(f"--{name.replace('_', '-')}={value!r}: must be an integer >= 1")
        if self.seed < 0:
            raise ValueError(f"--seed={self.seed!r}: must be >= 0")
        if not (math.isfinite(self.lr) and self.lr > 0):
            raise ValueError(f"--lr={self.lr!r}: must be a positive finite number")
        if self.warmup < 0:
            raise ValueError(f"--warmup={self.warmup!r}: must be >= 0 (0: no warmup)")
        if not self.model.startswith("tiny"):
            raise ValueError(
                f"--model={self.model!r}: the warm start trains a tiny* preset (its vocabulary "
                "is sized to the task's 16 tokens); e.g. tiny-mismatch"
            )

    def lr_at(self, step: int) -> float:
        """Linear warmup over ``warmup`` steps, then cosine from ``lr`` to ``lr / 10``."""
        if step < self.warmup:
            return self.lr * (step + 1) / self.warmup
        span = max(self.steps - self.warmup - 1, 1)
        progress = min((step - self.warmup) / span, 1.0)
        return self.lr * (0.1 + 0.9 * 0.5 * (1.0 + math.cos(math.pi * progress)))


def worked_batch(records, indices) -> tuple[torch.Tensor, torch.Tensor]:
    """``(tokens_BS, mask_BT)``: prompt + reference response + ``<eos>``, right-padded with
    ``<pad>``; ``mask_BT[b, t]`` (``T = S - 1``) is 1 where token ``t + 1`` is a response token
    (the targets of the loss), else 0."""
    from megatron_rl.data.addition_trace_tokenizer import AdditionTraceTokenizer

    tokenizer = AdditionTraceTokenizer()
    rows, starts = [], []
    for i in indices:
        record = records[i]
        rows.append([*record.prompt_ids, *tokenizer.encode(record.answer), EOS_ID])
        starts.append(len(record.prompt_ids))
    width = max(map(len, rows))
    tokens_BS = torch.full((len(rows), width), PAD_ID, dtype=torch.long)
    mask_BT = torch.zeros(len(rows), width - 1)
    for b, (row, start) in enumerate(zip(rows, starts, strict=True)):
        tokens_BS[b, : len(row)] = torch.tensor(row)
        mask_BT[b, start - 1 : len(row) - 1] = 1.0
    return tokens_BS, mask_BT


def train(config: WarmStartConfig, out: str) -> dict[str, float]:
    """Run the supervised steps in this process (gloo, world size 1) and save the checkpoint to
    ``out`` atomically; returns the training metrics (last-50-step mean loss, CPU seconds)."""
    from megatron_rl.backend import destroy_distributed, init_distributed
    from megatron_rl.backend.optimizer import build_optimizer, wrap_for_training
    from megatron_rl.backend.optimizer_config import OptimizerConfig
    from megatron_rl.model import build_model
    from megatron_rl.model.conversion import save_checkpoint
    from megatron_rl.model.conversion.seeded_init import init_from_seed
    from megatron_rl.model.options import ModelOptions
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.train.logprobs import forward_logits, token_logprobs
    from megatron_rl.train.task import load_policy_config
    from megatron_rl.train.task_config import TaskConfig

    start_cpu = time.process_time()
    task = AdditionTraceConfig(seed=config.seed, num_prompts=config.num_examples)
    tokenizer, records = addition_trace_task(task)
    task_config = TaskConfig(
        model=config.model, task="addition-trace", max_response_length=task.longest_response_tokens
    )
    hf_config, _ = load_policy_config(task_config, tokenizer)
    init_distributed(ParallelConfig(seed=config.seed), device="cpu")
    try:
        model = build_model(hf_config, ModelOptions())
        init_from_seed(model, hf_config, config.seed)
        wrapped = wrap_for_training(model, use_distributed_optimizer=False)
        optimizer = build_optimizer(
            wrapped, OptimizerConfig(lr=config.lr, use_distributed_optimizer=False, clip_grad=1.0)
        )
        rng = np.random.default_rng(config.seed)
        order: list[int] = []
        losses = []
        for step in range(config.steps):
            if len(order) < config.batch_size:
                order += rng.permutation(len(records)).tolist()
            batch, order = order[: config.batch_size], order[config.batch_size :]
            tokens_BS, mask_BT = worked_batch(records, batch)
            optimizer.set_lr(config.lr_at(step))
            optimizer.zero_grad()
            logprobs_BT = token_logprobs(forward_logits(wrapped, tokens_BS), tokens_BS)
            loss = -(logprobs_BT * mask_BT).sum() / mask_BT.sum()
            loss.backward()
            if optimizer.step() is None:
                raise RuntimeError(f"warm start step {step}: non-finite gradient")
            losses.append(loss.item())
            if step % 100 == 0 or step == config.steps - 1:
                logger.info("warm start step %d/%d: loss %.4f", step + 1, config.steps, losses[-1])
        tmp = out.rstrip("/") + ".tmp"
        shutil.rmtree(tmp, ignore_errors=True)
        save_checkpoint(model, hf_config, tmp)
    finally:
        destroy_distributed()
    tail = losses[-50:]
    metrics = {"train/loss": sum(tail) / len(tail), "time/cpu_s": time.process_time() - start_cpu}
    atomic_write_text(
        os.path.join(tmp, RECIPE_FILE),
        json.dumps({"recipe": asdict(config), "metrics": metrics}, indent=2),
    )
    os.replace(tmp, out)
    return metrics


def evaluate(out: str, *, samples: int, seed: int) -> dict[str, float]:
    """Held-out ``eval/*`` metrics of the checkpoint ``out`` (the trainer's `Evaluator`, the
    in-process engine, the run's default sampling: temperature 1, top-p 1) and
    ``warm_start/heldout_entropy``, the policy's mean entropy per response token of the held-out
    worked solutions (nats; uniform over 16 tokens: 2.77)."""
    from megatron_rl.backend import destroy_distributed, init_distributed
    from megatron_rl.parallel import ParallelConfig
    from megatron_rl.rewards import score_addition_trace
    from megatron_rl.rollout import InProcessEngine
    from megatron_rl.train.eval_config import BUILTIN_EVAL_SET, EvalConfig
    from megatron_rl.train.evaluation import Evaluator

    task = AdditionTraceConfig()
    heldout = addition_trace_heldout(task)
    eval_config = EvalConfig(
        eval_interval=1,
        n_samples_per_eval_prompt=samples,
        train_max_response_length=task.longest_response_tokens,
        train_reward="addition-trace",
        seed=seed,
    )
    engine = InProcessEngine.from_pretrained(out)
    init_distributed(ParallelConfig(seed=seed), device="cpu")
    try:
        evaluator = Evaluator(
            eval_config,
            {BUILTIN_EVAL_SET: heldout},
            score_addition_trace,
            _tokenizer(),
            engine=engine,
        )
        metrics = evaluator.evaluate(step=0)
    finally:
        destroy_distributed()
    metrics["warm_start/heldout_entropy"] = _reference_entropy(engine.model, heldout)
    return metrics


@torch.no_grad()
def _reference_entropy(hf_model, records) -> float:
    """Mean over response tokens of ``H(softmax(logits))`` at each target position."""
    tokens_BS, mask_BT = worked_batch(records, range(len(records)))
    logits = hf_model(input_ids=tokens_BS).logits[:, :-1].float()
    logp = torch.log_softmax(logits, dim=-1)
    entropy_BT = -(logp.exp() * logp).sum(-1)
    return float((entropy_BT * mask_BT).sum() / mask_BT.sum())


def _tokenizer():
    from megatron_rl.data.addition_trace_tokenizer import AdditionTraceTokenizer

    return AdditionTraceTokenizer()


def _cached(out: str, config: WarmStartConfig) -> dict | None:
    """The recorded run in ``out`` when its recipe is ``config``'s; ValueError when it differs."""
    path = os.path.join(out, RECIPE_FILE)
    if not os.path.exists(path):
        if os.path.exists(out):
            raise ValueError(f"--out {out}: exists but holds no {RECIPE_FILE}; choose a new folder")
        return None
    with open(path, encoding="utf-8") as handle:
        record = json.load(handle)
    if record["recipe"] != asdict(config):
        raise ValueError(
            f"--out {out} holds a warm start of another recipe ({record['recipe']}, asked "
            f"{asdict(config)}): choose a new --out or the same flags"
        )
    return record


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--out", required=True, help="checkpoint folder to write (HF format)")
    parser.add_argument("--seed", type=int, required=True, help="initial weights and batches")
    defaults = WarmStartConfig(seed=0)
    for name in ("steps", "batch_size", "lr", "warmup", "num_examples", "model"):
        value = getattr(defaults, name)
        parser.add_argument(f"--{name.replace('_', '-')}", type=type(value), default=value)
    parser.add_argument("--eval-samples", type=int, default=8, help="samples per held-out prompt")
    parser.add_argument("--no-eval", action="store_true", help="skip the held-out evaluation")
    parser.add_argument("--torch-threads", type=int, default=1)
    args = parser.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(message)s")
    from megatron_rl.threads import configure_threads

    configure_threads(args.torch_threads)
    try:
        config = WarmStartConfig(
            seed=args.seed,
            **{n: getattr(args, n) for n in ("steps", "batch_size", "lr", "warmup")},
            num_examples=args.num_examples,
            model=args.model,
        )
        record = _cached(args.out, config)
    except ValueError as err:
        parser.error(str(err))
    if record is not None:
        logger.info("warm start already in %s: %s", args.out, record.get("metrics"))
        return 0
    metrics = train(config, args.out)
    if not args.no_eval:
        metrics.update(evaluate(args.out, samples=args.eval_samples, seed=args.seed))
        atomic_write_text(
            os.path.join(args.out, RECIPE_FILE),
            json.dumps({"recipe": asdict(config), "metrics": metrics}, indent=2),
        )
    logger.info("warm start done: %s", json.dumps(metrics))
    return 0


if __name__ == "__main__":
    sys.exit(main())
