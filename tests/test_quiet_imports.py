"""`eager_megatron_fusions`: megatron-core's ``@jit_fuser`` functions stay plain functions, no
torch.compile machinery is imported for them, and a CLI run gives the same metrics as with
megatron's own ``torch.compile`` fuser."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from megatron_rl.quiet_imports import defer_megatron_tensorboard, eager_megatron_fusions


def _python(code: str, *, cwd=None) -> str:
    env = {**os.environ, "OMP_NUM_THREADS": "1"}
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code],
        capture_output=True,
        text=True,
        check=True,
        timeout=600,
        env=env,
        cwd=cwd,
        stdin=subprocess.DEVNULL,
    )
    return out.stdout


@pytest.mark.slow
def test_eager_megatron_fusions_keeps_megatron_functions_plain_and_imports_no_compiler():
    code = (
        "import inspect, json, sys\n"
        "from megatron_rl.quiet_imports import eager_megatron_fusions, _EagerFuserFinder\n"
        "installed = eager_megatron_fusions()\n"
        "import megatron.core\n"
        "import megatron.core.jit as jit\n"
        "from megatron.core.transformer.moe.router import TopKRouter\n"
        "print(json.dumps({\n"
        "    'installed': installed,\n"
        "    'eager': jit.jit_fuser is jit.noop_decorator,\n"
        "    'router_fn': inspect.isfunction(TopKRouter.__dict__['_apply_expert_bias']),\n"
        "    'source': 'def disable_jit_fuser' in inspect.getsource(jit),\n"
        "    'compiler': [m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules],\n"
        "    'finder_left': any(isinstance(f, _EagerFuserFinder) for f in sys.meta_path),\n"
        "}))\n"
    )
    report = json.loads(_python(code).strip().splitlines()[-1])
    assert report == {
        "installed": True,
        "eager": True,
        "router_fn": True,
        "source": True,  # the module keeps its own loader's get_source (tracebacks, inspect)
        "compiler": [],
        "finder_left": False,  # used once, then gone
    }


def test_eager_megatron_fusions_changes_nothing_once_megatron_jit_is_imported():
    import megatron.core.jit  # noqa: F401

    before = list(sys.meta_path)
    assert eager_megatron_fusions() is False
    assert sys.meta_path == before


@pytest.mark.slow
def test_defer_megatron_tensorboard_keeps_tensorboard_out_until_a_writer_is_used(tmp_path):
    pytest.importorskip("tensorboard")
    code = (
        "import json, sys\n"
        "from megatron_rl.quiet_imports import DeferredSummaryWriter, defer_megatron_tensorboard\n"
        "installed = defer_megatron_tensorboard()\n"
        "import megatron.core\n"
        "import megatron.core.timers as timers\n"
        "loaded = [m for m in ('tensorboard', 'torch.utils.tensorboard') if m in sys.modules]\n"
        "deferred = timers.SummaryWriter is DeferredSummaryWriter\n"
        "writer = timers.SummaryWriter(log_dir=sys.argv[1])  # megatron's name: the real class\n"
        "from torch.utils.tensorboard import SummaryWriter\n"
        "print(json.dumps({\n"
        "    'installed': installed, 'loaded_with_megatron': loaded, 'deferred': deferred,\n"
        "    'real': type(writer) is SummaryWriter,\n"
        "    'isinstance': [isinstance(writer, timers.SummaryWriter),\n"
        "                   isinstance(object(), timers.SummaryWriter)],\n"
        "}))\n"
        "writer.close()\n"
    )
    out = subprocess.run(
        [sys.executable, "-W", "ignore", "-c", code, str(tmp_path / "tb")],
        capture_output=True, text=True, check=True, timeout=600, stdin=subprocess.DEVNULL,
        env={**os.environ, "OMP_NUM_THREADS": "1"},
    )  # fmt: skip
    assert json.loads(out.stdout.strip().splitlines()[-1]) == {
        "installed": True,
        "loaded_with_megatron": [],
        "deferred": True,
        "real": True,
        "isinstance": [True, False],  # megatron's Timers.write still recognises a writer
    }


def test_defer_megatron_tensorboard_changes_nothing_once_megatron_timers_is_imported():
    import megatron.core.timers  # noqa: F401

    before = list(sys.meta_path)
    assert defer_megatron_tensorboard() is False
    assert sys.meta_path == before


def _metrics_without_times(run_dir) -> list[dict]:
    with open(os.path.join(run_dir, "metrics.jsonl"), encoding="utf-8") as f:
        rows = [json.loads(line) for line in f]
    return [{k: v for k, v in row.items() if not k.startswith("time/")} for row in rows]


@pytest.mark.slow
@pytest.mark.hardware_sensitive
def test_cli_run_with_eager_fusions_matches_megatron_compiled_fuser(tmp_path):
    """One step (two updates) each way: every metric within 1e-5 (relative; 1e-7 absolute). The
    compiled fuser generates its own CPU kernels, so the runs may differ in the last bits (equal
    here); a second step would sample from those weights, and what sampling makes of a last-bit
    difference depends on the machine."""
    flags = ["--train-iters", "1", "--no-progress", "--seed", "3"]
    # the CLI as it is (eager), and the CLI after megatron was imported first: its fuser is then
    # torch.compile, as it was before the CLI made it eager
    eager_dir, compiled_dir = tmp_path / "eager", tmp_path / "compiled"
    template = (
        "import sys\n"
        "{prelude}"
        "from megatron_rl.train.__main__ import main\n"
        "assert main({argv!r}) == 0\n"
        "import megatron.core.jit as jit, torch\n"
        "print('fuser', jit.jit_fuser is torch.compile)\n"
    )
    eager = _python(
        template.format(prelude="", argv=["--run-dir", str(eager_dir), *flags]),
        cwd=tmp_path,
    )
    compiled = _python(
        template.format(
            prelude="import megatron.core\n", argv=["--run-dir", str(compiled_dir), *flags]
        ),
        cwd=tmp_path,
    )
    assert eager.strip().splitlines()[-1] == "fuser False"
    assert compiled.strip().splitlines()[-1] == "fuser True"
    eager_rows = _metrics_without_times(eager_dir)
    compiled_rows = _metrics_without_times(compiled_dir)
    assert len(eager_rows) == len(compiled_rows) == 1
    assert set(eager_rows[0]) == set(compiled_rows[0])
    for key, value in eager_rows[0].items():
        assert compiled_rows[0][key] == pytest.approx(value, rel=1e-5, abs=1e-7), key
