"""On-policy distillation (``--loss-teacher``): a teacher scores every token the student sampled,
and the per-token reverse KL enters the advantage.

The advantage of response token ``t`` of a sample with group advantage ``A`` (slime's ``--use-opd``
semantics, Thinking Machines' on-policy distillation, with a weight on the task term):

    ``A_t = w * A - lambda * (log pi_student(y_t) - log pi_teacher(y_t))``

``lambda`` is ``--teacher-kl-coef`` (1.0), ``w`` is ``--teacher-task-weight`` (1.0; 0 is pure
distillation). ``log pi_student`` is the loss's behaviour log-prob (``--behavior-logprobs``: the
trainer's recompute or the engine's), ``log pi_teacher`` the teacher's log-prob of the same token
after the same prefix at temperature 1; ``log pi_student - log pi_teacher`` is the single-sample
(k1) estimate of the token's reverse KL ``KL(pi_student || pi_teacher)``, so maximising the
advantage moves the student toward the teacher's modes on the student's own samples.

Teachers (the student's tokenizer: the same vocabulary; any size or depth):

- an HF folder (config.json + safetensors, e.g. the study's warm start): loaded once per rank into
  an in-process engine (float32, its own RNG stream, so the run's initialisation is unchanged);
- ``sglang:URL``: an SGLang server serving the teacher; one batched ``/generate`` per rollout with
  ``max_new_tokens = 0`` and ``return_logprob`` from position 0 (``input_token_logprobs``).

The teacher's log-probs are attached to the rollout's samples (`TrainSample.teacher_logprobs`)
before the updates; R3/R2 replay and the rollout corrections are unaffected (they read the
student's routes and log-probs only).
"""

from __future__ import annotations

import math
import os
from collections.abc import Sequence
from dataclasses import dataclass

import torch

from megatron_rl.flags import bad_value, option
from megatron_rl.train.batch import trained_tokens

SGLANG_PREFIX = "sglang:"
KL_TYPES = ("forward", "reverse", "mixed")


@dataclass(frozen=True, kw_only=True, slots=True)
class TeacherConfig:
    """On-policy distillation from a teacher model (off by default)."""

    loss_teacher: str | None = option(
        None,
        help="on-policy distillation: the teacher that scores every sampled token, an HF folder "
        "(loaded in-process) or sglang:URL (a server serving it); its per-token reverse KL "
        "enters the advantage (megatron_rl/train/teacher.py)",
    )
    teacher_kl_coef: float | None = option(
        None, help="with --loss-teacher: lambda, the weight of the per-token reverse KL (1.0)"
    )
    teacher_task_weight: float | None = option(
        None,
        help="with --loss-teacher: w, the weight of the task's group advantage (1.0; 0: pure "
        "distillation)",
    )
    teacher_timeout: float = option(
        600.0, help="with --loss-teacher sglang:URL: seconds one scoring request may take"
    )
    teacher_topk: int = option(
        0,
        help="with --loss-teacher: K > 0 replaces the sampled token's reverse-KL advantage by a "
        "KL loss term over the teacher's K most likely tokens at every response position "
        "(NeMo-RL's distillation loss; K = the vocabulary size: the exact KL); 0: off",
    )
    teacher_kl_type: str | None = option(
        None,
        choices=KL_TYPES,
        help="with --teacher-topk: forward KL(teacher || student) (the default), reverse "
        "KL(student || teacher), or mixed (--teacher-mixed-kl-weight of forward)",
    )
    teacher_mixed_kl_weight: float | None = option(
        None, help="with --teacher-kl-type mixed: alpha, the forward KL's weight (0.5)"
    )

    def __post_init__(self) -> None:
        for name in ("teacher_kl_coef", "teacher_task_weight"):
            value = getattr(self, name)
            if value is None:
                continue
            if self.loss_teacher is None:  # e.g. a recipe's distillation arm without a teacher
                raise bad_value(self, name, "weighs a teacher's signal: pass --loss-teacher too")
            if not (math.isfinite(value) and value >= 0):
                raise bad_value(self, name, "must be a finite number >= 0")
        if not (math.isfinite(self.teacher_timeout) and self.teacher_timeout > 0):
            raise bad_value(self, "teacher_timeout", "must be a number of seconds > 0")
        if self.teacher_topk < 0:
            raise bad_value(self, "teacher_topk", "must be >= 0 (0: the sampled token's KL)")
        if self.teacher_topk and self.loss_teacher is None:
            raise bad_value(self, "teacher_topk", "distils from a teacher: pass --loss-teacher too")
        if self.teacher_kl_type is not None and not self.teacher_topk:
            raise bad_value(self, "teacher_kl_type", "shapes the top-K KL: pass --teacher-topk K")
        if self.teacher_kl_type not in (None, *KL_TYPES):
            raise bad_value(self, "teacher_kl_type", f"must be one of {', '.join(KL_TYPES)}")
        weight = self.teacher_mixed_kl_weight
        if weight is not None:
            if self.teacher_kl_type != "mixed":
                raise bad_value(
                    self, "teacher_mixed_kl_weight", "weighs --teacher-kl-type mixed: pass it too"
                )
            if not (0.0 <= weight <= 1.0):
                raise bad_value(self, "teacher_mixed_kl_weight", "must be in [0, 1]")
        teacher = self.loss_teacher
        if teacher is None:
            return
        if teacher.startswith(SGLANG_PREFIX):
            url = teacher[len(SGLANG_PREFIX) :]
            if not url.startswith(("http://", "https://")):
                raise bad_value(self, "loss_teacher", "write sglang:http://HOST:PORT")
        elif not os.path.isfile(os.path.join(teacher, "config.json")):
            raise bad_value(
                self,
                "loss_teacher",
                "is neither an HF folder (no config.json there) nor sglang:URL",
            )

    @property
    def enabled(self) -> bool:
        return self.loss_teacher is not None

    @property
    def kl_coef(self) -> float:
        """lambda: ``--teacher-kl-coef``, 1.0 when not given."""
        return 1.0 if self.teacher_kl_coef is None else self.teacher_kl_coef

    @property
    def task_weight(self) -> float:
        """w: ``--teacher-task-weight``, 1.0 when not given."""
        return 1.0 if self.teacher_task_weight is None else self.teacher_task_weight

    @property
    def kl_type(self) -> str:
        """``--teacher-kl-type``, forward when not given (NeMo-RL's default)."""
        return self.teacher_kl_type or "forward"

    @property
    def mixed_kl_weight(self) -> float:
        """alpha: ``--teacher-mixed-kl-weight``, 0.5 when not given."""
        return 0.5 if self.teacher_mixed_kl_weight is None else self.teacher_mixed_kl_weight


