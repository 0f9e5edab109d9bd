"""Rehearse a cluster launcher on this machine: every node it defines, run as a node runs it.

    python tools/rehearse_launchers.py --launcher 30b [--out runs/rehearsal]   (make rehearsal)

Each "node" is the launcher script as shipped (``bash examples/...sh``), unchanged, started with
the environment a node of the cluster would get plus the documented overrides of
``examples/qwen3_moe/common.sh`` that shrink the job to one machine: ``GPUS_PER_NODE=1``,
``TRAIN_PARALLEL`` (the trainer's layout over the rehearsal's ranks), ``SERVER_TP=1``,
``SERVER_EP=1``, ``SERVER_MEM_FRACTION``, ``SERVER_BIND_HOST`` (each serving "node" listens on
its own loopback address), ``SGLANG_EXTRA_ARGS`` (SGLang's CPU engine), ``SGLANG_PYTHON`` (the
real SGLang 0.5.23 from ``.venv-sglang/``, `make sglang-env`) and ``TRAIN_EXTRA_ARGS`` (CPU,
a small batch, a few steps). What runs is real: torchrun with one rendezvous across the
training "nodes", ``megatron_rl.rollout.serve`` starting the real SGLang server on every serving
"node", the markers and the heartbeat on the run folder, R3 routes from the servers, the weight
group spanning the serving nodes.

The rehearsal (`rehearse`):

1. writes a tiny model of the launcher's family with a word-level tokenizer and a prompt file of
   sums (`write_assets`), and draws the ports (held until the processes that bind them are up);
2. starts every node's command, waits until the trainer has saved a checkpoint at step
   ``save_interval`` (>= 3 steps trained), then sends SIGTERM to node 0's script, as a
   preemption or a launcher's trap does, and checks that every node's process ends (the other
   training node through torchrun, the serving nodes through the heartbeat's removal);
3. reruns the same commands: the trainer resumes from that checkpoint and trains to the end,
   after which every node must exit 0;
4. checks that the metrics of both runs cover every step once after the resume, that the
   servers' weights were synchronised every step, that the R3 routes came from the servers, and
   that no process started under the rehearsal's folder is left.

`RehearsalFailed` names the step and the node whose log explains it. What a cluster alone can
prove (NCCL across nodes, GPU memory, FP8 serving, throughput) is listed in
docs/cluster-launch.md, "The one-machine rehearsal".
"""

from __future__ import annotations

import argparse
import contextlib
import dataclasses
import json
import os
import random
import re
import shlex
import signal
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
# the tests' helpers: ports, the real server's shims and CPU flags, the word-level tokenizer
sys.path[:0] = [str(ROOT / "tests"), str(ROOT / "tests" / "data")]

from ports import HeldPort  # noqa: E402
from real_sglang.servers import (  # noqa: E402
    KERNEL_PATH_ENV,
    SERVER_ENV,
    SERVER_FLAGS,
    SGLANG_PYTHON,
    SHIMS_DIR,
    available,
)

# SGLang's CPU engine flags the servers get through SGLANG_EXTRA_ARGS: the real-server tests'
# flags less those `serve` already passes (memory fraction, routes, tokenizer)
PASSED_BY_SERVE = {
    "--mem-fraction-static",
    "--enable-return-routed-experts",
    "--skip-tokenizer-init",
}
WORDS = ["what", "is", "plus", "?"]  # the prompts' words, beside the ten digits
TINY_PRESETS = {  # family: (the trainer's tiny preset, the HF architecture SGLang loads)
    "qwen3_moe": ("tiny", "Qwen3MoeForCausalLM"),
    "glm4_moe": ("tiny-glm", "Glm4MoeForCausalLM"),
}
TINY_OVERRIDES = {  # GLM: one dense layer, so that each of two pipeline stages holds experts, as
    # every stage of the launchers' layouts does (a stage without experts cannot save on the CPU
    # backend: megatron's native-Adam state_dict asserts one step count over an empty state)
    "glm4_moe": {"first_k_dense_replace": 1},
}
LAUNCH_KNOBS = frozenset(  # the launchers' variables (common.sh, nodes.sh), set here or unset
    [
        "NODE_RANK",
        "MASTER_ADDR",
        "MASTER_PORT",
        "ROLLOUT_HOSTS",
        "NODE_HOSTS",
        "LAUNCH_ID",
        "NUM_NODES",
        "TRAIN_NODES",
        "RUN_NAME",
        "DRY_RUN",
        "RECIPE",
        "ARM",
        "EVAL_DATA",
        "ASYNC",
        "PARTIAL",
        "CARRY_OVER",
        "CARRY_OVER_ROUND_TOKENS",
        "MASK_STALE",
        "KL_COEF",
        "OPTIMIZER_CPU_OFFLOAD",
        "ASYNC_SAVE",
        "MEM_FRACTION",
        "SERVER_WAIT_S",
    ]
)
NODE_ADDRESSES = ("127.0.0.2", "127.0.0.3")  # one loopback address per node that serves
MEMORY_SAVER_STAND_IN = ROOT / "tests" / "real_sglang" / "memory_saver"
GAP_LIMIT = 0.02
"""Largest mean |train - rollout| log-prob allowed: bf16 on both sides reads ~1e-3; a server one
update behind at ``--lr 1e-2`` reads ~0.1 or more."""
VERSION_LINE = re.compile(r"Weight version changed\. old_version='[^']*' new_version='(\d+)'")


