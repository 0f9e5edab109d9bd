"""The ``megatron-rl`` command (megatron_rl/cli): ``--help`` lists every command in one line each,
each command's ``--help`` is its own parser's, a mistyped command is an error naming the
commands (exit 2), the dispatcher imports no torch or megatron, the console script is
registered, and every ``tools/`` shim calls the very ``main`` its command runs."""

from __future__ import annotations

import ast
import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from megatron_rl.cli.__main__ import COMMANDS, main
from megatron_rl.cli.bench import BENCHES
from megatron_rl.cli.dispatch import Command

ROOT = Path(__file__).resolve().parents[2]

# an option that only the command's own parser has: its --help reached that parser
OWN_OPTION = {
    "train": "--rollout-batch-size",
    "plan": "--micro-batch-tokens",
    "convert": "--max-shard-gb",
    "study": "--staleness",
    "study-summary": "--strict-revision",
    "serve": "--model-path",
    "recipes": "--kl-default",
    "warm-start": "--eval-samples",
}
BENCH_OPTION = {
    "step": "--old-tree",
    "losses": "--seq-len",
    "engine": "--batch-sizes",
    "model": "--steps",
    "optimizer": "--fused",
    "logprobs": "--chunk",
    "routing": "--memory-json",
    "codecs": "--topk",
    "batching": "--budgets",
    "pipeline": "--micro-batches",
}
# the old entry points: each script in tools/ and the command whose main it calls
SHIMS = {
    "memory_plan.py": ("plan",),
    "convert_checkpoint.py": ("convert",),
    "compare_runs.py": ("study",),
    "study_summary.py": ("study-summary",),
    **{f"bench_{name}.py": ("bench", name) for name in BENCH_OPTION},
}
# what the dispatcher must not import: a command's module brings these in when it runs
HEAVY = ("torch", "megatron", "transformers", "numpy", "rich", "matplotlib")


def _module_of(command: tuple[str, ...]) -> str:
    registry = BENCHES if command[0] == "bench" else COMMANDS
    return registry[command[-1]].module


def test_the_tables_cover_every_command_and_benchmark():
    assert set(OWN_OPTION) | {"bench"} == set(COMMANDS)
    assert set(BENCH_OPTION) == set(BENCHES)


