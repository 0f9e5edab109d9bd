"""Config fields declared with `option` become flags (one field, one flag, its help written once);
`derived` and plain fields do not; values come back per section."""

from __future__ import annotations

import argparse
from dataclasses import dataclass

import pytest

from megatron_rl.flags import (
    add_section,
    bad_value,
    derived,
    derived_fields,
    flag_of,
    flat_names,
    option,
    section_values,
)


@dataclass(frozen=True, kw_only=True)
class Example:
    """An example section."""

    size: int = option(2, name="example-size", help="a size", aliases=("size",))
    rate: float | None = option(None, help="a rate (none: unset)")
    name: str = option("a", choices=("a", "b"), help="a choice")
    urls: tuple[str, ...] = option((), name="url", help="repeat for each")
    fast: bool = option(False, help="a switch")
    progress: bool = option(True, name="no-progress", help="a negative switch")
    dtype: str = option("float32", name="bf16", const="bfloat16", help="a switch with a value")
    level: int = option(0, parse=lambda text: {"low": 1, "high": 2}[text], help="parsed text")
    copied: int = derived(0, source="other.size")
    internal: int = 5


def _parse(argv):
    parser = argparse.ArgumentParser()
    add_section(parser, "example", Example(), "example")
    defaults = {"example": Example()}
    return Example(**section_values(parser.parse_args(argv), defaults)["example"])


def test_each_option_field_is_one_flag_with_the_section_defaults():
    assert _parse([]) == Example()
    config = _parse(
        [
            "--example-size",
            "3",
            "--rate",
            "0.5",
            "--name",
            "b",
            "--url",
            "x",
            "--url",
            "y",
            "--fast",
            "--no-progress",
            "--bf16",
            "--level",
            "high",
        ]
    )
    assert config == Example(
        size=3, rate=0.5, name="b", urls=("x", "y"), fast=True, progress=False,
        dtype="bfloat16", level=2,
    )  # fmt: skip
    assert _parse(["--size", "4", "--rate", "none"]).size == 4  # an alias; "none" is None


def test_derived_and_plain_fields_are_not_flags():
    with pytest.raises(SystemExit):
        _parse(["--copied", "1"])
    with pytest.raises(SystemExit):
        _parse(["--internal", "1"])
    assert derived_fields(Example) == {"copied": "other.size"}


def test_choices_are_enforced_and_errors_name_the_flag():
    with pytest.raises(SystemExit):
        _parse(["--name", "c"])
    assert flag_of(Example, "size") == "--example-size"
    assert flag_of(Example, "internal") == "Example.internal"
    message = "--example-size=2: must be odd (Example.size)"
    assert str(bad_value(Example(), "size", "must be odd")) == message
    assert str(bad_value(Example(), "internal", "no")) == "Example.internal=5: no"


def test_flat_names_turn_flag_values_into_field_values():
    names = flat_names({"example": Example()})
    assert set(names) >= {"example_size", "size", "no_progress", "bf16", "url"}
    section, field_name, to_value = names["bf16"]
    assert (section, field_name, to_value(True), to_value(False)) == (
        "example", "dtype", "bfloat16", "float32",
    )  # fmt: skip
    assert names["no_progress"][2](True) is False
    assert names["level"][2]("low") == 1 and names["level"][2](2) == 2
