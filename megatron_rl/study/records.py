"""A finished study run as a small, versioned JSON record, so seeds from several sittings add up.

One file per (arm, seed), named ``<arm>__seed<seed>.json`` (the arm's name already holds its
staleness, ``-N8``). It holds what the summary and the curves need and nothing else:

* ``version`` (`VERSION`), ``arm``, ``seed``;
* ``flags``: the run's full trainer flags (``--seed`` included), so records of one arm can be
  checked to differ only in the seed;
* ``revision``: the code's ``git rev-parse --short=12 HEAD`` ("unknown" outside a checkout) and
  ``dirty`` (tracked files differed from it);
* ``wall_s`` and ``peak_rss_mb`` of the run's process;
* ``steps`` (increasing) and ``metrics``: one column per metric the study reads
  (`run_metrics.is_needed`), aligned with ``steps``, ``null`` where a step has no value. Floats
  keep `SIGNIFICANT` digits, so a 100-step record is ~10-20 KB rather than the run's MBs.

Files are written atomically (`atomic_io`) with one line per field and per metric column, so a
record's diff reads well. `load_record` raises ValueError naming the file and the field.
"""

from __future__ import annotations

import dataclasses
import itertools
import json
import math
import os
import subprocess
from pathlib import Path

from megatron_rl.atomic_io import atomic_write_text
from megatron_rl.study.run_metrics import is_needed

VERSION = 1
SIGNIFICANT = 6
SUFFIX = ".json"
UNKNOWN_REVISION = "unknown"


@dataclasses.dataclass(frozen=True, kw_only=True)
class Record:
    """One finished run of a study arm (see the module docstring for each field)."""

    arm: str
    seed: int
    flags: tuple[str, ...]
    revision: str
    dirty: bool
    wall_s: float | None
    peak_rss_mb: float | None
    steps: tuple[int, ...]
    metrics: dict[str, tuple[float | None, ...]]

    @property
    def file_name(self) -> str:
        return record_name(self.arm, self.seed)

    @property
    def revision_label(self) -> str:
        """``<revision>`` or ``<revision>+dirty``."""
        return self.revision + ("+dirty" if self.dirty else "")

    def flags_without_seed(self) -> tuple[str, ...]:
        """``flags`` less ``--seed <s>``: what every record of one arm must share."""
        out, skip = [], False
        for flag in self.flags:
            if skip:
                skip = False
            elif flag == "--seed":
                skip = True
            elif not flag.startswith("--seed="):
                out.append(flag)
        return tuple(out)

    def rows(self) -> list[dict]:
        """The run's rows as `run_metrics.run_scalars` reads them: ``{"step": s, name: v}``."""
        return [
            {"step": step, **{k: c[i] for k, c in self.metrics.items() if c[i] is not None}}
            for i, step in enumerate(self.steps)
        ]

    def marker(self) -> dict:
        """``wall_s`` and ``peak_rss_mb`` as `run_metrics.run_scalars` reads them (nan: none)."""
        return {
            "wall_s": math.nan if self.wall_s is None else self.wall_s,
            "peak_rss_mb": math.nan if self.peak_rss_mb is None else self.peak_rss_mb,
        }


def record_name(arm: str, seed: int) -> str:
    """``<arm>__seed<seed>.json``: one file per (arm, seed)."""
    return f"{arm}__seed{seed}{SUFFIX}"


