"""A study's pre-declared analysis: one primary score, at most 4 comparisons, paired by seed.

The declaration is a JSON file written before the grid runs (``analysis.json`` beside a
setting's ``runs/`` folder, e.g. ``docs/study/<setting>/analysis.json``)::

    {
      "primary": {"metric": "eval/heldout/exact_p", "score": "auc"},
      "alpha": 0.05,
      "seeds": 8,
      "comparisons": [
        {"a": "grpo-r3-N8", "b": "grpo-r3rec-N8", "expected": "a > b",
         "claim": "R3 keeps learning under the mismatch (EPIC Sec. 9.5)"}
      ]
    }

* ``primary.metric``: a record column; ``primary.score`` per run: ``auc`` (the normalised area
  under the metric's curve over the run's evaluations, `paired.area_under_curve`: a flat curve
  at v scores v) or ``last`` (its last value).
* each comparison's per-seed differences d_s = score(a, s) - score(b, s) over the seeds both
  arms ran (`paired.paired_values`; a seed that one arm lacks is an error, not dropped);
  the paired t interval and p-value, the exact sign-flip p as a distribution-free check, and
  Holm's adjustment over the declared comparisons (of the paired t p-values).
* verdict: Holm-adjusted p < ``alpha`` and the mean difference in the ``expected`` direction:
  **agrees**; in the other direction: **disagrees**; otherwise **not distinguishable**. Until
  both arms of a comparison have the declared number of ``seeds`` (default 8), the verdict is
  **pending (k of n seeds)**: the interim numbers are shown, never judged.

Nothing else a summary prints is covered by this correction: it is exploratory.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

from megatron_rl.study import paired
from megatron_rl.study.records import Record

DECLARATION = "analysis.json"
MAX_COMPARISONS = 4
_SCORES = ("auc", "last")
_EXPECTED = ("a > b", "a < b")


@dataclasses.dataclass(frozen=True)
class Comparison:
    a: str
    b: str
    expected: str
    claim: str


@dataclasses.dataclass(frozen=True)
class Declaration:
    metric: str
    score: str
    alpha: float
    comparisons: tuple[Comparison, ...]
    seeds: int = 8

    def __post_init__(self) -> None:
        if self.score not in _SCORES:
            raise ValueError(f"primary.score {self.score!r}: use one of {', '.join(_SCORES)}")
        if not 0.0 < self.alpha < 1.0:
            raise ValueError(f"alpha {self.alpha!r}: must be in (0, 1)")
        if isinstance(self.seeds, bool) or not isinstance(self.seeds, int) or self.seeds < 2:
            raise ValueError(f"seeds {self.seeds!r}: the declared seeds per arm, an int >= 2")
        if not 1 <= len(self.comparisons) <= MAX_COMPARISONS:
            raise ValueError(
                f"comparisons: {len(self.comparisons)} declared; declare 1 to "
                f"{MAX_COMPARISONS} (everything else is exploratory)"
            )
        for c in self.comparisons:
            if c.expected not in _EXPECTED:
                raise ValueError(f"comparison {c.a} vs {c.b}: expected {c.expected!r}: use "
                                 f"{' or '.join(repr(e) for e in _EXPECTED)}")  # fmt: skip
            if c.a == c.b:
                raise ValueError(f"comparison {c.a} vs {c.b}: compare two different arms")


def load_declaration(path: str | os.PathLike) -> Declaration:
    """The declaration in ``path`` (module docstring); ValueError naming the file and field."""
    try:
        data = json.loads(Path(path).read_text(encoding="utf-8"))
        primary = data["primary"]
        comparisons = tuple(
            Comparison(c["a"], c["b"], c["expected"], c.get("claim", ""))
            for c in data["comparisons"]
        )
        return Declaration(
            metric=primary["metric"],
            score=primary.get("score", "auc"),
            alpha=float(data.get("alpha", 0.05)),
            comparisons=comparisons,
            seeds=data.get("seeds", 8),
        )
    except KeyError as missing:
        raise ValueError(f"{path}: the field {missing} is missing (see declared.py)") from None
    except (ValueError, TypeError) as err:
        raise ValueError(f"{path}: {err}") from None


def run_score(record: Record, metric: str, score: str) -> float:
    """One run's primary score: ``auc`` or ``last`` of column ``metric`` (module docstring)."""
    if metric not in record.metrics:
        raise ValueError(
            f"{record.file_name}: no column {metric!r} (the record's run did not report it)"
        )
    curve = {
        step: float(v)
        for step, v in zip(record.steps, record.metrics[metric], strict=True)
        if v is not None and math.isfinite(v)
    }
    if not curve:
        raise ValueError(f"{record.file_name}: column {metric!r} has no finite value")
    if score == "last":
        return curve[max(curve)]
    return paired.area_under_curve(curve)


