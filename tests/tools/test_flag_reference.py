"""docs/flags.md is the trainer's parser rendered by tools/flag_reference.py: the file in the
tree matches a fresh render, and the render carries every flag of the parser."""

import importlib.util
import sys
from pathlib import Path

from megatron_rl.train.config import build_parser

ROOT = Path(__file__).resolve().parents[2]
spec = importlib.util.spec_from_file_location(
    "flag_reference", ROOT / "tools" / "flag_reference.py"
)
flag_reference = importlib.util.module_from_spec(spec)
sys.modules["flag_reference"] = flag_reference
spec.loader.exec_module(flag_reference)


def test_docs_flags_md_matches_the_trainers_parser():
    committed = (ROOT / "docs" / "flags.md").read_text(encoding="utf-8")
    assert committed == flag_reference.render(), (
        "docs/flags.md is stale: run `python tools/flag_reference.py`"
    )


def test_the_reference_lists_every_flag_of_the_parser_once():
    text = flag_reference.render()
    rows = [line for line in text.splitlines() if line.startswith("| `--")]
    flags = [
        action.option_strings
        for action in build_parser()._actions
        if action.option_strings and action.dest != "help"
    ]
    assert len(rows) == len(flags)
    for names, row in zip(flags, rows, strict=True):
        assert row.startswith("| " + ", ".join(f"`{n}`" for n in names) + " |"), row


def test_the_check_mode_reports_a_stale_file(tmp_path, capsys):
    stale = tmp_path / "flags.md"
    stale.write_text(flag_reference.render().replace("--rollout-batch-size", "--old-flag"))
    assert flag_reference.main(["--check", "--output", str(stale)]) == 1
    assert "run `python tools/flag_reference.py`" in capsys.readouterr().err
    assert flag_reference.main(["--output", str(stale)]) == 0
    assert flag_reference.main(["--check", "--output", str(stale)]) == 0
