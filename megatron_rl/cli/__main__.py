"""``megatron-rl <command> [options]`` (also ``python -m megatron_rl.cli``): the commands.

Each command is the ``main`` of one module, imported only when it runs: ``--help`` and a
mistyped command answer without importing torch or megatron. ``megatron-rl <command> --help``
shows the command's own options; ``megatron-rl --version`` the installed version.
"""

from __future__ import annotations

import sys
from collections.abc import Sequence

from megatron_rl.cli.dispatch import Command, dispatch

PROG = "megatron-rl"
DESCRIPTION = "RL post-training of mixture-of-experts LLMs on megatron-core."

# the explicit allowlist of commands, in the order `--help` lists them
COMMANDS = {
    "train": Command(
        module="megatron_rl.train.__main__",
        summary="RL-train a policy (python -m megatron_rl.train; every trainer flag)",
    ),
    "plan": Command(
        module="megatron_rl.cli.plan",
        summary="per-GPU memory of a training layout or of a launcher's trainer command",
    ),
    "convert": Command(
        module="megatron_rl.cli.convert",
        summary="convert a checkpoint: hf-to-megatron or megatron-to-hf",
    ),
    "study": Command(
        module="megatron_rl.cli.study",
        summary="run (or read) a study: RL arms over seeds, with confidence intervals",
    ),
    "study-summary": Command(
        module="megatron_rl.cli.study_summary",
        summary="rebuild a study's summary.md and curves.svg from its run records",
    ),
    "serve": Command(
        module="megatron_rl.rollout.serve",
        summary="start SGLang servers (and a router) for a training job",
    ),
    "recipes": Command(
        module="megatron_rl.recipes",
        summary="list the papers' recipes; print an arm's trainer flags",
    ),
    "warm-start": Command(
        module="megatron_rl.study.warm_start",
        summary="the long-response study's warm start: supervised steps to an HF checkpoint",
    ),
    "bench": Command(
        module="megatron_rl.cli.bench",
        summary="benchmarks: megatron-rl bench <name> (bench --help lists them)",
    ),
}


def _version() -> str:
    from importlib import metadata

    try:
        return metadata.version("megatron_rl")
    except metadata.PackageNotFoundError:  # run from a checkout that is not installed
        from megatron_rl import __version__

        return __version__


def main(argv: Sequence[str] | None = None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    if argv[:1] == ["--version"]:
        sys.stdout.write(f"{PROG} {_version()}\n")
        return 0
    return dispatch(PROG, DESCRIPTION, COMMANDS, argv)


if __name__ == "__main__":
    sys.exit(main())