class RehearsalFailed(RuntimeError):
    """A step of the rehearsal failed; the message names it and the log to read."""


@dataclasses.dataclass(frozen=True)
class Launcher:
    """A launcher script and the rehearsal's shape of it.

    ``train_nodes`` training "nodes" of one rank each, ``serve_nodes`` serving nodes (one SGLang
    server each), ``parallel`` the trainer's layout over the ``train_nodes`` ranks.
    """

    script: str
    family: str
    train_nodes: int
    serve_nodes: int
    parallel: str
    colocated: bool = False
    env: tuple[tuple[str, str], ...] = ()

    @property
    def nodes(self) -> int:
        return self.train_nodes + self.serve_nodes

    def server_log(self, run_dir: Path, rank: int) -> Path:
        """Where node ``rank``'s server logs (common.sh's --log-dir; nodes.sh's start_server)."""
        if self.colocated:
            return run_dir / f"sglang-node{rank}.log"
        return run_dir / "logs" / f"node{rank}" / "sglang_0.log"

    def serving_ranks(self) -> range:
        return range(0 if self.colocated else self.train_nodes, self.nodes)


# the Qwen3 launchers' layout over two ranks
EP2 = "--tensor-model-parallel-size 1 --expert-model-parallel-size 2"
LAUNCHERS = {
    "30b": Launcher(
        script="examples/qwen3_moe/run_qwen3_30b_a3b.sh",
        family="qwen3_moe",
        train_nodes=2,
        serve_nodes=2,
        parallel=EP2,
    ),
    "30b-colocated": Launcher(
        script="examples/qwen3_moe/run_qwen3_30b_a3b_colocated.sh",
        family="qwen3_moe",
        train_nodes=2,
        serve_nodes=0,
        parallel=EP2,
        colocated=True,
        env=(("NUM_NODES", "2"), ("MEM_FRACTION", "0.05"), ("SERVER_WAIT_S", "300")),
    ),
    "glm-4.5": Launcher(
        script="examples/glm4_moe/run_glm_4_5.sh",
        family="glm4_moe",
        train_nodes=4,  # the model file's smaller layout (its Adam state in host memory)
        serve_nodes=1,  # 4 ranks and a server on two cores; the 30B rehearsal has two servers
        parallel=(
            "--tensor-model-parallel-size 1 --pipeline-model-parallel-size 2 "
            "--expert-model-parallel-size 2"
        ),
        # the model file offloads the Adam state at 4 nodes; a CPU rank has nothing to offload
        env=(("TRAIN_NODES", "4"), ("OPTIMIZER_OFFLOAD_FRACTION", "0")),
    ),
}


def _word_tokenizer(folder: Path) -> int:
    """A word-level HF tokenizer (digits, four words, chat roles) in ``folder``; its size."""
    from tiny_hf_tokenizer import SPECIALS, save_tiny_tokenizer

    words = [str(digit) for digit in range(10)] + WORDS
    save_tiny_tokenizer(folder, words=words)
    return len(SPECIALS) + len(words)


