"""The pre-declared analysis (megatron_rl/study/declared.py): scores, pairing, Holm, verdicts."""

from __future__ import annotations

import json
import math

import pytest

from megatron_rl.study import declared, paired, regenerate
from megatron_rl.study.records import make_record, write_record

METRIC = "eval/heldout/exact_p"


def _record(arm: str, seed: int, curve: dict[int, float], flags=("--lr", "1e-4")):
    rows = [{"step": s, METRIC: v, "accuracy": v} for s, v in curve.items()]
    marker = {"flags": [*flags, "--seed", str(seed)], "revision": "abc", "dirty": False}
    return make_record(arm, seed, rows, marker)


def _arms(shift: float, seeds=range(1, 9)):
    """Arm ``a`` = arm ``b`` + ``shift`` + a small per-seed wobble; b's level varies by seed a
    lot (so that only pairing sees the shift)."""
    arms = {"a": [], "b": []}
    for s in seeds:
        base = 0.3 + 0.05 * s
        wobble = 0.002 * ((-1) ** s)
        arms["b"].append(_record("b", s, {0: base, 10: base + 0.1, 20: base + 0.2}))
        shifted = {0: base + shift + wobble, 10: base + 0.1 + shift, 20: base + 0.2 + shift}
        arms["a"].append(_record("a", s, shifted))
    return arms


def _declaration(*comparisons, score="auc"):
    return declared.Declaration(
        metric=METRIC, score=score, alpha=0.05, comparisons=tuple(comparisons)
    )


def test_a_run_scores_the_normalised_area_or_the_last_value():
    record = _record("a", 1, {0: 0.2, 10: 0.4, 30: 0.4})
    assert declared.run_score(record, METRIC, "auc") == pytest.approx((10 * 0.3 + 20 * 0.4) / 30)
    assert declared.run_score(record, METRIC, "last") == 0.4
    with pytest.raises(ValueError, match=r"a__seed1\.json: no column 'eval/other'"):
        declared.run_score(record, "eval/other", "auc")


def test_a_consistent_paired_shift_agrees_and_the_opposite_claim_disagrees():
    arms = _arms(shift=0.02)
    up = declared.Comparison("a", "b", "a > b", "a learns more")
    down = declared.Comparison("a", "b", "a < b", "a learns less")
    results = declared.analyse(_declaration(up, down), arms)
    assert [r.verdict for r in results] == ["agrees", "disagrees"]
    early = {arm: records[:3] for arm, records in arms.items()}  # 3 of the declared 8 seeds
    assert [r.verdict for r in declared.analyse(_declaration(up, down), early)] == [
        "pending (3 of 8 seeds)"
    ] * 2
    first = results[0]
    assert first.seeds == tuple(range(1, 9))
    assert first.test.mean == pytest.approx(
        0.02 + 0.002 * sum((-1) ** s for s in range(1, 9)) / 8 / 4
    )
    assert first.sign_flip_p == pytest.approx(2 / 2**8)  # every seed's difference is positive
    assert [r.holm_p for r in results] == paired.holm([r.test.p for r in results])
    assert first.mean_a - first.mean_b == pytest.approx(first.test.mean)


def test_no_shift_is_not_distinguishable_and_a_grid_in_progress_is_pending():
    arms = _arms(shift=0.0)
    verdict = declared.analyse(_declaration(declared.Comparison("a", "b", "a > b", "")), arms)
    assert verdict[0].verdict == "not distinguishable"
    arms["a"] = arms["a"][:-1]  # seed 8 not run yet: 7 paired seeds, no verdict
    (short,) = declared.analyse(_declaration(declared.Comparison("a", "b", "a > b", "")), arms)
    assert short.verdict == "pending (7 of 8 seeds)" and short.seeds == tuple(range(1, 8))
    assert not math.isnan(short.test.p)  # the interim numbers are shown, never judged
    (none,) = declared.analyse(_declaration(declared.Comparison("a", "c", "a > b", "")), arms)
    assert none.verdict == "pending (0 of 8 seeds)" and math.isnan(none.test.mean)
    assert math.isnan(none.holm_p) and math.isnan(none.mean_b)


