"""The test suite's time by module, from the JUnit XML that `make test` writes.

    python tools/suite_time.py runs/suite.xml [--top 25] [--workers 2]

Each test's time is pytest's (set-up, call and tear-down of that test; a module-scoped fixture
is charged to the first test that uses it). The table lists the modules by summed time, with
their test count, their share, and the slowest test of each; the last line is the sum over all
tests and that sum divided by ``--workers`` (what the modules cost a run of ``pytest -n W``
before scheduling gaps). CI prints it after the suite, so a closing note can say where the time
went and growth shows module by module.
"""

from __future__ import annotations

import argparse
import sys
import xml.etree.ElementTree as ET
from collections import defaultdict
from pathlib import Path


def module_times(junit_xml: Path) -> dict[str, dict]:
    """{module path: {"seconds", "tests", "slowest": (seconds, test name)}} from a JUnit file
    (pytest's ``classname`` is the dotted module path, plus a class name where there is one)."""
    modules: dict[str, dict] = defaultdict(lambda: {"seconds": 0.0, "tests": 0, "slowest": (0, "")})
    for case in ET.parse(junit_xml).getroot().iter("testcase"):
        parts = case.get("classname", "").split(".")
        while parts and parts[-1][:1].isupper():  # a test class, not a module
            parts.pop()
        module = "/".join(parts) + ".py"
        seconds = float(case.get("time", 0.0))
        entry = modules[module]
        entry["seconds"] += seconds
        entry["tests"] += 1
        entry["slowest"] = max(entry["slowest"], (seconds, case.get("name", "")))
    return dict(modules)


def render(modules: dict[str, dict], top: int, workers: int) -> str:
    total = sum(m["seconds"] for m in modules.values())
    tests = sum(m["tests"] for m in modules.values())
    rows = sorted(modules.items(), key=lambda item: -item[1]["seconds"])
    lines = ["| module | tests | s | share | slowest test (s) |", "|---|---:|---:|---:|---|"]
    for name, m in rows[:top]:
        seconds, slowest = m["slowest"]
        share = m["seconds"] / total if total else 0.0
        cells = (
            name,
            m["tests"],
            f"{m['seconds']:.0f}",
            f"{share:.1%}",
            f"{slowest} ({seconds:.0f})",
        )
        lines.append("| " + " | ".join(map(str, cells)) + " |")
    rest = rows[top:]
    if rest:
        seconds = sum(m["seconds"] for _, m in rest)
        lines.append(
            f"| {len(rest)} other modules | {sum(m['tests'] for _, m in rest)} | "
            f"{seconds:.0f} | {seconds / total if total else 0:.1%} | |"
        )
    lines.append(
        f"\n{tests} tests, {total / 60:.1f} test-minutes in all: {total / 60 / workers:.1f} "
        f"minutes on {workers} workers before scheduling gaps"
    )
    return "\n".join(lines)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    parser.add_argument("junit_xml", type=Path, help="pytest --junitxml output")
    parser.add_argument("--top", type=int, default=25, help="modules listed one by one")
    parser.add_argument("--workers", type=int, default=2, help="pytest-xdist workers of the run")
    args = parser.parse_args(argv)
    if not args.junit_xml.is_file():
        parser.error(f"{args.junit_xml}: no such file (make test writes runs/suite.xml)")
    print(render(module_times(args.junit_xml), args.top, args.workers))
    return 0


if __name__ == "__main__":
    sys.exit(main())
