"""`python -m megatron_rl.train`: data, prompt-length and reward errors are found before the model
is built and are one line (``error: ...``, exit 2); ``MEGATRON_RL_DEBUG=1`` adds the traceback."""

from __future__ import annotations

import importlib.util
import json
from pathlib import Path

import pytest

import megatron_rl.train.run as run_module
from megatron_rl.train.__main__ import main
from megatron_rl.train.config import parse_args

REAL_RUN = run_module.run  # the fixture `runs` stands in for it


def _save_tiny_tokenizer(folder: Path) -> Path:
    """tests/data's tiny tokenizer (17 words; ``<|user|> ... <|assistant|>`` chat template)."""
    path = Path(__file__).resolve().parents[1] / "data" / "tiny_hf_tokenizer.py"
    spec = importlib.util.spec_from_file_location("tiny_hf_tokenizer", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module.save_tiny_tokenizer(folder)


@pytest.fixture(scope="module")
def tokenizer_dir(tmp_path_factory: pytest.TempPathFactory) -> str:
    return str(_save_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture
def runs(monkeypatch) -> list:
    """Stands in for `run`: records its ``(config, task, load)`` instead of building a model."""
    calls: list = []

    def run(config, *, task, load):
        calls.append((config, task, load))
        return {}

    monkeypatch.setattr(run_module, "run", run)
    monkeypatch.delenv("MEGATRON_RL_DEBUG", raising=False)
    return calls


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


SHORT = {"prompt": "what is one plus two ?", "answer": "3"}  # 8 tokens with the template
LONG = {"prompt": " ".join(["one plus two"] * 6), "answer": "x"}  # 20 tokens with the template


def cli(tokenizer_dir: str, data: Path, *extra: str) -> list[str]:
    return ["--prompt-data", str(data), "--tokenizer", tokenizer_dir, "--device", "cpu", *extra]


def one_error_line(capsys) -> str:
    err = capsys.readouterr().err
    assert "Traceback" not in err, err
    lines = [line for line in err.splitlines() if line.startswith("error: ")]
    assert len(lines) == 1, err
    return lines[0]


def test_non_utf8_data_is_one_line_before_the_model(tmp_path, tokenizer_dir, runs, capsys):
    path = tmp_path / "prompts.jsonl"
    path.write_bytes(b'{"prompt": "one", "answer": "1"}\n{"prompt": "tw\xff", "answer": "2"}\n')
    assert main(cli(tokenizer_dir, path)) == 2
    line = one_error_line(capsys)
    assert "prompts.jsonl: row 2: not UTF-8 (byte 0xff at column 15" in line, line
    assert runs == []


def test_bad_row_is_one_line_and_debug_env_adds_the_traceback(
    tmp_path, tokenizer_dir, runs, capsys, monkeypatch
):
    path = write_jsonl(tmp_path / "d.jsonl", [SHORT, {"question": "one"}])
    assert main(cli(tokenizer_dir, path)) == 2
    assert "d.jsonl: row 2: missing field 'prompt'" in one_error_line(capsys)
    monkeypatch.setenv("MEGATRON_RL_DEBUG", "1")
    assert main(cli(tokenizer_dir, path)) == 2
    err = capsys.readouterr().err
    assert "Traceback" in err and err.rstrip().splitlines()[-1].startswith("error: ")
    assert runs == []


def test_prompt_longer_than_the_context_is_rejected(tmp_path, tokenizer_dir, runs, capsys):
    # the tiny preset's context is 512 tokens: 500 for the response leaves 12 for a prompt
    path = write_jsonl(tmp_path / "d.jsonl", [SHORT, LONG])
    assert main(cli(tokenizer_dir, path, "--max-response-length", "500")) == 2
    line = one_error_line(capsys)
    assert "d.jsonl: row 2: prompt ('prompt') has 20 tokens > 12 (--model context 512 - " in line
    assert "--prompt-too-long" in line
    assert runs == []


def test_max_prompt_length_is_capped_by_the_context(tmp_path, tokenizer_dir, runs, capsys):
    path = write_jsonl(tmp_path / "d.jsonl", [SHORT, LONG])
    flags = ("--max-response-length", "500", "--max-prompt-length", "100")
    assert main(cli(tokenizer_dir, path, *flags)) == 2
    assert "has 20 tokens > 12 (--model context 512" in one_error_line(capsys)
    assert main(cli(tokenizer_dir, path, "--max-prompt-length", "10")) == 2
    assert "has 20 tokens > 10 (--max-prompt-length)" in one_error_line(capsys)


def test_prompt_too_long_truncate_left_and_drop(tmp_path, tokenizer_dir, runs):
    path = write_jsonl(tmp_path / "d.jsonl", [SHORT, LONG])
    flags = ("--max-response-length", "500", "--prompt-too-long", "truncate-left")
    assert main(cli(tokenizer_dir, path, *flags)) == 0
    _, task, load = runs[-1]  # the task main checked is the one the run gets
    assert [len(r.prompt_ids) for r in task.records] == [8, 12] and load is None
    flags = ("--max-response-length", "500", "--prompt-too-long", "drop")
    assert main(cli(tokenizer_dir, path, *flags)) == 0
    assert [r.answer for r in runs[-1][1].records] == ["3"]


def test_response_length_beyond_the_context_is_one_line(runs, capsys):
    assert main(["--device", "cpu", "--max-response-length", "512"]) == 2
    assert "--max-response-length 512 leaves no room for a prompt" in one_error_line(capsys)
    assert runs == []


@pytest.mark.parametrize(
    ("reward", "match"),
    [
        ("mth", "unknown reward 'mth'"),
        ("json:nosuch", "module 'json' has no attribute 'nosuch'"),
        ("json:dumps", "cannot be called as dumps(response, answer)"),  # one positional only
    ],
)
def test_bad_reward_is_one_line_before_the_model(runs, capsys, reward, match):
    assert main(["--device", "cpu", "--reward", reward]) == 2
    assert match in one_error_line(capsys)
    assert runs == []


def test_load_is_resolved_once_and_handed_to_the_run(tmp_path, runs, monkeypatch):
    """main resolves --load (here: the --save folder, still empty, so a fresh start) and passes
    the answer on; run resolves --load itself only when it is given no answer."""
    save = str(tmp_path / "ckpt")
    assert main(["--device", "cpu", "--save", save, "--load", save]) == 0
    assert runs[-1][2] is None  # resolved: start fresh

    class TrainerBuilt(Exception):
        """run got past --load."""

    def trainer(*args, **kwargs):
        raise TrainerBuilt

    monkeypatch.setattr(run_module, "Trainer", trainer)
    config = parse_args(["--device", "cpu", "--load", str(tmp_path / "missing")])
    with pytest.raises(ValueError, match="does not exist"):
        REAL_RUN(config)  # resolved here
    with pytest.raises(TrainerBuilt):
        REAL_RUN(config, load=None)  # resolved by the caller: not again
