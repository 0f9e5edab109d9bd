"""``--prompt-key`` / ``--answer-key``: other field names reach the dataset loader, and a missing
field's error names the flag that fixes it."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from tiny_hf_tokenizer import save_tiny_tokenizer

from megatron_rl.train.config import parse_args
from megatron_rl.train.task import build_task

ROWS = [
    {"question": "what is one plus two ?", "meta": {"gold": "three"}},
    {"question": "solve x = two", "meta": {"gold": 2}},
]


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(save_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


def _data(tmp_path: Path) -> str:
    path = tmp_path / "prompts.jsonl"
    path.write_text("".join(json.dumps(row) + "\n" for row in ROWS), encoding="utf-8")
    return str(path)


def _task(tmp_path, tokenizer_dir, *flags):
    argv = ["--prompt-data", _data(tmp_path), "--tokenizer", tokenizer_dir, *flags]
    return build_task(parse_args(argv).task)


def test_prompt_and_answer_keys_pick_other_and_nested_fields(tmp_path, tokenizer_dir):
    task = _task(tmp_path, tokenizer_dir, "--prompt-key", "question", "--answer-key", "meta.gold")
    assert [r.answer for r in task.records] == ["three", "2"]
    assert "one plus two" in task.records[0].prompt_text


def test_a_missing_prompt_field_names_the_prompt_key_flag(tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match=r"row 1: missing field 'prompt'.*pass --prompt-key"):
        _task(tmp_path, tokenizer_dir)


def test_a_missing_answer_field_names_the_answer_key_flag(tmp_path, tokenizer_dir):
    with pytest.raises(ValueError, match=r"row 1: missing answer field .*pass --answer-key"):
        _task(tmp_path, tokenizer_dir, "--prompt-key", "question")
