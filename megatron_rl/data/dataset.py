"""Load a prompt dataset (JSONL or Parquet) into tokenised `PromptRecord`s.

Two row layouts are understood:
- flat: ``{"prompt": "What is 1+1?", "answer": "2"}``;
- DAPO-Math-17k / verl: ``{"prompt": [{"role": "user", "content": "..."}],
  "reward_model": {"ground_truth": "2"}, ...}``.

The prompt is either a string or a list of chat messages (``{"role": ..., "content": ...}``).
With ``apply_chat_template=True`` and a tokenizer that has a chat template, the messages (a
string prompt becomes one user message) are rendered with it, generation prompt added. Otherwise
the prompt is used as plain text: a string as is, messages as their contents joined by blank lines.

Bad input raises ValueError naming the file, the row (1-based; for JSONL the line number) and the
field; bytes that are not UTF-8 are named by row, column and file offset.

A prompt longer than ``max_prompt_length`` tokens is handled by ``prompt_too_long``:
- ``"error"`` (default): ValueError naming the row, its length and the limit;
- ``"drop"``: the row is dropped, with one warning that counts the dropped rows;
- ``"truncate-left"``: the first tokens are cut so the last ``max_prompt_length`` remain (the
  question's end and the chat template's opened assistant turn are kept; a system prompt or the
  start of the question may be lost), with one warning counting the truncated rows.
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

from megatron_rl.data.records import PromptRecord
from megatron_rl.data.tokenizer import Tokenizer

logger = logging.getLogger(__name__)

ANSWER_KEYS = ("answer", "reward_model.ground_truth", "solution")
"""Answer fields tried in order when ``answer_key`` is None."""

PROMPT_TOO_LONG = ("error", "drop", "truncate-left")
"""What `load_prompt_dataset` does with a prompt longer than ``max_prompt_length``."""

_JSONL_SUFFIXES = (".jsonl", ".json")
_PARQUET_SUFFIXES = (".parquet", ".pq")


def load_prompt_dataset(
    path: str | os.PathLike[str],
    tokenizer: Tokenizer,
    *,
    prompt_key: str = "prompt",
    answer_key: str | None = None,
    apply_chat_template: bool = True,
    max_prompt_length: int | None = None,
    skip_long_prompts: bool = False,
    prompt_too_long: str = "error",
    limit_source: str | None = None,
) -> list[PromptRecord]:
    """Read, render and tokenise every row of ``path``.

    Args:
        path: a ``.jsonl`` (one JSON object per line; ``.json`` is read the same way) or a
            ``.parquet`` file.
        tokenizer: any `Tokenizer`; its ``apply_chat_template(messages) -> str`` method, when it
            has one and ``has_chat_template`` is true (`HFTokenizer`), renders chat prompts.
        prompt_key: the prompt field; a dotted path reaches into nested objects.
        answer_key: the answer field (dotted path); None tries ``ANSWER_KEYS`` in order, per row.
        apply_chat_template: render prompts with the tokenizer's chat template when it has one.
        max_prompt_length: longest allowed prompt in tokens; None for no limit.
        skip_long_prompts: the same as ``prompt_too_long="drop"`` (kept for old callers).
        prompt_too_long: ``"error"``, ``"drop"`` or ``"truncate-left"``: see the module doc.
        limit_source: where ``max_prompt_length`` comes from, for messages (e.g. "the model's
            context 512 - --max-response-length 4"); default ``"max_prompt_length"``.

    Returns:
        One `PromptRecord` per kept row, ``records[i].index == i``; answers as strings (numbers
        are converted with ``str``).
    """
    if prompt_too_long not in PROMPT_TOO_LONG:
        raise ValueError(
            f"prompt_too_long={prompt_too_long!r}: choose one of {', '.join(PROMPT_TOO_LONG)}"
        )
    if skip_long_prompts:
        prompt_too_long = "drop"
    limit_name = limit_source or "max_prompt_length"
    if max_prompt_length is not None and max_prompt_length < 1:
        raise ValueError(
            f"max_prompt_length={max_prompt_length!r} ({limit_name}): pass a positive token "
            "count or None"
        )
    path = Path(path)
    if not path.is_file():
        raise ValueError(f"prompt dataset {str(path)!r} does not exist or is not a file")
    use_template = apply_chat_template and bool(getattr(tokenizer, "has_chat_template", False))
    records: list[PromptRecord] = []
    too_long: list[int] = []
    for row_number, row in _read_rows(path):
        where = f"{path}: row {row_number}"
        if not isinstance(row, dict):
            raise ValueError(f"{where} is a {type(row).__name__}, not an object: {_FIX}")
        prompt = _field(row, prompt_key, where)
        text = _render_prompt(prompt, prompt_key, tokenizer, use_template, where)
        answer = _answer(row, answer_key, where)
        prompt_ids = tuple(int(t) for t in tokenizer.encode(text))
        if not prompt_ids:
            raise ValueError(f"{where}: field {prompt_key!r} tokenises to no tokens")
        if max_prompt_length is not None and len(prompt_ids) > max_prompt_length:
            if prompt_too_long == "error":
                raise ValueError(
                    f"{where}: prompt ({prompt_key!r}) has {len(prompt_ids)} tokens > "
                    f"{max_prompt_length} ({limit_name}): shorten the prompt, or pass "
                    "--prompt-too-long drop (skip such rows) or truncate-left (keep the last "
                    "tokens)"
                )
            too_long.append(row_number)
            if prompt_too_long == "drop":
                continue
            prompt_ids = prompt_ids[-max_prompt_length:]
            text = None  # the kept tokens are no longer the rendered text
        records.append(PromptRecord(len(records), prompt_ids, answer, text))
    if too_long:
        logger.warning(
            "%s: %s %d prompt(s) longer than %d tokens (%s) (rows %s%s)",
            path,
            "skipped" if prompt_too_long == "drop" else "left-truncated",
            len(too_long),
            max_prompt_length,
            limit_name,
            ", ".join(map(str, too_long[:10])),
            ", ..." if len(too_long) > 10 else "",
        )
    if not records:
        raise ValueError(f"prompt dataset {str(path)!r} has no usable rows: {_FIX}")
    logger.info("loaded %d prompts from %s", len(records), path)
    return records


_FIX = (
    'each row must be an object like {"prompt": "...", "answer": "..."} or the DAPO layout '
    '{"prompt": [{"role": "user", "content": "..."}], "reward_model": {"ground_truth": "..."}} '
    "(other field names: --prompt-key / --answer-key)"
)


def _read_rows(path: Path) -> Iterator[tuple[int, Any]]:
    """Yield ``(row_number, row)``; JSONL row numbers are line numbers (blank lines skipped)."""
    suffix = path.suffix.lower()
    if suffix in _JSONL_SUFFIXES:
        yield from _read_jsonl(path)
    elif suffix in _PARQUET_SUFFIXES:
        try:
            import pyarrow.parquet as pq
        except ImportError as err:
            raise ValueError(
                f"{path}: reading Parquet needs pyarrow: `pip install pyarrow`, or convert the "
                "file to JSONL"
            ) from err
        try:
            table = pq.read_table(path)
        except Exception as err:  # pyarrow raises its own ArrowInvalid/OSError family
            raise ValueError(f"{path}: unreadable Parquet file ({err})") from err
        try:
            rows = table.to_pylist()
        except UnicodeDecodeError as err:  # a string column holding bytes that are not UTF-8
            raise _parquet_utf8_error(path, table, err) from err
        yield from enumerate(rows, start=1)
    else:
        raise ValueError(
            f"prompt dataset {str(path)!r}: unknown extension {suffix!r}; use one of "
            f"{', '.join(_JSONL_SUFFIXES + _PARQUET_SUFFIXES)}"
        )


def _read_jsonl(path: Path) -> Iterator[tuple[int, Any]]:
    """JSONL rows, decoded line by line so that a byte that is not UTF-8 is named exactly."""
    offset = 0  # of the line's first byte in the file
    try:
        with path.open("rb") as f:
            for line_number, raw in enumerate(f, start=1):
                try:
                    # a UTF-8 byte-order mark (Windows editors write one) is not an error
                    line = raw.decode("utf-8-sig" if line_number == 1 else "utf-8")
                except UnicodeDecodeError as err:
                    bom = 3 if line_number == 1 and raw.startswith(b"\xef\xbb\xbf") else 0
                    column = err.start + bom + 1
                    raise ValueError(
                        f"{path}: row {line_number}: not UTF-8 (byte 0x{raw[column - 1]:02x} at "
                        f"column {column}, file offset {offset + column - 1}): save the file as "
                        "UTF-8 (e.g. `iconv -f latin1 -t utf-8`)"
                    ) from err
                offset += len(raw)
                if not line.strip():
                    continue
                try:
                    yield line_number, json.loads(line)
                except json.JSONDecodeError as err:
                    raise ValueError(
                        f"{path}: row {line_number} is not valid JSON ({err.msg} at column "
                        f"{err.colno}): write one JSON object per line"
                    ) from err
    except OSError as err:
        raise ValueError(f"{path}: cannot read the prompt dataset ({err})") from err


def _parquet_utf8_error(path: Path, table: Any, err: UnicodeDecodeError) -> ValueError:
    """The row and column of the first string value that is not UTF-8."""
    for name in table.column_names:
        column = table.column(name)
        for row in range(len(column)):
            try:
                column[row].as_py()
            except UnicodeDecodeError as cell_err:
                bad = cell_err.object[cell_err.start]
                return ValueError(
                    f"{path}: row {row + 1}: field {name!r} is not UTF-8 (byte 0x{bad:02x} at "
                    f"byte {cell_err.start + 1} of the value): write the column as UTF-8 strings"
                )
    return ValueError(f"{path}: a string column is not UTF-8 ({err}): write it as UTF-8")


def _lookup(row: dict[str, Any], key: str) -> tuple[bool, Any]:
    """``(found, value)`` for a dotted ``key`` in nested dicts."""
    value: Any = row
    for part in key.split("."):
        if not isinstance(value, dict) or part not in value:
            return False, None
        value = value[part]
    return True, value


def _field(row: dict[str, Any], key: str, where: str) -> Any:
    """The prompt field ``key`` of ``row`` (``--prompt-key``)."""
    found, value = _lookup(row, key)
    if not found or value is None:
        raise ValueError(
            f"{where}: missing field {key!r} (row has {sorted(row)}): pass --prompt-key "
            "(prompt_key) naming the prompt field (dotted paths reach nested fields), or fix the "
            "row"
        )
    return value


def _render_prompt(
    prompt: Any, key: str, tokenizer: Tokenizer, use_template: bool, where: str
) -> str:
    if isinstance(prompt, str):
        messages = [{"role": "user", "content": prompt}]
    elif isinstance(prompt, Sequence) and all(_is_message(m) for m in prompt) and prompt:
        messages = [{"role": str(m["role"]), "content": str(m["content"])} for m in prompt]
    else:
        raise ValueError(
            f"{where}: field {key!r} is a {type(prompt).__name__}; it must be a string or a "
            'non-empty list of {"role": ..., "content": ...} messages'
        )
    if not any(m["content"].strip() for m in messages):
        raise ValueError(f"{where}: field {key!r} is empty: give every row a non-empty prompt")
    if use_template:
        return tokenizer.apply_chat_template(messages)  # type: ignore[attr-defined]
    if isinstance(prompt, str):
        return prompt
    return "\n\n".join(m["content"] for m in messages)


def _is_message(message: Any) -> bool:
    return isinstance(message, dict) and "role" in message and "content" in message


def _answer(row: dict[str, Any], answer_key: str | None, where: str) -> str:
    keys = ANSWER_KEYS if answer_key is None else (answer_key,)
    for key in keys:
        found, value = _lookup(row, key)
        if found and value is not None:
            break
    else:
        tried = " / ".join(repr(k) for k in keys)
        raise ValueError(
            f"{where}: missing answer field {tried} (row has {sorted(row)}): pass --answer-key "
            "(answer_key) naming the reference-answer field (dotted paths reach nested fields), "
            "or fix the row"
        )
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise ValueError(
            f"{where}: answer field {key!r} is a {type(value).__name__}; it must be a string or "
            "a number"
        )
    answer = str(value)
    if not answer.strip():
        raise ValueError(f"{where}: answer field {key!r} is empty: every row needs an answer")
    return answer
