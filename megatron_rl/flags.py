"""Command-line flags generated from config dataclasses: a field declared with `option` is a flag.

A config section is a dataclass; each of its `option` fields becomes ``--<flag>`` (the field's
name with dashes, unless the option names another, e.g. Megatron-LM's), with its help text
written once, next to the field. Other fields are set by code (`derived` ones are filled from
another section by `megatron_rl.train.config.TrainConfig`).

The flag's kind follows the field's annotation: ``bool`` is a switch (``--x`` sets True; a field
whose default is True takes a negative flag such as ``--no-progress``, which sets False), ``int``,
``float``, ``str``, ``X | None`` (the text ``none`` gives None) and ``tuple[str, ...]`` (the flag
repeats). ``parse`` maps the flag's text to the field's value; ``const`` makes a switch that
stores that value (``--bf16`` sets ``dtype="bfloat16"``).
"""

from __future__ import annotations

import argparse
import dataclasses
import types
import typing
from collections.abc import Callable
from dataclasses import MISSING

_FLAG = "megatron_rl.flag"
_DERIVED = "megatron_rl.derived"
_NO_CONST = object()


@dataclasses.dataclass(frozen=True, slots=True)
class Flag:
    """How one field appears on the command line."""

    help: str
    name: str | None = None  # None: the field's name with dashes
    choices: tuple | None = None
    parse: Callable[[str], object] | None = None  # flag text -> field value
    const: object = _NO_CONST  # a switch that stores this value
    aliases: tuple[str, ...] = ()


def option(default=MISSING, *, help: str, default_factory=MISSING, **flag) -> dataclasses.Field:
    """A config field that is a command-line flag (see the module docstring)."""
    return dataclasses.field(
        default=default,
        default_factory=default_factory,
        metadata={_FLAG: Flag(help=help, **flag)},
    )


def derived(default, *, source: str) -> dataclasses.Field:
    """A field the composite config fills from another section (``source``, e.g.
    ``"rollout.max_response_length"``): not a flag, one value under one name."""
    return dataclasses.field(default=default, metadata={_DERIVED: source})


def derived_fields(cls) -> dict[str, str]:
    """``{field name: source}`` of ``cls``'s `derived` fields."""
    return {f.name: f.metadata[_DERIVED] for f in dataclasses.fields(cls) if _DERIVED in f.metadata}


def flag_of(cls, name: str) -> str:
    """``--flag`` of field ``name`` of config class ``cls`` (``Cls.name`` if it is no flag)."""
    for f in dataclasses.fields(cls):
        if f.name == name and _FLAG in f.metadata:
            return "--" + (f.metadata[_FLAG].name or name.replace("_", "-"))
    return f"{cls.__name__}.{name}"


def bad_value(config, name: str, why: str) -> ValueError:
    """``ValueError("--flag=value: why (Cls.field)")`` for field ``name`` of ``config``: the flag
    for command-line users, the field for those who build the config in Python."""
    cls = type(config)
    where = flag_of(cls, name)
    field_name = f"{cls.__name__}.{name}"
    suffix = f" ({field_name})" if where != field_name else ""
    return ValueError(f"{where}={getattr(config, name)!r}: {why}{suffix}")


def check_choice(config, name: str, allowed) -> None:
    """Raise `bad_value` unless field ``name`` of ``config`` is one of ``allowed``."""
    if getattr(config, name) not in allowed:
        raise bad_value(config, name, f"choose one of {tuple(allowed)}")


def check_positive_ints(config, *names: str) -> None:
    """Raise `bad_value` for the first field of ``names`` that is not an integer >= 1."""
    for name in names:
        value = getattr(config, name)
        if isinstance(value, bool) or not (isinstance(value, int) and value >= 1):
            raise bad_value(config, name, "must be an integer >= 1")