def test_help_lists_every_command_in_one_line(capsys):
    assert main(["--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "usage: megatron-rl <command> [options]"
    for name, command in COMMANDS.items():
        listed = [line for line in lines if line.split()[:1] == [name]]
        assert len(listed) == 1 and listed[0].strip().endswith(command.summary), name
    assert main(["bench", "--help"]) == 0
    lines = capsys.readouterr().out.splitlines()
    for name, command in BENCHES.items():
        assert any(line.split()[:1] == [name] and command.summary in line for line in lines)


@pytest.mark.parametrize("name", sorted(OWN_OPTION))
def test_each_command_help_is_its_own_parser(name, capsys):
    with pytest.raises(SystemExit) as stop:
        main([name, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert OWN_OPTION[name] in out
    assert out.startswith(f"usage: megatron-rl {name}"), out[:200]


def test_the_trainer_help_names_the_module_when_run_as_one():
    command = [sys.executable, "-m", "megatron_rl.train", "--help"]
    out = subprocess.run(command, capture_output=True, text=True, check=True).stdout
    assert out.startswith("usage: python -m megatron_rl.train"), out[:200]


# the engine's benchmark imports the in-process engine (transformers' model classes): ~6 s
SLOW_IMPORTS = {"engine"}


@pytest.mark.parametrize(
    "name",
    [
        pytest.param(name, marks=pytest.mark.slow) if name in SLOW_IMPORTS else name
        for name in sorted(BENCH_OPTION)
    ],
)
def test_each_benchmark_help_is_its_own_parser(name, capsys):
    with pytest.raises(SystemExit) as stop:
        main(["bench", name, "--help"])
    assert stop.value.code == 0
    out = capsys.readouterr().out
    assert out.startswith(f"usage: megatron-rl bench {name}") and BENCH_OPTION[name] in out


def test_the_command_restores_sys_argv(capsys):
    before = list(sys.argv)
    with pytest.raises(SystemExit):
        main(["recipes", "--help"])
    capsys.readouterr()
    assert sys.argv == before
    assert main(["recipes", "--list"]) == 0  # a command's exit status comes back
    assert "epic-paper" in capsys.readouterr().out


def test_an_unknown_command_is_an_error_naming_the_commands(capsys):
    assert main(["trian"]) == 2
    err = capsys.readouterr().err
    assert "unknown command 'trian'" in err and "did you mean 'train'" in err
    assert all(name in err for name in COMMANDS)
    assert main([]) == 2
    assert "name a command" in capsys.readouterr().err
    assert main(["bench", "steps"]) == 2
    err = capsys.readouterr().err
    assert "megatron-rl bench: error: unknown command 'steps'" in err
    assert all(name in err for name in BENCHES)


def test_version(capsys):
    assert main(["--version"]) == 0
    assert capsys.readouterr().out.startswith("megatron-rl ")


def test_a_command_summary_is_one_line():
    with pytest.raises(ValueError, match="one non-empty line"):
        Command(module="megatron_rl.cli.plan", summary="two\nlines")


def test_the_dispatcher_imports_no_torch_or_megatron():
    """``--help`` at both levels, an unknown command and ``--version`` import only the
    dispatcher: the listing answers at once."""
    code = textwrap.dedent(f"""
        import contextlib, io, json, sys
        from megatron_rl.cli.__main__ import main
        runs = (["--help"], ["bench", "--help"], ["nope"], ["--version"])
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            codes = [main(argv) for argv in runs]
        heavy = sorted(m for m in sys.modules if m.split(".")[0] in {HEAVY!r})
        print(json.dumps({{"codes": codes, "heavy": heavy}}))
    """)
    out = subprocess.run(
        [sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=120
    )
    result = json.loads(out.stdout.strip().splitlines()[-1])
    assert result == {"codes": [0, 0, 2, 0], "heavy": []}


def _console_scripts() -> dict[str, str]:
    """``console_scripts`` of setup.py, read from its source (name -> ``module:function``)."""
    tree = ast.parse((ROOT / "setup.py").read_text())
    for node in ast.walk(tree):
        if isinstance(node, ast.keyword) and node.arg == "entry_points":
            scripts = ast.literal_eval(node.value)["console_scripts"]
            return dict((part.strip() for part in s.split("=")) for s in scripts)
    raise AssertionError("setup.py has no entry_points")


def test_the_console_scripts_are_the_dispatcher_and_the_trainer():
    scripts = _console_scripts()
    assert scripts["megatron-rl"] == "megatron_rl.cli.__main__:main"
    assert scripts["megatron-rl-train"] == f"{COMMANDS['train'].module}:main"


def test_the_installed_console_script_lists_the_commands():
    script = Path(sys.executable).with_name("megatron-rl")
    if not script.exists():
        pytest.skip("the megatron-rl script is not installed in this venv (pip install -e .)")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run(
        [str(script), "--help"], capture_output=True, text=True, timeout=60, env=env
    )
    assert out.returncode == 0, out.stderr
    assert all(f"  {name} " in out.stdout for name in COMMANDS)


@pytest.mark.parametrize("shim", sorted(SHIMS))
def test_each_tools_shim_calls_its_commands_main(shim):
    """The script imports ``main`` from the module the command runs and exits with its status:
    ``python tools/<shim>`` and ``megatron-rl <command>`` are one code path."""
    tree = ast.parse((ROOT / "tools" / shim).read_text())
    imports = [node for node in tree.body if isinstance(node, ast.ImportFrom)]
    assert [(node.module, [a.name for a in node.names]) for node in imports] == [
        (_module_of(SHIMS[shim]), ["main"])
    ]
    guard = tree.body[-1]
    assert isinstance(guard, ast.If) and "__main__" in ast.unparse(guard.test)
    assert ast.unparse(guard.body[0]) == "sys.exit(main())"


@pytest.mark.slow
@pytest.mark.parametrize("shim", ["memory_plan.py", "study_summary.py"])
def test_a_shim_prints_the_commands_own_help(shim):
    """Run for real: the old script and the installed command's module print the same help
    (only the program name in the usage line differs)."""
    command = SHIMS[shim]

    def run(*argv: str) -> str:
        out = subprocess.run(
            [sys.executable, *argv, "--help"],
            capture_output=True, text=True, check=True, timeout=300, cwd=ROOT,
        )  # fmt: skip
        return out.stdout

    old = run(f"tools/{shim}").replace(f"usage: {shim}", "usage: PROG")
    new = run("-m", "megatron_rl.cli", *command).replace(
        f"usage: megatron-rl {' '.join(command)}", "usage: PROG"
    )
    assert old.split() == new.split()  # argparse wraps the usage after the program name


def test_the_readme_names_every_command():
    readme = (ROOT / "README.md").read_text()
    missing = [name for name in COMMANDS if f"megatron-rl {name}" not in readme]
    assert not missing, f"README.md does not mention: {missing}"
