"""A study's ``summary.md`` and ``curves.svg`` rebuilt from its records alone (no run trains).

Records (`records`) of several sittings add up: an arm's seeds are all its records. Two policies
keep them from being silently mixed:

* **flags**: every record of an arm must have the same trainer flags but for ``--seed``; two that
  differ are a ValueError naming both files and the first differing flag (rename the arm or move
  one of them out);
* **revision**: records may come from different code revisions; the summary's "Records" section
  lists each arm's revisions, and says when they differ. ``strict_revision`` refuses records
  from more than one revision (dirty counts as another one).

A setting whose records folder has an ``analysis.json`` beside it (`declared`) gets its
pre-declared comparisons as the summary's first section.

The output is deterministic (no timestamps, arms and seeds sorted, fixed number formats), so
`check` can regenerate and compare byte for byte with the committed files. The summary states the
options it was made with (``Options: `...` ``), and `check` reuses them unless told otherwise.
"""

from __future__ import annotations

import dataclasses
import difflib
import os
import re
import shlex
from collections import Counter
from pathlib import Path

from megatron_rl.atomic_io import atomic_write_text
from megatron_rl.study import declared
from megatron_rl.study.curves_svg import study_svg
from megatron_rl.study.records import Record, load_records
from megatron_rl.study.run_metrics import run_scalars
from megatron_rl.study.summary import STANDARD_NOTES, summary

SUMMARY, CURVES = "summary.md", "curves.svg"
_OPTIONS_LINE = re.compile(r"^Options: `(.*)`$", re.MULTILINE)


@dataclasses.dataclass(frozen=True, kw_only=True)
class SummaryOptions:
    """What the summary is computed with (stated in it, so a check can repeat it)."""

    threshold: float = 0.9  # "first step >= threshold" of the accuracy
    final_window: int = 5  # steps / evaluations that "final" metrics average
    reference: str | None = None  # the arm differences are taken from (default: first by name)

    def __post_init__(self):
        if self.final_window < 1:
            raise ValueError(f"--final-window {self.final_window}: must be >= 1")

    def argv(self, reference: str | None) -> list[str]:
        """The options as flags, with the resolved reference arm."""
        out = ["--threshold", repr(self.threshold), "--final-window", str(self.final_window)]
        return out + (["--reference", reference] if reference else [])


def stated_options(summary_text: str) -> list[str]:
    """The flags of a summary's ``Options:`` line (empty when it has none)."""
    match = _OPTIONS_LINE.search(summary_text)
    return shlex.split(match.group(1)) if match else []


def group_by_arm(
    records: list[Record], *, strict_revision: bool = False
) -> dict[str, list[Record]]:
    """``{arm: records sorted by seed}``, arms sorted by name; refuses disagreeing records."""
    arms: dict[str, list[Record]] = {}
    for record in records:
        arms.setdefault(record.arm, []).append(record)
    for arm, group in arms.items():
        first = group[0]
        for other in group[1:]:
            if other.flags_without_seed() != first.flags_without_seed():
                raise ValueError(
                    f"records of arm {arm} disagree on their trainer flags: {first.file_name} "
                    f"and {other.file_name} ({_first_difference(first, other)}); one arm's "
                    "seeds must run the same flags: move one of them out of the folder"
                )
    revisions = sorted({r.revision_label for r in records})
    if strict_revision and len(revisions) > 1:
        by_revision = {rev: [r.file_name for r in records if r.revision_label == rev]
                       for rev in revisions}  # fmt: skip
        raise ValueError(
            f"--strict-revision: the records come from {len(revisions)} revisions: "
            + "; ".join(f"{rev}: {', '.join(files)}" for rev, files in by_revision.items())
        )
    return {arm: sorted(arms[arm], key=lambda r: r.seed) for arm in sorted(arms)}


def _first_difference(a: Record, b: Record) -> str:
    fa, fb = a.flags_without_seed(), b.flags_without_seed()
    for index, (x, y) in enumerate(zip(fa, fb, strict=False)):
        if x != y:
            return f"flag {index + 1}: {x!r} vs {y!r}"
    return f"{len(fa)} vs {len(fb)} flags"