def add_section(parser: argparse.ArgumentParser, section: str, defaults, title: str):
    """Add the `option` fields of config instance ``defaults`` as one argument group; each
    flag's default is ``defaults``' value and its destination ``"<section>.<field>"``."""
    cls = type(defaults)
    hints = typing.get_type_hints(cls)
    group = parser.add_argument_group(title, (cls.__doc__ or "").strip().split("\n")[0] or None)
    for f in dataclasses.fields(cls):
        flag = f.metadata.get(_FLAG)
        if flag is None:
            continue
        default = getattr(defaults, f.name)
        names = [f"--{flag.name or f.name.replace('_', '-')}", *(f"--{a}" for a in flag.aliases)]
        kwargs = {"dest": f"{section}.{f.name}", "default": default, "help": flag.help}
        kind, optional = _base_type(hints[f.name])
        if flag.const is not _NO_CONST:
            kwargs.update(action="store_const", const=flag.const)
        elif flag.parse is not None:
            kwargs.update(type=flag.parse, metavar=_metavar(names[0]))
        elif kind is bool:
            kwargs.update(action="store_false" if default else "store_true")
        elif kind is tuple:
            kwargs.update(action="append", default=None, type=str, metavar=_metavar(names[0]))
        elif flag.choices is not None:
            kwargs.update(type=_scalar(kind, optional), choices=flag.choices)
        else:
            kwargs.update(type=_scalar(kind, optional), metavar=_metavar(names[0]))
        group.add_argument(*names, **kwargs)
    return group


def section_values(namespace: argparse.Namespace, defaults: dict) -> dict[str, dict]:
    """``{section: {field: value}}`` from a namespace filled by `add_section` groups; a repeated
    flag that was never given keeps the section default's value (``defaults[section]``)."""
    out: dict[str, dict] = {}
    for key, value in vars(namespace).items():
        section, _, name = key.partition(".")
        if not name:
            continue
        if value is None and isinstance(getattr(defaults[section], name), tuple):
            value = getattr(defaults[section], name)
        out.setdefault(section, {})[name] = tuple(value) if isinstance(value, list) else value
    return out


def flat_names(defaults: dict) -> dict[str, tuple[str, str, Callable[[object], object]]]:
    """``{flag name with underscores: (section, field, to_value)}`` over the sections' `option`
    fields (aliases included): the flat keyword spelling of every flag. ``to_value`` turns what
    the flag takes into the field's value: ``bf16=True`` sets ``dtype="bfloat16"``,
    ``no_progress=True`` sets ``show_progress=False``, text goes through ``parse``."""
    out: dict[str, tuple[str, str, Callable[[object], object]]] = {}
    for section, instance in defaults.items():
        cls = type(instance)
        hints = typing.get_type_hints(cls)
        for f in dataclasses.fields(cls):
            flag = f.metadata.get(_FLAG)
            if flag is None:
                continue
            to_value = _to_value(flag, _base_type(hints[f.name])[0], getattr(instance, f.name))
            for name in (flag.name or f.name, *flag.aliases):
                out[name.replace("-", "_")] = (section, f.name, to_value)
    return out


def _to_value(flag: Flag, kind: type, default) -> Callable[[object], object]:
    if flag.const is not _NO_CONST:
        return lambda given: flag.const if given else default
    if flag.parse is not None:
        return lambda given: flag.parse(given) if isinstance(given, str) else given
    if kind is bool and default:  # a negative switch (--no-x)
        return lambda given: not given
    return lambda given: given


def _metavar(flag: str) -> str:
    return flag.removeprefix("--").replace("-", "_").upper()


def _base_type(hint) -> tuple[type, bool]:
    """(the annotation's type without None, whether None is allowed)."""
    args = typing.get_args(hint)
    if typing.get_origin(hint) in (typing.Union, types.UnionType):
        rest = [a for a in args if a is not type(None)]
        return _base_type(rest[0])[0], True
    return (typing.get_origin(hint) or hint), False


def _scalar(kind: type, optional: bool) -> Callable[[str], object]:
    if not optional:
        return kind

    def parse(text: str):
        return None if text.lower() == "none" else kind(text)

    parse.__name__ = kind.__name__  # argparse names the type in its error message
    return parse
