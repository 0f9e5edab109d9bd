"""The CLI imports only what it needs when it needs it: ``--help`` and the parse step import no
megatron, transformers or torch.compile machinery; the start-up path up to the trainer imports
only what the main job needs before its first step, megatron's fused functions stay eager; and a
lazily registered module (wandb) still behaves as the real one once used."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import types

import pytest

from megatron_rl.lazy_exports import lazy_module

# not needed before the first step of the main job (built-in task and reward, in-process engine,
# no wandb, output not a terminal); each is imported where its feature is used
_NOT_ON_STARTUP_PATH = (
    "wandb.sdk",  # megatron-core's `import wandb` stays unexecuted (megatron_rl.lazy_module)
    "tensorboard",  # only with --tensorboard-dir (megatron_rl.train.tensorboard_writer)
    "torch.utils.tensorboard",
    "rich",
    "matplotlib",
    "math_verify",
    "datasets",
    "pyarrow",
    "pandas",
    "torch._dynamo",  # torch.compile: megatron's fuser stays eager (eager_megatron_fusions)
    "torch._inductor",
    "megatron_rl.routing.replay",
    "megatron_rl.rollout.sglang_client",
    "megatron_rl.rollout.http_pool",
    "megatron_rl.rollout.weight_sync",
)
# what a run needs only once it builds the model (or the task, for transformers)
_NOT_BEFORE_THE_RUN = (
    "megatron",
    "transformers",
    "safetensors",
    "sympy",
    "torch.distributed.tensor",
)


def _modules_after(code: str) -> dict:
    """The JSON object that ``code``, run in a fresh interpreter, prints on its last line."""
    env = {k: v for k, v in os.environ.items() if k not in ("FORCE_COLOR", "TTY_COMPATIBLE")}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=300,
        env=env,
        stdin=subprocess.DEVNULL,
    )
    return json.loads(out.stdout.strip().splitlines()[-1])


def _loaded(modules: list[str], names: tuple[str, ...]) -> list[str]:
    """The ``names`` (packages count with their submodules) found in ``modules``."""
    return [n for n in names if any(m == n or m.startswith(n + ".") for m in modules)]


@pytest.mark.slow
def test_help_and_the_parse_step_import_no_megatron_transformers_or_compiler():
    code = (
        "import contextlib, io, json, sys\n"
        "from megatron_rl.train.__main__ import main\n"
        "from megatron_rl.train.config import parse_args\n"
        "with contextlib.redirect_stdout(io.StringIO()) as help_text:\n"
        "    try:\n"
        "        main(['--help'])\n"
        "    except SystemExit:\n"
        "        pass\n"
        "after_help = sorted(sys.modules)\n"
        # flags whose features need heavy modules later: wandb, math-verify, the SGLang client,
        # tensorboard
        "parse_args(['--run-dir', 'unused', '--train-iters', '3', '--loss', 'gspo',\n"
        "            '--routing-replay', 'r2', '--wandb-project', 'p', '--reward', 'math',\n"
        "            '--rollout-engine', 'sglang', '--sglang-url', 'http://127.0.0.1:1',\n"
        "            '--tensorboard-dir', 'unused-tb'])\n"
        "print(json.dumps({'help': after_help, 'parse': sorted(sys.modules),\n"
        "                  'usage': help_text.getvalue()[:6]}))\n"
    )
    report = _modules_after(code)
    assert report["usage"] == "usage:"  # the help was printed
    unneeded = _NOT_ON_STARTUP_PATH + _NOT_BEFORE_THE_RUN
    assert _loaded(report["help"], unneeded) == []
    assert _loaded(report["parse"], unneeded) == []


@pytest.mark.slow
def test_cli_start_up_path_imports_megatron_only_with_the_trainer_and_keeps_its_fuser_eager(
    tmp_path,
):
    # `run` is stood in for by what the real one does first (its folders' checks need no model):
    # then it takes `Trainer` (megatron) and the progress line
    code = (
        "import inspect, json, sys\n"
        "import megatron_rl.train.run as run_module\n"
        "from megatron_rl.train.__main__ import main\n"
        "report = {}\n"
        "def run(config, *, task, load):\n"
        "    report['before_trainer'] = sorted(sys.modules)\n"
        "    run_module._trainer_class()\n"
        "    from megatron_rl.train.run_logger import _Progress, RunLoggerConfig\n"
        "    _Progress(RunLoggerConfig(run_dir='unused', total_steps=1), 0)\n"
        "    import megatron.core.jit as jit\n"
        "    from megatron.core.transformer.moe.router import TopKRouter\n"
        "    report['eager_fuser'] = jit.jit_fuser is jit.noop_decorator\n"
        "    report['router_fn'] = inspect.isfunction(TopKRouter.__dict__['_apply_expert_bias'])\n"
        "    report['wandb'] = type(sys.modules.get('wandb')).__name__\n"
        "    report['loaded'] = sorted(sys.modules)\n"
        "    return {}\n"
        "run_module.run = run\n"
        f"assert main(['--run-dir', {str(tmp_path)!r}, '--train-iters', '1']) == 0\n"
        "print(json.dumps(report))\n"
    )
    report = _modules_after(code)
    assert _loaded(report["before_trainer"], ("megatron",)) == []  # --load, folders: no model
    assert "megatron.core" in report["loaded"]  # the model needs it: the floor, not a regression
    assert _loaded(report["loaded"], _NOT_ON_STARTUP_PATH) == []
    assert report["eager_fuser"] and report["router_fn"]
    assert report["wandb"] in ("NoneType", "_LazyModule")


def _write_package(root, name: str, body: str) -> None:
    (root / name).mkdir()
    (root / name / "__init__.py").write_text(body)
    (root / name / "sub.py").write_text("VALUE = 7\n")


@pytest.fixture
def isolated_modules(tmp_path, monkeypatch):
    monkeypatch.syspath_prepend(str(tmp_path))
    before = set(sys.modules)
    yield tmp_path
    for name in set(sys.modules) - before:
        del sys.modules[name]


def test_lazy_module_runs_its_code_on_first_use_in_place(isolated_modules):
    _write_package(isolated_modules, "lazy_pkg_a", "RUNS = []\nRUNS.append(1)\nX = 3\n")
    lazy_module("lazy_pkg_a")
    import lazy_pkg_a

    held = lazy_pkg_a
    assert type(sys.modules["lazy_pkg_a"]).__name__ == "_LazyModule"  # import ran nothing
    assert lazy_pkg_a.__name__ == "lazy_pkg_a"
    assert lazy_pkg_a.X == 3 and lazy_pkg_a.RUNS == [1]  # ran once, on first use
    assert type(held) is types.ModuleType and sys.modules["lazy_pkg_a"] is held
    from lazy_pkg_a.sub import VALUE

    assert VALUE == 7


def test_lazy_module_submodule_import_runs_the_package_first(isolated_modules):
    _write_package(isolated_modules, "lazy_pkg_b", "READY = True\n")
    lazy_module("lazy_pkg_b")
    import lazy_pkg_b.sub

    assert lazy_pkg_b.READY and lazy_pkg_b.sub.VALUE == 7


def test_lazy_module_failure_surfaces_on_use_and_the_next_import_retries(isolated_modules):
    _write_package(isolated_modules, "lazy_pkg_c", "raise ImportError('broken')\n")
    lazy_module("lazy_pkg_c")
    import lazy_pkg_c

    with pytest.raises(ImportError, match="broken"):
        lazy_pkg_c.anything  # noqa: B018
    assert "lazy_pkg_c" not in sys.modules
    with pytest.raises(ImportError, match="broken"):
        import lazy_pkg_c


def test_lazy_module_leaves_missing_and_imported_modules_alone():
    lazy_module("no_such_module_megatron_rl")
    assert "no_such_module_megatron_rl" not in sys.modules
    before = sys.modules["json"]
    lazy_module("json")
    assert sys.modules["json"] is before


def test_lazy_wandb_is_the_real_module_once_used():
    pytest.importorskip("wandb")
    import megatron.core.timers as timers
    import wandb

    assert callable(wandb.init)
    assert type(wandb) is types.ModuleType
    assert timers.wandb is wandb  # megatron's reference is the same, loaded module