def test_the_declaration_file_is_validated_naming_the_field(tmp_path):
    path = tmp_path / "analysis.json"
    comparison = {"a": "x", "b": "y", "expected": "a > b"}
    path.write_text(json.dumps({"primary": {"metric": METRIC}, "comparisons": [comparison]}))
    loaded = declared.load_declaration(path)
    assert (loaded.score, loaded.alpha, loaded.comparisons[0].claim) == ("auc", 0.05, "")
    path.write_text(json.dumps({"comparisons": [comparison]}))
    with pytest.raises(ValueError, match="the field 'primary' is missing"):
        declared.load_declaration(path)
    path.write_text(json.dumps({"primary": {"metric": METRIC}, "comparisons": [comparison] * 5}))
    with pytest.raises(ValueError, match="5 declared; declare 1 to 4"):
        declared.load_declaration(path)
    bad = {**comparison, "expected": "a >= b"}
    path.write_text(json.dumps({"primary": {"metric": METRIC}, "comparisons": [bad]}))
    with pytest.raises(ValueError, match="expected 'a >= b'"):
        declared.load_declaration(path)


def test_the_regenerated_summary_opens_with_the_declared_comparisons(tmp_path):
    runs = tmp_path / "setting" / "runs"
    for group in _arms(shift=0.02).values():
        for record in group:
            write_record(record, runs)
    out = tmp_path / "setting"
    plain = regenerate.render(runs, out, regenerate.SummaryOptions())["summary.md"]
    assert "Declared comparisons" not in plain
    comparison = {"a": "a", "b": "b", "expected": "a > b", "claim": "shift"}
    (out / "analysis.json").write_text(
        json.dumps({"primary": {"metric": METRIC}, "comparisons": [comparison]})
    )
    text = regenerate.render(runs, out, regenerate.SummaryOptions())["summary.md"]
    declared_at = text.index("## Declared comparisons (primary analysis)")
    assert declared_at < text.index("\n## ", declared_at + 5)  # the first section
    row = next(line for line in text.splitlines() if line.startswith("| a | b | shift"))
    assert row.endswith("| **agrees** |") and "| 8 |" in row
    assert not math.isnan(float(row.split("|")[9]))  # the paired t p-value


def test_protocol2_scalars_exist_only_for_runs_with_the_teacher_forced_metric():
    from megatron_rl.study.run_metrics import protocol2_scalars

    assert protocol2_scalars([{"step": 1, "accuracy": 0.5}]) == {}
    rows = [
        {"step": 0, METRIC.replace("heldout/", ""): 0.2, "eval/exact_logp": -2.0},
        {"step": 1, "grad_norm/max": 3.0, "grad_norm/mean": 1.0, "ratio/pi_mu/q0.999": 1.5,
         "ratio/pi_mu/q0.001": 0.7, "ratio/pi_old/q0.999": 1.1},
        {"step": 2, "grad_norm/max": 5.0, "grad_norm/mean": 2.0, "ratio/pi_mu/q0.999": 1.2,
         "ratio/pi_mu/q0.001": 0.9, "ratio/pi_old/q0.999": 1.3,
         "eval/exact_p": 0.4, "eval/exact_logp": -1.0},
    ]  # fmt: skip
    out = protocol2_scalars(rows)
    assert (out["exact_first"], out["exact_last"]) == (0.2, 0.4)
    assert out["exact_auc"] == pytest.approx(0.3) and out["exact_logp_auc"] == pytest.approx(-1.5)
    assert (out["grad_max"], out["grad_mean"]) == (5.0, 1.5)
    assert (out["ratio_mu_q999"], out["ratio_mu_q001"], out["ratio_old_q999"]) == (1.5, 0.7, 1.3)
