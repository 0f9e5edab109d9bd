"""Run records that accumulate (megatron_rl/study/records.py and regenerate.py,
tools/study_summary.py): compare_runs --records writes one per finished run of the fake trainer;
the summary and the curves are rebuilt from the records alone, byte for byte; seeds of a second
sitting add up; disagreeing records are refused or listed; --check catches an edited summary.
The last test checks the committed docs/study/runs against docs/study/summary.md (what CI
checks; the tests on the fake study are slow: they share one ~3 s sitting, on one worker)."""

from __future__ import annotations

import json
import re
import shutil
import sys
from pathlib import Path

import pytest
from test_compare_runs import FAKE_TRAINER, compare_runs

from megatron_rl.cli import study_summary
from megatron_rl.study import records, regenerate

ROOT = Path(__file__).resolve().parents[2]

COMMITTED_RECORDS = ROOT / "docs" / "study" / "runs"
ARMS = ("grpo-r3rec-N2", "vespo-r3rec-N2")


def _sitting(tmp_path: Path, out: str, record_dir: Path, *extra: str) -> int:
    """One sitting of a fake study (2 arms) into ``tmp_path/out``, keeping records."""
    fake = tmp_path / "fake_trainer.py"
    fake.write_text(FAKE_TRAINER)
    return compare_runs.main([
        "--out", str(tmp_path / out), "--jobs", "2", "--losses", "grpo", "vespo",
        "--replay", "r3rec", "--staleness", "2", "--rollout-batch-size", "2",
        "--n-samples-per-prompt", "2", "--trainer-command", f"{sys.executable} {fake}",
        "--records", str(record_dir), *extra,
    ])  # fmt: skip


@pytest.fixture(scope="module")
def first_sitting(tmp_path_factory) -> Path:
    """Records of seeds 1-2 of both arms (the fake study ran once for the module)."""
    base = tmp_path_factory.mktemp("sitting")
    mp = pytest.MonkeyPatch()
    mp.setenv("CALLS", str(base / "calls.txt"))
    try:
        assert _sitting(base, "study1", base / "records", "--seeds", "2") == 0
    finally:
        mp.undo()
    return base


def _copy_records(first_sitting: Path, tmp_path: Path) -> Path:
    folder = tmp_path / "runs"
    shutil.copytree(first_sitting / "records", folder)
    return folder


def _row(summary: str, arm: str) -> dict[str, str]:
    """``{column title: cell}`` of ``arm``'s row in the summary's first table."""
    lines = summary.splitlines()
    titles = next(line for line in lines if line.startswith("| arm | K |")).strip("|").split("|")
    row = next(line for line in lines if line.startswith(f"| {arm} |")).strip("|").split("|")
    return {t.strip(): c.strip() for t, c in zip(titles, row, strict=True)}


def _regenerate(record_dir: Path, out: Path, *extra: str) -> int:
    return study_summary.main(["--records", str(record_dir), "--out", str(out), *extra])


@pytest.mark.slow
@pytest.mark.xdist_group("study_records")
def test_a_finished_run_leaves_a_small_record_of_its_flags_seed_revision_and_metrics(
    first_sitting,
):
    folder = first_sitting / "records"
    names = sorted(p.name for p in folder.iterdir())
    assert names == [f"{arm}__seed{s}.json" for arm in ARMS for s in (1, 2)]
    record = records.load_record(folder / "vespo-r3rec-N2__seed2.json")
    assert record.arm == "vespo-r3rec-N2" and record.seed == 2
    assert record.flags[record.flags.index("--seed") + 1] == "2"
    assert record.flags[record.flags.index("--loss") + 1] == "vespo"
    assert (record.revision, record.dirty) == records.git_revision(ROOT)
    assert record.wall_s > 0 and record.peak_rss_mb > 1
    assert record.steps == (1, 2, 3, 4)
    # vespo seed 2: accuracy 0.8 + 0.01 * 2 + 0.02 * step
    assert record.metrics["accuracy"] == pytest.approx((0.84, 0.86, 0.88, 0.90))
    assert "grpo/clip_frac_high" in record.metrics
    assert (folder / record.file_name).stat().st_size < 2_000


