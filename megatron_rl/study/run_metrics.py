"""One run's per-step metrics (the rows of its ``metrics.jsonl``) reduced to the study's numbers.

A row is ``{"step": s, name: value, ...}``. `run_scalars` turns a run's rows into the scalars a
summary aggregates over seeds (`RUN_METRICS`); `PANELS` are the per-step curves a study draws.
`is_needed` says which metric names either reads, so a run's record (`records`) keeps only those.
"""

from __future__ import annotations

import math

from megatron_rl.study import paired, stats

# (key, panel title); ``clip_frac`` and ``eval_mean`` are derived by `value`
PANELS = (
    ("eval/exact_p", "held-out exact_p (teacher-forced)"),
    ("eval_mean", "held-out mean@k"),
    ("accuracy", "accuracy"),
    ("reward/mean", "reward"),
    ("clip_frac", "clip fraction (any side)"),
    ("entropy", "entropy"),
    ("routing/agreement/behaviour", "routing agreement, engine vs trainer"),
    ("routing/agreement/update", "routing agreement after updates"),
    ("mismatch/train_rollout_logprob_abs_gap", "|train - rollout| log-prob"),
    ("grad_norm", "grad norm"),
    ("policy/clip_position_cv", "clip position CV"),
)

# panels drawn only when some run reports them (protocol 2's metrics; earlier records lack them)
OPTIONAL_PANELS = frozenset({"eval/exact_p"})

# (key, column title); the per-run scalar each row of summary.md aggregates over seeds
RUN_METRICS = (
    ("final_accuracy", "final accuracy"),
    ("final_eval", "final held-out mean@k"),
    ("final_pass", "final held-out pass@k"),
    ("first_step", "first step >= threshold"),
    ("logprob_gap", "abs log-prob gap"),
    ("k3", "train/rollout k3 KL"),
    ("agree_behaviour", "agreement behaviour"),
    ("agree_update", "agreement update"),
    ("clip_frac", "clip frac"),
    ("clip_cv", "clip position CV"),
    ("grad_spikes", "grad-norm spikes"),
    ("entropy", "final entropy"),
    ("wall_s", "wall s"),
    ("time_step", "s / step"),
    ("routing_bytes", "routing bytes / rank"),
    ("peak_rss_mb", "peak RSS MiB"),
)

_NEEDED_NAMES = frozenset(
    {
        "accuracy", "reward/mean", "entropy", "grad_norm", "time/step", "routing/bytes_per_rank",
        "routing/agreement/behaviour", "routing/agreement/update", "policy/clip_position_cv",
        "mismatch/train_rollout_logprob_abs_gap", "mismatch/train_rollout_k3",
    }
)  # fmt: skip
_NEEDED_PREFIXES = (
    "eval/",  # sampled and teacher-forced (exact_p) held-out metrics, per set and averaged
    "grad_norm/",  # the max and mean over a step's N updates
    "ratio/",  # quantiles of pi / pi_old and pi / mu per token
    "mismatch/train_rollout_logprob_abs_gap/pos_",
    "routing/agreement/behaviour/layer_",
)
_NEEDED_SUFFIXES = ("clip_frac_high", "clip_frac_low")


def is_needed(name: str) -> bool:
    """Whether `run_scalars` or a `PANELS` curve reads the metric ``name`` of a row."""
    return (
        name in _NEEDED_NAMES
        or name.startswith(_NEEDED_PREFIXES)
        or name.endswith(_NEEDED_SUFFIXES)
    )


def clip_fraction(row: dict) -> float | None:
    """Sum of the row's ``*clip_frac_high`` and ``*clip_frac_low`` (None when it has neither)."""
    values = [
        v
        for k, v in row.items()
        if (k.endswith("clip_frac_high") or k.endswith("clip_frac_low")) and v is not None
    ]
    return sum(values) if values else None


def value(row: dict, key: str) -> float | None:
    """The row's ``key``; ``clip_frac`` and ``eval_mean`` (held-out ``eval/mean@n``) derived."""
    if key == "clip_frac":
        return clip_fraction(row)
    if key == "eval_mean":  # the held-out eval/mean@n, whatever n
        return next((v for k, v in row.items() if k.startswith("eval/mean@")), None)
    return row.get(key)


def curve(rows: list[dict], key: str) -> dict[int, float]:
    """``{step: value}`` of ``key`` over the rows that report a finite value."""
    out = {}
    for row in rows:
        v = value(row, key)
        if v is not None and not (isinstance(v, float) and math.isnan(v)):
            out[int(row["step"])] = float(v)
    return out


