"""``summary.md`` of a study: per arm the mean and 95% t-interval over seeds of each run scalar
(`run_metrics.RUN_METRICS`), per-layer routing agreement, and each arm's Welch difference from a
reference arm. Pure string formatting: the same runs give the same bytes.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

from megatron_rl.study import stats
from megatron_rl.study.run_metrics import PROTOCOL2_METRICS, RUN_METRICS

STANDARD_NOTES = (
    "routing agreement at the behaviour pass is reported by r3 and r3rec arms only; read it "
    "against a float32-rollout arm of the same preset (identical engine and trainer "
    "numerics): that arm's value is what the metric reads without any mismatch, and the "
    "excess over it is the mismatch.",
    "routing bytes / rank: the trainer's routing/bytes_per_rank (R2 recordings, R3 sample "
    "routes); peak RSS: ru_maxrss of each run's process, so it also holds the model, the "
    "optimizer and the engine, and differences between arms are the memory story.",
)


def fmt(x: float) -> str:
    """A table cell: ``n/a`` (nan), ``x.xxe±yy`` below 1e-3 or from 1e5, else 4 significant
    digits below 1, one decimal below 1000, none above."""
    if math.isnan(x):
        return "n/a"
    if math.isinf(x):
        return "inf"
    if x != 0 and (abs(x) < 1e-3 or abs(x) >= 1e5):
        return f"{x:.2e}"
    return f"{x:.4g}" if abs(x) < 1 else f"{x:.1f}" if abs(x) < 1e3 else f"{x:.0f}"


def fmt_ci(values: Sequence[float]) -> str:
    """``mean ± half-width`` of the 95% t-interval over ``values`` (`stats.mean_ci`)."""
    m, h = stats.mean_ci(values)
    return "n/a" if math.isnan(m) else f"{fmt(m)} ± {fmt(h)}"


DIFF_METRICS = (
    "final_accuracy", "final_eval", "final_pass", "logprob_gap", "k3", "agree_behaviour",
    "agree_update", "clip_frac", "entropy", "time_step", "routing_bytes", "peak_rss_mb",
)  # fmt: skip


def summary(
    arms: dict[str, list[dict]],
    *,
    threshold: float,
    window: int,
    header: Sequence[str] = (),
    notes: Sequence[str] = (),
    reference: str | None = None,
) -> str:
    """``summary.md``: ``arms`` maps an arm's name to its runs' `run_scalars` (one per seed).

    The differences are taken from ``reference`` (default: the first arm with runs).
    """
    titles = dict(RUN_METRICS)
    titles["first_step"] = f"first step >= {threshold}"
    lines = [*header, ""]
    lines += [
        f"Mean ± half-width of the 95% Student-t interval over the K seeds of each arm "
        f"(inf: K = 1). Final accuracy and entropy: mean of the last {window} steps of a run; "
        f"final held-out mean@k / pass@k: mean of its last {window} evaluations; "
        "the log-prob gap, KL, agreements, clip fraction, s/step and routing bytes: mean over "
        "the run's steps; grad-norm spikes: steps with grad_norm > 3 x the run's median; "
        f"first step >= {threshold}: over the seeds that reach it (reached: k/K).",
        "",
        *_arm_table(arms, titles),
        *_protocol2_table(arms),
        *_layer_table(arms),
        *_difference_table(arms, titles, reference),
    ]
    if notes:
        lines += ["", "Notes:", "", *[f"- {note}" for note in notes]]
    return "\n".join(lines) + "\n"


def _arm_table(arms: dict[str, list[dict]], titles: dict[str, str]) -> list[str]:
    """One row per arm: K and every `RUN_METRICS` column as mean ± half-width."""
    lines = [
        "| arm | K | " + " | ".join(titles[k] for k, _ in RUN_METRICS) + " |",
        "|---|---|" + "---|" * len(RUN_METRICS),
    ]
    for name, runs in arms.items():
        if not runs:
            lines.append(f"| {name} | 0 | (no finished runs) |" + " |" * (len(RUN_METRICS) - 1))
            continue
        cells = []
        for key, _ in RUN_METRICS:
            column = [run[key] for run in runs]
            cell = fmt_ci(column)
            if key == "first_step":
                cell += f" (reached: {len(stats.finite(column))}/{len(runs)})"
            cells.append(cell)
        lines.append(f"| {name} | {len(runs)} | " + " | ".join(cells) + " |")
    return lines


def _protocol2_table(arms: dict[str, list[dict]]) -> list[str]:
    """Protocol 2's teacher-forced score and per-update diagnostics (`PROTOCOL2_METRICS`);
    empty when no run reports them."""
    if not any("exact_auc" in run for runs in arms.values() for run in runs):
        return []
    lines = [
        "",
        "Teacher-forced held-out score (`eval/exact_p`, the exact probability of the one correct "
        "response; AUC: normalised area under its curve over the run's evaluations) and the "
        "diagnostics of every update (largest / smallest over the run's steps), mean ± "
        "half-width over seeds:",
        "",
        "| arm | " + " | ".join(title for _, title in PROTOCOL2_METRICS) + " |",
        "|---|" + "---|" * len(PROTOCOL2_METRICS),
    ]
    for name, runs in arms.items():
        if runs and "exact_auc" in runs[0]:
            cells = [fmt_ci([run.get(k, math.nan) for run in runs]) for k, _ in PROTOCOL2_METRICS]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _layer_table(arms: dict[str, list[dict]]) -> list[str]:
    """Behaviour-pass routing agreement per MoE layer (empty when no arm reports layers)."""
    layer_keys = sorted(
        {k for runs in arms.values() for run in runs for k in run if k.startswith("layer_")},
        key=lambda k: int(k.split("_")[1]),
    )
    if not layer_keys:
        return []
    lines = [
        "",
        "Routing agreement at the behaviour pass (engine routes vs the trainer's, same "
        "weights) per MoE layer, mean over steps, then over seeds:",
        "",
        "| arm | " + " | ".join(layer_keys) + " |",
        "|---|" + "---|" * len(layer_keys),
    ]
    for name, runs in arms.items():
        if runs and any(k in runs[0] for k in layer_keys):
            cells = [fmt_ci([run.get(k, math.nan) for run in runs]) for k in layer_keys]
            lines.append(f"| {name} | " + " | ".join(cells) + " |")
    return lines


def _difference_table(
    arms: dict[str, list[dict]], titles: dict[str, str], reference: str | None
) -> list[str]:
    """Each arm's Welch difference from the reference arm per `DIFF_METRICS` metric."""
    names = [n for n, runs in arms.items() if runs]
    reference = reference or (names[0] if names else None)
    if reference not in arms or len(names) < 2:
        return []
    lines = [
        "",
        f"Differences from the reference arm `{reference}`: mean difference (arm - "
        "reference) with its 95% Welch interval. 'within CI': the interval contains 0, so "
        "these seeds do not tell the arms apart on that metric. One interval per cell, no "
        "correction for the number of comparisons.",
        "",
        "| arm | metric | difference | 95% interval | verdict |",
        "|---|---|---|---|---|",
    ]
    for name in names:
        if name == reference:
            continue
        for key in DIFF_METRICS:
            a = [run[key] for run in arms[name]]
            b = [run[key] for run in arms[reference]]
            d, h = stats.welch_diff_ci(a, b)
            if math.isnan(d):
                continue
            if math.isinf(h):
                verdict = "undefined (K < 2)"
            elif abs(d) <= h:
                verdict = "within CI"
            else:
                verdict = "higher" if d > 0 else "lower"
            interval = f"[{fmt(d - h)}, {fmt(d + h)}]" if not math.isinf(h) else "(-inf, inf)"
            lines.append(f"| {name} | {titles[key]} | {fmt(d)} | {interval} | {verdict} |")
    return lines
