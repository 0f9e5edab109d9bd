"""load_tokenizer / load_prompt_dataset: both layouts, JSONL and Parquet, chat template, errors."""

from __future__ import annotations

import json
import logging
from pathlib import Path

import pytest
from tiny_hf_tokenizer import save_tiny_tokenizer

from megatron_rl.data import HFTokenizer, Tokenizer, load_prompt_dataset, load_tokenizer

FLAT = [
    {"prompt": "what is one plus two ?", "answer": "three"},
    {"prompt": "solve x = two", "answer": 2},
]
DAPO = [
    {
        "data_source": "math_dapo",
        "prompt": [{"role": "user", "content": "what is one plus two ?"}],
        "ability": "MATH",
        "reward_model": {"ground_truth": "3", "style": "rule-lighteval/MATH_v2"},
        "extra_info": {"index": "a"},
    }
]


@pytest.fixture(scope="module")
def tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    return load_tokenizer(save_tiny_tokenizer(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def plain_tokenizer(tmp_path_factory: pytest.TempPathFactory) -> HFTokenizer:
    folder = tmp_path_factory.mktemp("tok_plain")
    return load_tokenizer(save_tiny_tokenizer(folder, chat_template=None))


def write_jsonl(path: Path, rows: list) -> Path:
    path.write_text("".join(json.dumps(row) + "\n" for row in rows), encoding="utf-8")
    return path


def write_parquet(path: Path, rows: list[dict]) -> Path:
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)
    return path


def test_hf_tokenizer_satisfies_protocol_and_decode_drops_special_tokens(tokenizer):
    assert isinstance(tokenizer, Tokenizer)
    assert (
        tokenizer.vocab_size == 17 and tokenizer.eos_token_id == 1 and tokenizer.pad_token_id == 0
    )
    ids = tokenizer.encode("one plus two")
    assert (
        tokenizer.decode([*ids, tokenizer.eos_token_id, tokenizer.pad_token_id]) == "one plus two"
    )


def test_load_tokenizer_refuses_a_missing_folder(tmp_path):
    with pytest.raises(ValueError, match="not a folder"):
        load_tokenizer(str(tmp_path / "nope"))


def test_flat_jsonl_with_chat_template(tmp_path, tokenizer):
    records = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", FLAT), tokenizer)
    assert [r.index for r in records] == [0, 1]
    assert [r.answer for r in records] == ["three", "2"]
    assert records[0].prompt_text == "<|user|> what is one plus two ? <|assistant|>"
    assert records[0].prompt_ids == tuple(tokenizer.encode(records[0].prompt_text))


def test_dapo_layout_parquet_matches_jsonl(tmp_path, tokenizer):
    from_jsonl = load_prompt_dataset(write_jsonl(tmp_path / "d.jsonl", DAPO), tokenizer)
    from_parquet = load_prompt_dataset(write_parquet(tmp_path / "d.parquet", DAPO), tokenizer)
    assert from_jsonl == from_parquet
    assert from_jsonl[0].answer == "3"
    assert from_jsonl[0].prompt_text.startswith("<|user|> what is")


def test_without_template_prompt_is_plain_text(tmp_path, tokenizer, plain_tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", FLAT)
    for tok, kwargs in ((plain_tokenizer, {}), (tokenizer, {"apply_chat_template": False})):
        records = load_prompt_dataset(path, tok, **kwargs)
        assert records[0].prompt_text == "what is one plus two ?"
        assert records[0].prompt_ids == tuple(tok.encode("what is one plus two ?"))


def test_explicit_answer_key_wins_over_auto_detection(tmp_path, tokenizer):
    rows = [{"prompt": "one", "answer": "wrong", "meta": {"gold": "right"}}]
    records = load_prompt_dataset(
        write_jsonl(tmp_path / "d.jsonl", rows), tokenizer, answer_key="meta.gold"
    )
    assert records[0].answer == "right"


@pytest.mark.parametrize(
    ("rows", "match"),
    [
        ([{"answer": "1"}], r"row 1: missing field 'prompt'"),
        ([FLAT[0], {"prompt": "two"}], r"row 2: missing answer field 'answer' / "),
        ([{"prompt": "  ", "answer": "1"}], r"row 1: field 'prompt' is empty"),
        ([{"prompt": [], "answer": "1"}], r"row 1: field 'prompt' is a list"),
        ([{"prompt": "one", "answer": ""}], r"row 1: answer field 'answer' is empty"),
        ([{"prompt": "one", "answer": ["1"]}], r"row 1: answer field 'answer' is a list"),
        ([["not", "an", "object"]], r"row 1 is a list, not an object"),
    ],
)
def test_bad_rows_raise_naming_file_row_and_field(tmp_path, tokenizer, rows, match):
    path = write_jsonl(tmp_path / "bad.jsonl", rows)
    with pytest.raises(ValueError, match=match) as info:
        load_prompt_dataset(path, tokenizer)
    assert "bad.jsonl" in str(info.value)


def test_invalid_json_line_names_the_line(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_text(json.dumps(FLAT[0]) + "\n\n{not json\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"d.jsonl: row 3 is not valid JSON"):
        load_prompt_dataset(path, tokenizer)


def test_unknown_extension_and_missing_file_raise(tmp_path, tokenizer):
    (tmp_path / "d.csv").write_text("prompt,answer\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"unknown extension '\.csv'"):
        load_prompt_dataset(tmp_path / "d.csv", tokenizer)
    with pytest.raises(ValueError, match="does not exist"):
        load_prompt_dataset(tmp_path / "none.jsonl", tokenizer)


def test_long_prompt_raises_or_is_skipped_with_warning(tmp_path, tokenizer, caplog):
    path = write_jsonl(tmp_path / "d.jsonl", FLAT)  # 8 and 7 tokens with the template
    with pytest.raises(
        ValueError, match=r"row 1: prompt \('prompt'\) has 8 tokens > 7 \(max_prompt"
    ):
        load_prompt_dataset(path, tokenizer, max_prompt_length=7)
    with caplog.at_level(logging.WARNING, logger="megatron_rl.data.dataset"):
        records = load_prompt_dataset(path, tokenizer, max_prompt_length=7, skip_long_prompts=True)
    assert [(r.index, r.answer) for r in records] == [(0, "2")]
    assert "skipped 1 prompt(s)" in caplog.text and "rows 1" in caplog.text
    with pytest.raises(ValueError, match="no usable rows"):
        load_prompt_dataset(path, tokenizer, max_prompt_length=2, skip_long_prompts=True)


def test_long_prompt_is_left_truncated_or_dropped_and_the_limit_is_named(tmp_path, tokenizer):
    path = write_jsonl(tmp_path / "d.jsonl", FLAT)  # 8 and 7 tokens with the template
    full = load_prompt_dataset(path, tokenizer)
    source = "--model context 12 - --max-response-length 6"
    with pytest.raises(ValueError, match=r"row 1: .* has 8 tokens > 6 \(--model context 12 - "):
        load_prompt_dataset(path, tokenizer, max_prompt_length=6, limit_source=source)
    cut = load_prompt_dataset(path, tokenizer, max_prompt_length=6, prompt_too_long="truncate-left")
    assert [r.prompt_ids for r in cut] == [r.prompt_ids[-6:] for r in full]
    assert cut[0].prompt_ids[-1] == tokenizer.encode("<|assistant|>")[0]  # the turn stays open
    assert [r.answer for r in cut] == ["three", "2"]
    dropped = load_prompt_dataset(path, tokenizer, max_prompt_length=7, prompt_too_long="drop")
    assert [r.answer for r in dropped] == ["2"]
    with pytest.raises(ValueError, match="prompt_too_long='cut'"):
        load_prompt_dataset(path, tokenizer, prompt_too_long="cut")


def test_non_utf8_jsonl_names_the_row_byte_column_and_offset(tmp_path, tokenizer):
    path = tmp_path / "prompts.jsonl"
    first = (json.dumps(FLAT[0]) + "\n").encode()
    path.write_bytes(first + b'{"prompt": "caf\xe9", "answer": "1"}\n')
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(path, tokenizer)
    assert not isinstance(info.value, UnicodeDecodeError)
    message = str(info.value)
    assert "prompts.jsonl: row 2: not UTF-8 (byte 0xe9 at column 16, " in message
    assert f"file offset {len(first) + 15})" in message and "save the file as UTF-8" in message


def test_utf8_byte_order_mark_is_accepted(tmp_path, tokenizer):
    path = tmp_path / "d.jsonl"
    path.write_bytes(b"\xef\xbb\xbf" + write_jsonl(tmp_path / "plain.jsonl", FLAT).read_bytes())
    assert load_prompt_dataset(path, tokenizer) == load_prompt_dataset(
        tmp_path / "plain.jsonl", tokenizer
    )


def test_non_utf8_parquet_string_names_the_row_and_field(tmp_path, tokenizer):
    import pyarrow as pa
    import pyarrow.parquet as pq

    raw = pa.array([b"what is one ?", b"two \xff"], type=pa.binary())
    prompts = pa.Array.from_buffers(pa.string(), len(raw), raw.buffers())  # unvalidated
    path = tmp_path / "d.parquet"
    pq.write_table(pa.table({"prompt": prompts, "answer": ["1", "2"]}), path)
    with pytest.raises(ValueError) as info:
        load_prompt_dataset(path, tokenizer)
    assert not isinstance(info.value, UnicodeDecodeError)
    assert "d.parquet: row 2: field 'prompt' is not UTF-8 (byte 0xff at byte 5" in str(info.value)