def test_a_record_keeps_only_the_metrics_the_study_reads_rounded_to_six_digits():
    rows = [
        {"step": 2, "accuracy": 0.123456789, "loss/total": 5.0, "eval/mean@8": 0.25},
        {"step": 1, "accuracy": 1 / 3, "loss/total": 4.0, "debug/unused": 1.0},
    ]
    record = records.make_record("a-N1", 1, rows, {"flags": ["--seed", "1"], "wall_s": 1 / 7})
    assert record.steps == (1, 2)
    assert record.metrics == {"accuracy": (0.333333, 0.123457), "eval/mean@8": (None, 0.25)}
    assert record.wall_s == 0.142857 and record.peak_rss_mb is None
    assert record.revision == records.UNKNOWN_REVISION


@pytest.mark.slow
@pytest.mark.xdist_group("study_records")
def test_the_regenerated_summary_matches_the_study_and_is_byte_identical(first_sitting, tmp_path):
    folder = _copy_records(first_sitting, tmp_path)
    assert _regenerate(folder, tmp_path / "a") == 0
    assert _regenerate(folder, tmp_path / "b") == 0
    for name in ("summary.md", "curves.svg"):
        assert (tmp_path / "a" / name).read_bytes() == (tmp_path / "b" / name).read_bytes()
    text = (tmp_path / "a" / "summary.md").read_text()
    direct = (first_sitting / "study1" / "summary.md").read_text()
    for arm in ARMS:  # the same per-arm cells as compare_runs wrote from the full metrics
        ours, theirs = (_row(summary, arm) for summary in (text, direct))
        for measured in ("wall s", "peak RSS MiB"):  # 6-digit rounding can show in their ±
            del ours[measured], theirs[measured]
        assert ours == theirs and len(ours) == 16  # arm, K and 14 metrics
    assert "Made from the 4 records in `../runs/`" in text
    assert "| grpo-r3rec-N2 | 2 | 1, 2 |" in text and "--loss grpo" in text
    svg = (tmp_path / "a" / "curves.svg").read_text()
    assert svg.count("<polyline") >= 2 * 3 and "vespo-r3rec-N2" in svg  # 2 seeds + mean, per arm


@pytest.mark.slow
@pytest.mark.xdist_group("study_records")
def test_seeds_of_a_second_sitting_add_up_and_a_recorded_run_is_not_trained_again(
    first_sitting, tmp_path, monkeypatch
):
    folder = _copy_records(first_sitting, tmp_path)
    monkeypatch.setenv("CALLS", str(tmp_path / "calls.txt"))
    assert _sitting(tmp_path, "study2", folder, "--seeds", "1", "--first-seed", "3") == 0
    assert _regenerate(folder, tmp_path / "docs") == 0
    text = (tmp_path / "docs" / "summary.md").read_text()
    assert "| grpo-r3rec-N2 | 3 | 1, 2, 3 |" in text and "| vespo-r3rec-N2 | 3 |" in text
    assert "Made from the 6 records" in text
    with pytest.raises(SystemExit, match="already holds 2 of these runs"):
        _sitting(tmp_path, "study3", folder, "--seeds", "1")  # seed 1 again, fresh --out


@pytest.mark.slow
@pytest.mark.xdist_group("study_records")
def test_records_of_one_arm_with_other_flags_are_refused_naming_both_files(
    first_sitting, tmp_path, monkeypatch, capsys
):
    folder = _copy_records(first_sitting, tmp_path)
    monkeypatch.setenv("CALLS", str(tmp_path / "calls.txt"))
    extra = ("--seeds", "1", "--first-seed", "3", "--train-iters", "7")
    assert _sitting(tmp_path, "other", folder, *extra) == 0
    with pytest.raises(ValueError, match="disagree on their trainer flags") as error:
        regenerate.render(folder, tmp_path / "docs", regenerate.SummaryOptions())
    message = str(error.value)
    assert "grpo-r3rec-N2__seed1.json" in message and "grpo-r3rec-N2__seed3.json" in message
    assert "'40' vs '7'" in message
    capsys.readouterr()
    assert _regenerate(folder, tmp_path / "docs") == 2
    assert "grpo-r3rec-N2__seed3.json" in capsys.readouterr().err
    assert not (tmp_path / "docs" / "summary.md").exists()