@dataclasses.dataclass(frozen=True)
class Result:
    comparison: Comparison
    seeds: tuple[int, ...]
    mean_a: float
    mean_b: float
    test: paired.PairedTest
    sign_flip_p: float
    holm_p: float
    verdict: str


def analyse(declaration: Declaration, arms: Mapping[str, Sequence[Record]]) -> list[Result]:
    """Every declared comparison on the records of ``arms`` (by arm name), Holm-adjusted.

    A grid in progress: a comparison whose arms share fewer than 2 seeds (an arm with no record
    yet included) has no test (nan) and counts as p = 1 in Holm's adjustment; every comparison
    short of the declared seeds is "pending"."""
    scores: dict[str, dict[int, float]] = {}
    for c in declaration.comparisons:
        for arm in (c.a, c.b):
            scores[arm] = {
                r.seed: run_score(r, declaration.metric, declaration.score)
                for r in arms.get(arm, ())
            }
    nan = paired.PairedTest(0, math.nan, math.nan, math.nan, math.nan)
    partial = []
    for c in declaration.comparisons:
        common = sorted(set(scores[c.a]) & set(scores[c.b]))
        if len(common) < 2:
            partial.append((c, common, nan, math.nan))
            continue
        a = {s: scores[c.a][s] for s in common}
        seeds, diffs = paired.paired_values(a, {s: scores[c.b][s] for s in common})
        flip = paired.sign_flip_p(diffs) if len(diffs) <= paired.SIGN_FLIP_MAX_N else math.nan
        partial.append((c, seeds, paired.paired_t(diffs), flip))
    adjusted = paired.holm([1.0 if math.isnan(t.p) else t.p for _, _, t, _ in partial])
    results = []
    for (c, seeds, test, flip), holm_p in zip(partial, adjusted, strict=True):
        complete = min(len(scores[c.a]), len(scores[c.b])) >= declaration.seeds
        verdict = "not distinguishable"
        if not complete or math.isnan(test.p):
            verdict = f"pending ({len(seeds)} of {declaration.seeds} seeds)"
        elif holm_p < declaration.alpha:
            wanted = test.mean > 0 if c.expected == "a > b" else test.mean < 0
            verdict = "agrees" if wanted else "disagrees"
        results.append(
            Result(
                c,
                tuple(seeds),
                _mean_over(scores[c.a], seeds),
                _mean_over(scores[c.b], seeds),
                test,
                flip,
                math.nan if math.isnan(test.p) else holm_p,
                verdict,
            )
        )
    return results


def _mean_over(scores: Mapping[int, float], seeds: Sequence[int]) -> float:
    """The mean of ``scores`` over ``seeds`` (nan for none)."""
    return sum(scores[s] for s in seeds) / len(seeds) if seeds else math.nan


def render(declaration: Declaration, results: Sequence[Result]) -> list[str]:
    """The summary's first section: the declared comparisons as a markdown table."""

    def f(x: float) -> str:
        return "nan" if math.isnan(x) else f"{x:.4g}"

    score = "normalised area under the curve" if declaration.score == "auc" else "last value"
    lines = [
        "## Declared comparisons (primary analysis)",
        "",
        f"Primary score per run: the {score} of `{declaration.metric}`. Each comparison is "
        "paired by seed (d = a - b); 95% paired t interval; p: paired t, two-sided; "
        f"Holm over the {len(results)} declared comparisons at alpha = {declaration.alpha:g}; "
        "sign-flip: the exact permutation p, a distribution-free check. Verdict against the "
        "claim's expected direction. Everything below this section is exploratory.",
        "",
        "| a | b | claim | expected | seeds | mean a | mean b | d [95% CI] | p | Holm p "
        "| sign-flip p | verdict |",
        "|---|---|---|---|---|---|---|---|---|---|---|---|",
    ]
    for r in results:
        c, t = r.comparison, r.test
        lines.append(
            f"| {c.a} | {c.b} | {c.claim} | {c.expected} | {len(r.seeds)} | {f(r.mean_a)} | "
            f"{f(r.mean_b)} | {f(t.mean)} [{f(t.low)}, {f(t.high)}] | {f(t.p)} | "
            f"{f(r.holm_p)} | {f(r.sign_flip_p)} | **{r.verdict}** |"
        )
    return [*lines, ""]
