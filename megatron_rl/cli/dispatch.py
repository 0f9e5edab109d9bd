"""Lazy subcommands: a registry of names, each naming the module whose ``main(argv) -> int`` runs
it and a one-line summary. A command's module is imported only when that command runs, so
``megatron-rl --help`` and a mistyped name answer without importing torch or megatron.

A registry is an explicit allowlist (`Command` per name); an unknown name is an error (exit
status 2) that lists the names there are and the closest one.
"""

from __future__ import annotations

import contextlib
import dataclasses
import difflib
import importlib
import sys
from collections.abc import Iterator, Mapping, Sequence


@dataclasses.dataclass(frozen=True, kw_only=True, slots=True)
class Command:
    """One subcommand: ``module`` (dotted) defines ``main(argv: list[str] | None) -> int``."""

    module: str
    summary: str

    def __post_init__(self) -> None:
        if "\n" in self.summary or not self.summary:
            raise ValueError(f"Command.summary={self.summary!r}: give one non-empty line")


def listing(prog: str, description: str, commands: Mapping[str, Command]) -> str:
    """The help text: usage, ``description`` and one line per command."""
    width = max(len(name) for name in commands)
    lines = [
        f"usage: {prog} <command> [options]",
        "",
        description,
        "",
        "commands:",
        *(f"  {name:<{width}}  {command.summary}" for name, command in commands.items()),
        "",
        f"`{prog} <command> --help` shows a command's own options.",
    ]
    return "\n".join(lines) + "\n"


@contextlib.contextmanager
def _program(name: str, argv: Sequence[str]) -> Iterator[None]:
    """``sys.argv`` as if ``name`` were the program run with ``argv``: argparse's default
    ``prog`` (the usage line) then reads ``megatron-rl plan``; restored afterwards."""
    saved = sys.argv
    sys.argv = [name, *argv]
    try:
        yield
    finally:
        sys.argv = saved


def run(prog: str, name: str, command: Command, argv: Sequence[str]) -> int:
    """Import ``command``'s module and run its ``main`` on ``argv``; its exit status."""
    module = importlib.import_module(command.module)
    with _program(f"{prog} {name}", argv):
        status = module.main(list(argv))
    return 0 if status is None else int(status)


def dispatch(
    prog: str, description: str, commands: Mapping[str, Command], argv: Sequence[str]
) -> int:
    """Run the command ``argv[0]`` names with the rest of ``argv``.

    ``-h``/``--help`` prints the listing (status 0); no command prints it to stderr (status 2);
    an unknown command is an error naming the commands there are (status 2).
    """
    if argv and argv[0] in ("-h", "--help"):
        sys.stdout.write(listing(prog, description, commands))
        return 0
    if not argv:
        sys.stderr.write(listing(prog, description, commands))
        sys.stderr.write(f"{prog}: error: name a command\n")
        return 2
    name, rest = argv[0], argv[1:]
    command = commands.get(name)
    if command is None:
        close = difflib.get_close_matches(name, list(commands), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        sys.stderr.write(
            f"usage: {prog} <command> [options]\n"
            f"{prog}: error: unknown command {name!r}{hint}; commands: {', '.join(commands)}\n"
        )
        return 2
    return run(prog, name, command, rest)