def mean_over_steps(rows: list[dict], key: str) -> float:
    """Mean of ``key`` over the steps that report it; nan when none does."""
    xs = list(curve(rows, key).values())
    return sum(xs) / len(xs) if xs else math.nan


def final_eval(rows: list[dict], window: int, metric: str = "mean") -> float:
    """The mean of the last ``window`` held-out evaluations' ``eval/<metric>@k`` (``mean`` or
    ``pass``; nan without)."""
    keys = sorted({k for row in rows for k in row if k.startswith(f"eval/{metric}@")})
    if not keys:
        return math.nan
    return stats.tail_mean(list(curve(rows, keys[0]).values()), window)


def run_scalars(rows: list[dict], marker: dict, threshold: float, window: int) -> dict:
    """One run's summary numbers (nan where the run does not report the metric).

    ``marker``: the run's ``wall_s`` and ``peak_rss_mb`` (either may be missing: nan).
    """
    acc = curve(rows, "accuracy")
    first = stats.first_step_reaching(list(acc), list(acc.values()), threshold)
    out = {
        "final_accuracy": stats.tail_mean(list(acc.values()), window),
        "first_step": math.nan if first is None else float(first),
        "logprob_gap": mean_over_steps(rows, "mismatch/train_rollout_logprob_abs_gap"),
        "k3": mean_over_steps(rows, "mismatch/train_rollout_k3"),
        "agree_behaviour": mean_over_steps(rows, "routing/agreement/behaviour"),
        "agree_update": mean_over_steps(rows, "routing/agreement/update"),
        "clip_frac": mean_over_steps(rows, "clip_frac"),
        "clip_cv": mean_over_steps(rows, "policy/clip_position_cv"),
        "grad_spikes": float(stats.spike_count(list(curve(rows, "grad_norm").values()))),
        "entropy": stats.tail_mean(list(curve(rows, "entropy").values()), window),
        "wall_s": float(marker.get("wall_s", math.nan)),
        "time_step": mean_over_steps(rows, "time/step"),
        "routing_bytes": mean_over_steps(rows, "routing/bytes_per_rank"),
        "peak_rss_mb": float(marker.get("peak_rss_mb", math.nan)),
        "final_eval": final_eval(rows, window),
        "final_pass": final_eval(rows, window, "pass"),
    }
    out.update(protocol2_scalars(rows))
    layers = sorted(
        {k for row in rows for k in row if k.startswith("routing/agreement/behaviour/layer_")},
        key=lambda k: int(k.rsplit("_", 1)[1]),
    )
    for key in layers:
        out["layer_" + key.rsplit("_", 1)[1]] = mean_over_steps(rows, key)
    return out


# (key, column title): protocol 2's per-run numbers, present only when the run reports
# ``eval/exact_p`` (docs/study.md); ``exact_*`` over its evaluations, the rest over its steps
PROTOCOL2_METRICS = (
    ("exact_first", "exact_p at step 0"),
    ("exact_auc", "exact_p AUC"),
    ("exact_last", "exact_p last"),
    ("exact_logp_auc", "exact_logp AUC"),
    ("grad_max", "largest grad_norm/max"),
    ("grad_mean", "mean grad_norm/mean"),
    ("ratio_old_q999", "largest pi/pi_old q0.999"),
    ("ratio_mu_q999", "largest pi/mu q0.999"),
    ("ratio_mu_q001", "smallest pi/mu q0.001"),
)


def protocol2_scalars(rows: list[dict]) -> dict:
    """`PROTOCOL2_METRICS` of one run; empty when it has no ``eval/exact_p``."""
    exact = curve(rows, "eval/exact_p")
    if not exact:
        return {}

    def extreme(key: str, pick) -> float:
        values = list(curve(rows, key).values())
        return pick(values) if values else math.nan

    auc = paired.area_under_curve
    logp = curve(rows, "eval/exact_logp")
    return {
        "exact_first": exact[min(exact)],
        "exact_auc": auc(exact) if len(exact) > 1 else math.nan,
        "exact_last": exact[max(exact)],
        "exact_logp_auc": auc(logp) if len(logp) > 1 else math.nan,
        "grad_max": extreme("grad_norm/max", max),
        "grad_mean": mean_over_steps(rows, "grad_norm/mean"),
        "ratio_old_q999": extreme("ratio/pi_old/q0.999", max),
        "ratio_mu_q999": extreme("ratio/pi_mu/q0.999", max),
        "ratio_mu_q001": extreme("ratio/pi_mu/q0.001", min),
    }
