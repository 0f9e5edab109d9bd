"""The trainer's start-up path imports only what the main job needs before its first step, and a
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
    "rich",
    "matplotlib",
    "math_verify",
    "datasets",
    "pyarrow",
    "pandas",
    "megatron_rl.routing.replay",
    "megatron_rl.rollout.sglang_client",
    "megatron_rl.rollout.http_pool",
    "megatron_rl.rollout.weight_sync",
)


@pytest.mark.slow
def test_importing_the_run_module_leaves_unneeded_packages_unimported():
    code = (
        "import json, sys\n"
        "import megatron_rl.train.run\n"
        "from megatron_rl.train.run_logger import _Progress, RunLoggerConfig\n"
        "_Progress(RunLoggerConfig(run_dir='unused', total_steps=1), 0)\n"
        "wandb = sys.modules.get('wandb')\n"
        "print(json.dumps({'loaded': sorted(sys.modules), 'wandb': type(wandb).__name__}))\n"
    )
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
    report = json.loads(out.stdout.strip().splitlines()[-1])
    loaded = set(report["loaded"])
    assert "megatron.core" in loaded  # the model needs it: the floor, not a regression
    early = [m for m in _NOT_ON_STARTUP_PATH if m in loaded]
    assert early == [], f"imported on the start-up path: {early}"
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