def write_assets(folder: Path, family: str, seed: int = 0) -> tuple[Path, Path]:
    """A tiny random checkpoint of ``family`` with a tokenizer, and a DAPO-layout prompt file of
    one-digit sums; ``(checkpoint folder, prompt file)``."""
    import torch
    from transformers import AutoModelForCausalLM

    from megatron_rl.model import preset_config

    if family not in TINY_PRESETS:
        raise ValueError(f"write_assets: family {family!r}; known: {sorted(TINY_PRESETS)}")
    checkpoint = folder / "hf"
    checkpoint.mkdir(parents=True, exist_ok=True)
    vocab = _word_tokenizer(checkpoint)
    preset, architecture = TINY_PRESETS[family]
    config = preset_config(
        preset,
        vocab_size=-(-vocab // 8) * 8,
        eos_token_id=1,
        pad_token_id=0,
        **TINY_OVERRIDES.get(family, {}),
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = AutoModelForCausalLM.from_config(config).eval()
        with torch.no_grad():  # HF's zero routers would tie every expert
            for name, module in model.named_modules():
                if name.endswith("mlp.gate") and hasattr(module, "weight"):
                    module.weight.normal_(0.0, 0.5)
    model.save_pretrained(checkpoint)
    saved = json.loads((checkpoint / "config.json").read_text())
    saved["architectures"] = [architecture]  # SGLang picks its model class by it
    (checkpoint / "config.json").write_text(json.dumps(saved, indent=2))
    draw = random.Random(seed)
    prompts = folder / "prompts.jsonl"
    with prompts.open("w") as out:
        for _ in range(64):
            a, b = draw.randrange(3), draw.randrange(3)  # a random policy is right at times
            row = {
                "prompt": [{"role": "user", "content": f"what is {a} plus {b} ?"}],
                "reward_model": {"ground_truth": str(a + b)},
            }
            out.write(json.dumps(row) + "\n")
    return checkpoint, prompts


def _free_port_on(hosts: tuple[str, ...]) -> tuple[int, list[HeldPort]]:
    """A port held on every one of ``hosts`` (the serving nodes listen on the same port)."""
    for _ in range(50):
        first = HeldPort.below_ephemeral(hosts[0])
        held = [first]
        try:
            held += [HeldPort(first.port, host) for host in hosts[1:]]
            return first.port, held
        except OSError:
            for port in held:
                port.close()
    raise RehearsalFailed(f"no port free on all of {hosts}")


@dataclasses.dataclass
class Node:
    rank: int
    log: Path
    process: subprocess.Popen | None = None

    def start(self, script: Path, env: dict) -> None:
        out = self.log.open("ab")
        self.process = subprocess.Popen(
            ["bash", str(script)],
            cwd=ROOT,
            env=env,
            stdout=out,
            stderr=subprocess.STDOUT,
            start_new_session=True,  # a process group per node, as a node's own shell
        )
        out.close()

    def tail(self, chars: int = 3000) -> str:
        return self.log.read_text(errors="replace")[-chars:] if self.log.exists() else ""


class Rehearsal:
    """One launcher's rehearsal in ``out`` (see the module docstring)."""

    def __init__(
        self,
        launcher: Launcher,
        out: Path,
        *,
        steps: int = 6,
        save_interval: int = 3,
        timeout_s: float = 900.0,
    ) -> None:
        if not available():
            raise RehearsalFailed("the real SGLang venv is missing: run `make sglang-env`")
        if not 3 <= save_interval < steps:
            raise ValueError(f"save_interval={save_interval}: must be >= 3 and < steps={steps}")
        self.launcher = launcher
        self.out = out.resolve()
        self.steps = steps
        self.save_interval = save_interval
        self.timeout_s = timeout_s
        self.run_dir = self.out / "run"
        self.nodes: list[Node] = []
        self.held: list[HeldPort] = []
        self.env: dict[str, str] = {}

    # ------------------------------------------------------------------ set-up
    def prepare(self) -> None:
        self.out.mkdir(parents=True, exist_ok=True)
        checkpoint, prompts = write_assets(self.out / "assets", self.launcher.family)
        launcher = self.launcher
        serving = NODE_ADDRESSES[: len(launcher.serving_ranks())]
        master_host = serving[0] if launcher.colocated else "127.0.0.1"
        master = HeldPort.below_ephemeral(master_host)
        sglang_port, held = _free_port_on(serving)
        self.held = [master, *held]
        flags, skip = [], False
        for flag in SERVER_FLAGS:
            if skip:
                skip = False
            elif flag in PASSED_BY_SERVE:
                skip = flag == "--mem-fraction-static"  # it takes a value
            else:
                flags.append(flag)
        train_extra = [
            "--device", "cpu", "--torch-threads", "1", "--no-progress",
            "--train-iters", str(self.steps), "--save-interval", str(self.save_interval),
            "--rollout-batch-size", "2", "--n-samples-per-prompt", "4",
            "--global-batch-size", "4", "--micro-batch-size", "2",
            "--max-prompt-length", "16", "--max-response-length", "6",
            # steps large enough that a server left on older weights shows in the train/rollout
            # log-prob gap (at the launcher's 1e-6 the weights barely move in six steps)
            "--lr", "1e-2",
            # several ranks and servers share two cores: a server's /server_info answer can
            # outlast the 30-s default while the others start
            "--sglang-health-timeout", "120",
        ]  # fmt: skip
        base = {  # a node's environment: nothing of a launch this process may have been given
            k: v
            for k, v in os.environ.items()
            if not k.startswith("SLURM_") and k not in LAUNCH_KNOBS
        }
        self.env = {
            **base,
            "PATH": f"{Path(sys.executable).parent}:{base.get('PATH', '')}",
            "HF_CKPT": str(checkpoint),
            "PROMPTS": str(prompts),
            "MASTER_ADDR": master_host,
            "MASTER_PORT": str(master.port),
            "SGLANG_PORT": str(sglang_port),
            "RUN_DIR": str(self.run_dir),
            "LAUNCH_ID": f"rehearsal-{os.getpid()}",
            "LOSS": "grpo",
            "REPLAY": "r3",
            "STALENESS": "2",
            "NODE_WAIT_S": "300",
            "HEARTBEAT_INTERVAL": "2",
            "HEARTBEAT_TIMEOUT": "300",
            "WANDB_MODE": "offline",
            "GPUS_PER_NODE": "1",
            "TRAIN_PARALLEL": self.launcher.parallel,
            "SERVER_TP": "1",
            "SERVER_EP": "1",
            "SERVER_MEM_FRACTION": "0.05",
            "SGLANG_PYTHON": str(self.sglang_python()),
            "SGLANG_EXTRA_ARGS": shlex.join(flags),
            "TRAIN_EXTRA_ARGS": shlex.join(train_extra),
            **dict(launcher.env),
        }
        if launcher.colocated:
            self.env["NODE_HOSTS"] = " ".join(serving)
        else:
            self.env["ROLLOUT_HOSTS"] = " ".join(serving)

    def sglang_python(self) -> Path:
        """The servers' interpreter: ``.venv-sglang``'s python with SGLang's CPU engine set up
        (the real-server tests' environment and shims; for colocated servers also the memory
        saver's CPU stand-in), so that the trainers of a colocated node keep a clean one."""
        paths = [str(SHIMS_DIR)]
        if self.launcher.colocated:
            paths.append(str(MEMORY_SAVER_STAND_IN))
        lines = ["#!/bin/sh", "# the rehearsal's SGLang interpreter (tools/rehearse_launchers.py)"]
        lines += [f"unset {name}" for name in KERNEL_PATH_ENV]
        lines += [f"export {k}={shlex.quote(v)}" for k, v in SERVER_ENV.items()]
        lines.append(f"export PYTHONPATH={shlex.quote(os.pathsep.join(paths))}")
        lines.append(f'exec {shlex.quote(str(SGLANG_PYTHON))} "$@"')
        wrapper = self.out / "assets" / "sglang-python"
        wrapper.write_text("\n".join(lines) + "\n")
        wrapper.chmod(0o755)
        return wrapper

    def node_env(self, rank: int) -> dict[str, str]:
        env = {**self.env, "NODE_RANK": str(rank)}
        serving = self.launcher.serving_ranks()
        if rank in serving:  # its server listens on this "node's" own address
            env["SERVER_BIND_HOST"] = NODE_ADDRESSES[serving.index(rank)]
        return env

    # ------------------------------------------------------------------ phases
    def start_all(self, phase: str) -> None:
        script = ROOT / self.launcher.script
        self.nodes = [
            Node(r, self.out / f"{phase}-node{r}.log") for r in range(self.launcher.nodes)
        ]
        for node in reversed(self.nodes):  # serving nodes first, as a cluster's may well be
            node.start(script, self.node_env(node.rank))

    def wait_for(self, what: str, done, *, limit_s: float | None = None) -> None:
        deadline = time.monotonic() + (limit_s or self.timeout_s)
        while not done():
            for node in self.nodes:
                code = node.process.poll()
                if code is not None and code != 0:
                    raise RehearsalFailed(
                        f"{what}: node {node.rank} exited {code} first; {node.log}:\n{node.tail()}"
                    )
            if time.monotonic() > deadline:
                raise RehearsalFailed(f"{what}: not within {limit_s or self.timeout_s:g} s")
            time.sleep(1.0)

    def saved_iteration(self) -> int:
        tracker = self.run_dir / "checkpoints" / "latest"  # the committed step
        with contextlib.suppress(OSError, ValueError):
            return int(tracker.read_text().strip())
        return 0

    def metric_rows(self) -> list[dict]:
        path = self.run_dir / "metrics.jsonl"
        if not path.exists():
            return []
        return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]

    def wait_exits(self, what: str, limit_s: float = 180.0) -> dict[int, int]:
        deadline = time.monotonic() + limit_s
        while any(n.process.poll() is None for n in self.nodes):
            if time.monotonic() > deadline:
                alive = [n.rank for n in self.nodes if n.process.poll() is None]
                raise RehearsalFailed(f"{what}: nodes {alive} still running after {limit_s:g} s")
            time.sleep(1.0)
        return {n.rank: n.process.returncode for n in self.nodes}

    def release_ports(self) -> None:
        for port in self.held:
            port.close()
        self.held = []

    def leftovers(self) -> list[str]:
        """Processes started under the rehearsal: their command line names its folder, or their
        environment holds its RUN_DIR (a server's helpers, e.g. multiprocessing's resource
        tracker, name neither in their command line)."""
        mine, marker, found = str(self.out), f"RUN_DIR={self.run_dir}".encode(), []
        for proc in Path("/proc").iterdir():
            if not proc.name.isdigit() or int(proc.name) == os.getpid():
                continue
            with contextlib.suppress(OSError):
                argv = (proc / "cmdline").read_bytes().replace(b"\0", b" ").decode(errors="replace")
                environ = (proc / "environ").read_bytes().split(b"\0")
                if mine in argv or marker in environ:
                    found.append(f"{proc.name}: {argv[:200]}")
        return found

    def kill_everything(self) -> None:
        for node in self.nodes:
            if node.process is not None and node.process.poll() is None:
                with contextlib.suppress(ProcessLookupError):
                    os.killpg(node.process.pid, signal.SIGKILL)
        for line in self.leftovers():
            with contextlib.suppress(ProcessLookupError, ValueError):
                os.kill(int(line.split(":")[0]), signal.SIGKILL)

    def rehearse(self) -> dict:
        """Run every phase; a report of what was seen (RehearsalFailed on the first failure)."""
        report: dict = {"launcher": self.launcher.script}
        t0 = time.monotonic()
        try:
            self.prepare()
            # phase 1: start, train past the first save, SIGTERM to node 0
            self.start_all("first")
            self.wait_for(
                f"the first run saving step {self.save_interval}",
                lambda: self.saved_iteration() >= self.save_interval,
            )
            self.release_ports()
            report["first_run_s"] = round(time.monotonic() - t0, 1)
            killed_at = len(self.metric_rows())
            os.kill(self.nodes[0].process.pid, signal.SIGTERM)
            stop_t = time.monotonic()
            codes = self.wait_exits("after SIGTERM to node 0")
            report["stop_s"] = round(time.monotonic() - stop_t, 1)
            report["first_exit_codes"] = codes
            if codes[0] != 143:
                raise RehearsalFailed(f"node 0 exited {codes[0]} on SIGTERM, not 143")
            for rank in range(self.launcher.train_nodes, len(self.nodes)):
                if codes[rank] != 0:
                    raise RehearsalFailed(
                        f"serving node {rank} exited {codes[rank]} when training stopped "
                        f"(0: the heartbeat's removal); {self.nodes[rank].log}:\n"
                        f"{self.nodes[rank].tail()}"
                    )
            if left := self.leftovers():
                raise RehearsalFailed("after the SIGTERM, left running:\n" + "\n".join(left))
            saved = self.saved_iteration()
            report["first_run"] = {"steps_logged": killed_at, "saved_iteration": saved}
            # phase 2: the same commands again resume and finish
            t1 = time.monotonic()
            self.start_all("resume")
            codes = self.wait_exits("the resumed run", limit_s=self.timeout_s)
            report["resume_s"] = round(time.monotonic() - t1, 1)
            report["resume_exit_codes"] = codes
            for rank, code in codes.items():
                if code != 0:
                    raise RehearsalFailed(
                        f"resumed run: node {rank} exited {code}; {self.nodes[rank].log}:\n"
                        f"{self.nodes[rank].tail()}"
                    )
            if left := self.leftovers():
                raise RehearsalFailed("after the resumed run, left running:\n" + "\n".join(left))
            report.update(self.check_metrics(saved))
        finally:
            self.release_ports()
            self.kill_everything()
        report["total_s"] = round(time.monotonic() - t0, 1)
        return report

    def check_metrics(self, saved: int) -> dict:
        """Every step logged, once after the resume; every server got every weight version
        over the weight group; rollouts carried R3 routes and matched the trainer's weights."""
        rows = [r for r in self.metric_rows() if "step" in r]
        resumed = [r["step"] for r in rows if r["step"] > saved]
        if resumed != list(range(saved + 1, self.steps + 1)):
            raise RehearsalFailed(f"steps logged after the resume from step {saved}: {resumed}")
        last = {r["step"]: r for r in rows}
        missing = [s for s in range(1, self.steps + 1) if s not in last]
        if missing:
            raise RehearsalFailed(f"no metrics for steps {missing}")
        rows = [last[s] for s in range(1, self.steps + 1)]
        for row in rows:
            if not row.get("weight_sync/mb", 0) > 0:
                raise RehearsalFailed(f"step {row['step']}: no weights synced ({row})")
            if not row.get("routing/bytes_per_rank", 0) > 0:
                raise RehearsalFailed(f"step {row['step']}: no R3 routes from the servers")
        gaps = [row["mismatch/train_rollout_logprob_abs_gap"] for row in rows]
        if max(gaps) > GAP_LIMIT:
            raise RehearsalFailed(
                f"train/rollout log-prob gap {max(gaps):.3g} > {GAP_LIMIT}: a server generates "
                f"with weights other than the trainer's (gaps by step: {gaps})"
            )
        moved = [row["step"] for row in rows if row.get("grad_norm", 0) > 0]
        if not moved:
            raise RehearsalFailed("no step had a learning signal: the sync was never tested")
        versions, releases = {}, {}
        for rank in self.launcher.serving_ranks():
            log = self.launcher.server_log(self.run_dir, rank)
            text = log.read_text(errors="replace") if log.exists() else ""
            seen = {int(v) for v in VERSION_LINE.findall(text)}
            if not set(range(1, self.steps + 1)) <= seen:
                raise RehearsalFailed(
                    f"serving node {rank} ({log}) loaded weight versions {sorted(seen)}, "
                    f"not every one of 1..{self.steps}"
                )
            versions[rank] = sorted(seen)
            if self.launcher.colocated:  # the trainer released and resumed its server
                pauses = text.count("torch_memory_saver stand-in: pause")
                resumes = text.count("torch_memory_saver stand-in: resume")
                if pauses < self.steps or resumes < self.steps:
                    raise RehearsalFailed(
                        f"colocated node {rank}'s server ({log}) was released {pauses} and "
                        f"resumed {resumes} times in {self.steps} steps"
                    )
                releases[rank] = (pauses, resumes)
        return {
            "steps": sorted(last),
            "steps_with_updates": moved,
            "max_logprob_gap": max(gaps),
            "server_weight_versions": versions,
            "server_pauses_resumes": releases,
            "reward_mean": [row.get("reward/mean") for row in rows],
        }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--launcher", choices=sorted(LAUNCHERS), default="30b")
    parser.add_argument("--out", type=Path, default=ROOT / "runs" / "rehearsal")
    parser.add_argument("--steps", type=int, default=6)
    parser.add_argument("--save-interval", type=int, default=3)
    parser.add_argument("--timeout", type=float, default=900.0)
    args = parser.parse_args(argv)
    out = args.out / args.launcher
    rehearsal = Rehearsal(
        LAUNCHERS[args.launcher],
        out,
        steps=args.steps,
        save_interval=args.save_interval,
        timeout_s=args.timeout,
    )
    try:
        report = rehearsal.rehearse()
    except RehearsalFailed as error:
        print(f"rehearsal of {args.launcher} FAILED: {error}", file=sys.stderr)
        return 1
    print(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