def git_revision(root: str | os.PathLike) -> tuple[str, bool]:
    """``(short hash, dirty)`` of the checkout at ``root``; ``("unknown", False)`` without git.

    The hash has a fixed 12 characters (``--short=12``), so it does not lengthen as the history
    grows; dirty: ``git status --porcelain --untracked-files=no`` lists a file.
    """
    try:
        head = subprocess.run(
            ["git", "rev-parse", "--short=12", "HEAD"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout.strip()  # fmt: skip
        status = subprocess.run(
            ["git", "status", "--porcelain", "--untracked-files=no"],
            cwd=root, capture_output=True, text=True, check=True,
        ).stdout  # fmt: skip
    except (OSError, subprocess.CalledProcessError):
        return UNKNOWN_REVISION, False
    return head or UNKNOWN_REVISION, bool(status.strip())


def _round(x) -> float | None:
    """``x`` to `SIGNIFICANT` significant digits; None for None, NaN and inf."""
    if x is None or isinstance(x, bool) or not math.isfinite(float(x)):
        return None
    return float(f"{float(x):.{SIGNIFICANT}g}")


def make_record(arm: str, seed: int, rows: list[dict], marker: dict) -> Record:
    """A run's record from its ``metrics.jsonl`` rows and its ``done.json`` marker.

    ``marker``: ``flags`` (required), ``wall_s``, ``peak_rss_mb``, ``revision``, ``dirty``.
    Rows sharing a step are merged in order (a later value wins).
    """
    by_step: dict[int, dict] = {}
    for row in rows:
        by_step.setdefault(int(row["step"]), {}).update(row)
    steps = tuple(sorted(by_step))
    names = sorted({k for row in by_step.values() for k in row if is_needed(k)})
    metrics = {name: tuple(_round(by_step[s].get(name)) for s in steps) for name in names}
    return Record(
        arm=arm,
        seed=int(seed),
        flags=tuple(marker["flags"]),
        revision=str(marker.get("revision", UNKNOWN_REVISION)),
        dirty=bool(marker.get("dirty", False)),
        wall_s=_round(marker.get("wall_s")),
        peak_rss_mb=_round(marker.get("peak_rss_mb")),
        steps=steps,
        metrics={k: c for k, c in metrics.items() if any(v is not None for v in c)},
    )


def dumps(record: Record) -> str:
    """The record's file text: one line per field and per metric column, keys in fixed order."""

    def compact(x) -> str:
        return json.dumps(x, separators=(",", ":"), allow_nan=False)

    fields = [
        ("version", VERSION), ("arm", record.arm), ("seed", record.seed),
        ("revision", record.revision), ("dirty", record.dirty), ("wall_s", record.wall_s),
        ("peak_rss_mb", record.peak_rss_mb), ("flags", list(record.flags)),
        ("steps", list(record.steps)),
    ]  # fmt: skip
    lines = [f" {compact(k)}: {compact(v)}," for k, v in fields]
    columns = [f"  {compact(k)}: {compact(list(v))}" for k, v in sorted(record.metrics.items())]
    body = ",\n".join(columns)
    return "{\n" + "\n".join(lines) + '\n "metrics": {\n' + body + "\n }\n}\n"


def write_record(record: Record, folder: str | os.PathLike) -> Path:
    """Write ``record`` into ``folder`` (created) atomically; returns its path.

    An existing file of the same name is left alone when it holds the same record, and is a
    ValueError when it holds another (a rerun of that arm and seed: records are never replaced).
    """
    path = Path(folder) / record.file_name
    if path.exists():
        if load_record(path) == record:
            return path
        raise ValueError(
            f"{path} already records another run of {record.arm} seed {record.seed} (other "
            "flags, revision or metrics); records are never replaced: add new seeds "
            "(--first-seed) or write to another --records folder"
        )
    path.parent.mkdir(parents=True, exist_ok=True)
    atomic_write_text(str(path), dumps(record))
    return path


def _field(data: dict, path: Path, name: str, kinds: tuple[type, ...], nullable=False):
    value = data.get(name)
    if value is None and nullable and name in data:
        return None
    ok = isinstance(value, kinds) and not (isinstance(value, bool) and bool not in kinds)
    if not ok:
        want = " or ".join(k.__name__ for k in kinds) + (" or null" if nullable else "")
        raise ValueError(f"{path}: field {name!r} is {value!r}; expected {want}")
    return value


def load_record(path: str | os.PathLike) -> Record:
    """Read and validate one record file (ValueError naming the file and the field)."""
    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"{path}: not JSON ({error})") from None
    if not isinstance(data, dict):
        raise ValueError(f"{path}: a record is a JSON object, found {type(data).__name__}")
    if data.get("version") != VERSION:
        raise ValueError(
            f"{path}: field 'version' is {data.get('version')!r}; this code reads version {VERSION}"
        )
    number = (int, float)
    flags = _field(data, path, "flags", (list,))
    steps = _field(data, path, "steps", (list,))
    metrics = _field(data, path, "metrics", (dict,))
    if not all(isinstance(f, str) for f in flags):
        raise ValueError(f"{path}: field 'flags' must be a list of strings")
    if not all(isinstance(s, int) and not isinstance(s, bool) for s in steps) or any(
        a >= b for a, b in itertools.pairwise(steps)
    ):
        raise ValueError(f"{path}: field 'steps' must be increasing integers")
    for name, column in metrics.items():
        if not isinstance(column, list) or len(column) != len(steps):
            raise ValueError(
                f"{path}: field 'metrics.{name}' must be a list of {len(steps)} values "
                "(one per step)"
            )
        if any(
            v is not None and (isinstance(v, bool) or not isinstance(v, number)) for v in column
        ):
            raise ValueError(f"{path}: field 'metrics.{name}' holds a value that is not a number")
    record = Record(
        arm=_field(data, path, "arm", (str,)),
        seed=_field(data, path, "seed", (int,)),
        flags=tuple(flags),
        revision=_field(data, path, "revision", (str,)),
        dirty=_field(data, path, "dirty", (bool,)),
        wall_s=_field(data, path, "wall_s", number, nullable=True),
        peak_rss_mb=_field(data, path, "peak_rss_mb", number, nullable=True),
        steps=tuple(steps),
        metrics={k: tuple(v) for k, v in metrics.items()},
    )
    if path.name != record.file_name:
        raise ValueError(
            f"{path}: holds arm {record.arm!r} seed {record.seed}, whose file is "
            f"{record.file_name}; a record keeps the name it was written with"
        )
    return record


def load_records(folder: str | os.PathLike) -> list[Record]:
    """Every ``*.json`` record of ``folder``, in file-name order (ValueError if it is missing)."""
    folder = Path(folder)
    if not folder.is_dir():
        raise ValueError(f"--records {folder}: no such folder")
    return [load_record(path) for path in sorted(folder.glob("*" + SUFFIX))]