def provenance(arms: dict[str, list[Record]]) -> list[str]:
    """The summary's "Records" section: per arm its seeds, revisions and flags."""
    revisions = Counter(r.revision_label for group in arms.values() for r in group)
    lines = [
        "## Records",
        "",
        "| arm | K | seeds | revisions (records) | steps |",
        "|---|---|---|---|---|",
    ]
    for arm, group in arms.items():
        counts = Counter(r.revision_label for r in group)
        revs = ", ".join(f"`{rev}` ({n})" for rev, n in sorted(counts.items()))
        steps = sorted({len(r.steps) for r in group})
        lines.append(
            f"| {arm} | {len(group)} | {', '.join(str(r.seed) for r in group)} | {revs} | "
            f"{', '.join(map(str, steps))} |"
        )
    if len(revisions) > 1:
        lines += [
            "",
            f"The records come from {len(revisions)} code revisions ("
            + ", ".join(f"`{rev}`: {n}" for rev, n in sorted(revisions.items()))
            + "); they are compared as if the code were the same.",
        ]
    lines += ["", "Trainer flags of each arm (every record of an arm has these, and its seed):", ""]
    lines += [
        f"- {arm}: `{shlex.join(group[0].flags_without_seed())}`" for arm, group in arms.items()
    ]
    return lines


def render(
    records_dir: str | os.PathLike,
    out_dir: str | os.PathLike,
    options: SummaryOptions,
    *,
    strict_revision: bool = False,
) -> dict[str, str]:
    """``{file name: text}`` of the summary and the curves made from ``records_dir``'s records."""
    arms = group_by_arm(load_records(records_dir), strict_revision=strict_revision)
    if not arms:
        raise ValueError(f"--records {records_dir}: holds no record (*.json)")
    reference = options.reference or next(iter(arms))
    if reference not in arms:
        raise ValueError(f"--reference {reference}: no record of it; arms: {', '.join(arms)}")
    scalars = {
        arm: [
            run_scalars(r.rows(), r.marker(), options.threshold, options.final_window)
            for r in group
        ]
        for arm, group in arms.items()
    }
    where = Path(os.path.relpath(records_dir, out_dir)).as_posix()
    count = sum(len(group) for group in arms.values())
    header = [
        "# Study summary (from records)",
        "",
        f"Made from the {count} records in `{where}/` (relative to this file) by "
        "`tools/study_summary.py`; no run was trained to write it.",
        "",
        f"Options: `{shlex.join(options.argv(reference))}`",
    ]
    declaration_path = Path(records_dir).parent / declared.DECLARATION
    if declaration_path.exists():  # the pre-declared comparisons come first
        declaration = declared.load_declaration(declaration_path)
        header += ["", *declared.render(declaration, declared.analyse(declaration, arms))]
    text = summary(
        scalars,
        threshold=options.threshold,
        window=options.final_window,
        header=header,
        notes=STANDARD_NOTES,
        reference=reference,
    )
    text += "\n" + "\n".join(provenance(arms)) + "\n"
    curves = {arm: [r.rows() for r in group] for arm, group in arms.items()}
    return {SUMMARY: text, CURVES: study_svg(curves)}


def write(rendered: dict[str, str], out_dir: str | os.PathLike) -> None:
    """Write the rendered files into ``out_dir`` (created), each atomically."""
    Path(out_dir).mkdir(parents=True, exist_ok=True)
    for name, text in rendered.items():
        atomic_write_text(str(Path(out_dir) / name), text)


def check(rendered: dict[str, str], out_dir: str | os.PathLike, max_lines: int = 80) -> list[str]:
    """What differs between the rendered files and those in ``out_dir``: a unified diff of each
    differing text file (at most ``max_lines`` lines each), or a line per missing file; empty
    when every file is byte-identical."""
    problems = []
    for name, text in rendered.items():
        path = Path(out_dir) / name
        if not path.exists():
            problems.append(f"{path}: missing (regenerate it)")
            continue
        committed = path.read_text()
        if committed == text:
            continue
        diff = list(
            difflib.unified_diff(
                committed.splitlines(),
                text.splitlines(),
                f"{path} (committed)",
                f"{path} (regenerated from the records)",
                lineterm="",
            )
        )
        more = len(diff) - max_lines
        problems += diff[:max_lines] + ([f"... {more} more diff lines"] if more > 0 else [])
    return problems
