"""Rebuild a study's summary.md and curves.svg from its committed run records; no run trains.

    megatron-rl study-summary --records docs/study/runs --out docs/study
    megatron-rl study-summary --records docs/study/runs --out docs/study --check

(``python tools/study_summary.py`` is the same command.) ``megatron-rl study --records DIR``
writes one record per finished run (megatron_rl/study/records.py); seeds of several sittings add
up in one folder. Records of one arm whose trainer flags differ (other than --seed) are refused,
naming both files; records of different code revisions are listed in the summary's "Records"
section (``--strict-revision`` refuses them). ``--check`` writes nothing: it regenerates and
compares with the files in ``--out`` byte for byte, printing a diff and exiting 1 when they
differ. Options not given are then taken from the committed summary's ``Options:`` line.
(megatron_rl/study/regenerate.py)
"""

from __future__ import annotations

import argparse
import sys
from collections.abc import Sequence
from pathlib import Path

from megatron_rl.study import regenerate


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("--records", type=Path, required=True, help="folder of run records")
    parser.add_argument("--out", type=Path, required=True, help="where summary.md/curves.svg go")
    parser.add_argument("--threshold", type=float, help="accuracy for 'first step >=' (0.9)")
    parser.add_argument("--final-window", type=int, help="steps of 'final' metrics (5)")
    parser.add_argument("--reference", help="arm the differences are taken from (first by name)")
    parser.add_argument(
        "--strict-revision", action="store_true", help="refuse records of several revisions"
    )
    parser.add_argument(
        "--check", action="store_true", help="compare with the files in --out; write nothing"
    )
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args = _parser().parse_args(argv)
    given = {k: getattr(args, k) for k in ("threshold", "final_window", "reference")}
    committed = args.out / regenerate.SUMMARY
    if args.check and committed.exists():  # repeat the committed summary's own options
        stated = _parser().parse_args(
            ["--records", "-", "--out", "-", *regenerate.stated_options(committed.read_text())]
        )
        given = {k: v if v is not None else getattr(stated, k) for k, v in given.items()}
    options = regenerate.SummaryOptions(**{k: v for k, v in given.items() if v is not None})
    try:
        rendered = regenerate.render(
            args.records, args.out, options, strict_revision=args.strict_revision
        )
    except ValueError as error:
        print(f"study_summary: {error}", file=sys.stderr)
        return 2
    if not args.check:
        regenerate.write(rendered, args.out)
        print(f"wrote {', '.join(str(args.out / name) for name in rendered)}")
        return 0
    problems = regenerate.check(rendered, args.out)
    if problems:
        print("\n".join(problems))
        print(
            f"study_summary --check: {args.out} is not what its records give; regenerate with "
            f"megatron-rl study-summary --records {args.records} --out {args.out}",
            file=sys.stderr,
        )
        return 1
    print(f"{args.out}: {', '.join(rendered)} match the {args.records} records")
    return 0


if __name__ == "__main__":
    sys.exit(main())