def distillation_advantages(
    advantages_B: torch.Tensor,
    student_logprobs_BT: torch.Tensor,
    teacher_logprobs_BT: torch.Tensor,
    loss_mask_BT: torch.Tensor,
    *,
    kl_coef: float,
    task_weight: float,
) -> torch.Tensor:
    """float32 ``[b, T]``: ``w * A_b - lambda * (log pi_s - log pi_t)`` on ``loss_mask``, 0 off it.

    ``student_logprobs_BT`` is detached (an advantage carries no gradient); a non-finite teacher
    or student log-prob inside the mask is a ValueError naming its position."""
    mask = loss_mask_BT.bool()
    gap_BT = student_logprobs_BT.detach().float() - teacher_logprobs_BT.float()
    if not bool(torch.isfinite(gap_BT[mask]).all()):
        bad = (~torch.isfinite(gap_BT) & mask).nonzero()[0].tolist()
        raise ValueError(
            f"distillation: non-finite student or teacher log-prob at (row, position) {bad}"
        )
    out_BT = task_weight * advantages_B.float()[:, None] - kl_coef * gap_BT
    return torch.where(mask, out_BT, torch.zeros_like(out_BT))


class Teacher:
    """Scores samples: ``score(sequences) -> [log-probs of tokens 1..S-1]`` per sequence."""

    def __init__(self, config: TeacherConfig, vocab_size: int):
        self.config = config
        spec = config.loss_teacher
        self.url = spec[len(SGLANG_PREFIX) :] if spec.startswith(SGLANG_PREFIX) else None
        self.engine = None
        if self.url is None:
            from megatron_rl.rollout import InProcessEngine

            with torch.random.fork_rng():  # the run's RNG stream stays as without a teacher
                self.engine = InProcessEngine.from_pretrained(spec)
            theirs = self.engine.vocab_size
            if theirs != vocab_size:
                raise ValueError(
                    f"--loss-teacher {spec}: its vocabulary has {theirs} tokens, the student's "
                    f"{vocab_size}; distillation compares log-probs of the same token ids, so the "
                    "teacher needs the student's tokenizer"
                )
        if config.teacher_topk > vocab_size:
            raise ValueError(
                f"--teacher-topk {config.teacher_topk}: the vocabulary has {vocab_size} tokens; "
                f"K = {vocab_size} is already the exact KL"
            )

    def score(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        """float32 ``[S - 1]`` per sequence: ``log p_teacher(s[i + 1] | s[: i + 1])``, T = 1."""
        if self.engine is not None:
            return [self.engine.score(ids) for ids in sequences]
        return self._score_remote(sequences)

    def score_topk(self, sequences: Sequence[Sequence[int]], k: int) -> list[tuple]:
        """Per sequence: the float32 ``[S - 1]`` of `score`, and float32 log-probs and int32 ids
        ``[S - 1, k]`` of the teacher's ``k`` most likely tokens after each prefix
        ``s[: i + 1]`` (T = 1, log-probs descending)."""
        if self.engine is None:
            return self._score_topk_remote(sequences, k)
        out = []
        with torch.inference_mode():
            for ids in sequences:
                ids_1S = torch.tensor([list(ids)], device=self.engine.config.device)
                logits_SV = self.engine.model(input_ids=ids_1S).logits[0, :-1].float()
                logp_SV = torch.log_softmax(logits_SV, dim=-1)
                values, top = logp_SV.topk(k, dim=-1)
                sampled = logp_SV.gather(-1, ids_1S[0, 1:, None]).squeeze(-1)
                out.append((sampled.cpu(), values.cpu(), top.to(torch.int32).cpu()))
        return out

    def _generate(self, sequences: Sequence[Sequence[int]], **extra) -> list[dict]:
        """The server's ``meta_info`` per sequence: one ``/generate`` scoring them all."""
        from megatron_rl.rollout.http_pool import request_json

        payload = {
            "input_ids": [[int(t) for t in ids] for ids in sequences],
            "sampling_params": {"max_new_tokens": 0, "temperature": 0.0},
            "return_logprob": True,
            "logprob_start_len": 0,
            **extra,
        }
        status, body = request_json(
            self.url, "POST", "/generate", payload, timeout_s=self.config.teacher_timeout
        )
        if status != 200 or not isinstance(body, list) or len(body) != len(sequences):
            raise RuntimeError(
                f"--loss-teacher {self.config.loss_teacher}: scoring {len(sequences)} sequences "
                f"answered {status}: {str(body)[:300]}"
            )
        return [answer.get("meta_info", {}) for answer in body]

    def _score_topk_remote(self, sequences, k: int) -> list[tuple]:
        out = []
        metas = self._generate(sequences, top_logprobs_num=k)
        sampled = self._token_logprobs(sequences, metas)
        for n, (ids, meta) in enumerate(zip(sequences, metas, strict=True)):
            rows = meta.get("input_top_logprobs")
            if not isinstance(rows, list) or len(rows) != len(ids):
                raise RuntimeError(
                    f"--loss-teacher --teacher-topk {k}: sequence {n} of {len(ids)} tokens got "
                    f"{len(rows) if isinstance(rows, list) else rows} rows of top log-probs"
                )
            values = torch.full((len(ids) - 1, k), float("-inf"))
            top = torch.full((len(ids) - 1, k), -1, dtype=torch.int32)
            for i, row in enumerate(rows[1:]):  # row i: the candidates after ids[: i + 1]
                entries = sorted(row or [], key=lambda e: -float(e[0]))[:k]
                if not entries:
                    raise RuntimeError(f"--teacher-topk: no candidates at position {i + 1}")
                values[i, : len(entries)] = torch.tensor([float(e[0]) for e in entries])
                top[i, : len(entries)] = torch.tensor([int(e[1]) for e in entries])
            out.append((sampled[n], values, top))
        return out

    def _score_remote(self, sequences: Sequence[Sequence[int]]) -> list[torch.Tensor]:
        return self._token_logprobs(sequences, self._generate(sequences))

    def _token_logprobs(self, sequences, metas: list[dict]) -> list[torch.Tensor]:
        """float32 ``[S - 1]`` per sequence from the server's ``input_token_logprobs``."""
        out = []
        for k, (ids, meta) in enumerate(zip(sequences, metas, strict=True)):
            entries = meta.get("input_token_logprobs")
            if not isinstance(entries, list) or len(entries) != len(ids):
                raise RuntimeError(
                    f"--loss-teacher: sequence {k} of {len(ids)} tokens got "
                    f"{len(entries) if isinstance(entries, list) else entries} input log-probs"
                )
            out.append(torch.tensor([float(e[0]) for e in entries[1:]], dtype=torch.float32))
        return out

    def annotate(self, samples: list) -> dict[str, float]:
        """Set every `TrainSample`'s ``teacher_logprobs`` (float32 ``[R]``) and, with
        ``--teacher-topk K``, its ``teacher_topk`` (log-probs float32 ``[R, K]``, ids int32
        ``[R, K]``); returns the metrics ``teacher/logprob`` (mean over trained tokens) and
        ``teacher/reverse_kl_k1`` (mean of ``log mu - log pi_teacher``, the engine's log-probs:
        the rollout's KL)."""
        todo = [s for s in samples if s.teacher_logprobs is None]
        sequences = [s.prompt_ids.tolist() + s.response_ids.tolist() for s in todo]
        k = self.config.teacher_topk
        if k:  # the sampled token's log-prob too (the metrics): one pass gives both
            scored = self.score_topk(sequences, k)
        else:
            scored = [(score, None, None) for score in self.score(sequences)]
        for sample, (score, values, ids) in zip(todo, scored, strict=True):
            first = sample.prompt_ids.numel() - 1
            sample.teacher_logprobs = score[first:]
            if values is not None:
                sample.teacher_topk = (values[first:], ids[first:])
        teacher, gap = [], []
        for s in samples:
            mask = trained_tokens(s)
            teacher.append(s.teacher_logprobs[mask])
            gap.append((s.rollout_logprobs - s.teacher_logprobs)[mask])
        teacher, gap = torch.cat(teacher), torch.cat(gap)
        tops = [s.teacher_topk[0] for s in todo if s.teacher_topk is not None]
        if torch.isnan(teacher).any() or any(torch.isnan(t).any() for t in tops):
            raise ValueError(f"--loss-teacher {self.config.loss_teacher}: a NaN log-prob")
        count = max(teacher.numel(), 1)
        return {
            "teacher/logprob": float(teacher.sum()) / count,
            "teacher/reverse_kl_k1": float(gap.sum()) / count,
        }