def _synthetic(folder: Path, arm: str, seed: int, revision: str) -> None:
    rows = [{"step": s, "accuracy": 0.1 * s + 0.01 * seed} for s in range(1, 4)]
    marker = {"flags": ["--loss", "grpo", "--seed", str(seed)], "revision": revision}
    records.write_record(records.make_record(arm, seed, rows, marker), folder)


def test_records_of_other_revisions_are_listed_and_strict_revision_refuses_them(tmp_path):
    folder = tmp_path / "runs"
    _synthetic(folder, "grpo-N1", 1, "aaaaaaaaaaaa")
    _synthetic(folder, "grpo-N1", 2, "bbbbbbbbbbbb")
    text = regenerate.render(folder, tmp_path, regenerate.SummaryOptions())["summary.md"]
    assert "`aaaaaaaaaaaa` (1), `bbbbbbbbbbbb` (1)" in text
    assert "The records come from 2 code revisions" in text
    with pytest.raises(ValueError, match=re.escape("grpo-N1__seed2.json")):
        regenerate.render(folder, tmp_path, regenerate.SummaryOptions(), strict_revision=True)
    _synthetic(tmp_path / "one", "grpo-N1", 1, "aaaaaaaaaaaa")
    text = regenerate.render(tmp_path / "one", tmp_path, regenerate.SummaryOptions())
    assert "code revisions" not in text["summary.md"]


@pytest.mark.slow
@pytest.mark.xdist_group("study_records")
def test_check_passes_on_the_regenerated_files_and_fails_on_an_edited_summary(
    first_sitting, tmp_path, capsys
):
    folder = _copy_records(first_sitting, tmp_path)
    docs = tmp_path / "docs"
    assert _regenerate(folder, docs, "--reference", "vespo-r3rec-N2") == 0
    assert _regenerate(folder, docs, "--check") == 0  # repeats the summary's stated options
    summary = docs / "summary.md"
    edited = summary.read_text().replace("| vespo-r3rec-N2 | 2 |", "| vespo-r3rec-N2 | 3 |", 1)
    summary.write_text(edited)
    capsys.readouterr()
    assert _regenerate(folder, docs, "--check") == 1
    out = capsys.readouterr().out
    assert "-| vespo-r3rec-N2 | 3 |" in out and "+| vespo-r3rec-N2 | 2 |" in out
    (docs / "curves.svg").unlink()
    assert _regenerate(folder, docs, "--check") == 1
    assert "curves.svg: missing" in capsys.readouterr().out


def test_a_bad_record_is_refused_naming_the_file_and_the_field(tmp_path):
    _synthetic(tmp_path, "grpo-N1", 1, "aaaaaaaaaaaa")
    path = tmp_path / "grpo-N1__seed1.json"
    data = json.loads(path.read_text())
    for change, field in (
        ({"version": 2}, "'version'"),
        ({"metrics": {"accuracy": [0.1]}}, "'metrics.accuracy'"),
        ({"seed": "1"}, "'seed'"),
        ({"steps": [1, 1, 2]}, "'steps'"),
    ):
        path.write_text(json.dumps({**data, **change}))
        with pytest.raises(ValueError, match=field) as error:
            records.load_record(path)
        assert str(path) in str(error.value)
    path.write_text(json.dumps(data))
    path.rename(tmp_path / "grpo-N1__seed9.json")
    with pytest.raises(ValueError, match=re.escape("whose file is grpo-N1__seed1.json")):
        records.load_records(tmp_path)


def _committed_settings() -> list[Path]:
    """Each study setting's record folder: docs/study/runs, docs/study/<setting>/runs and
    docs/study/<setting>/<part>/runs (e.g. the pilot's parts)."""
    study = COMMITTED_RECORDS.parent
    folders = [COMMITTED_RECORDS, *sorted([*study.glob("*/runs"), *study.glob("*/*/runs")])]
    return [f for f in folders if f.is_dir() and any(f.glob("*.json"))]


def test_the_committed_study_records_regenerate_the_committed_summary(capsys):
    """What CI checks: each setting's summary.md and curves.svg (beside its runs/ folder) are
    what its committed records give."""
    folders = _committed_settings()
    if not folders:
        pytest.skip(f"{COMMITTED_RECORDS.relative_to(ROOT)} holds no run record yet")
    for folder in folders:
        code = _regenerate(folder, folder.parent, "--check")
        assert code == 0, (folder, capsys.readouterr().out[-4000:])
