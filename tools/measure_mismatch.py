"""Measure an engine's train/inference mismatch against the fp32 trainer on the study's task.

    python tools/measure_mismatch.py --model runs/warm/seed1 --seed 1 --start-sglang \
        --router-noise 0 0.005 0.01 0.02 0.05 --out runs/mismatch.json

Each engine arm samples the fixed held-out addition-trace prompts (24 x ``--samples``,
temperature 1, ``--max-new-tokens``, seeded) with per-token log-probs ``mu`` and routed experts:
``sglang`` (the real server at ``--sglang-url``, or one this tool starts with ``--start-sglang``
from ``.venv-sglang/``, bf16) and ``inprocess`` (`InProcessEngine`, ``--dtype``, one arm per
``--router-noise`` sigma). The trainer's model (megatron-core in fp32, built and loaded as
`megatron_rl.train.policy.build_policy` does, gloo world size 1) scores the same prompt+response
tokens (``pi``) and records its own top-k per token and MoE layer. Per arm, with
``d = log pi - log mu`` clamped to +-20 as ``mismatch/train_rollout_*`` is:

    agreement = share of (token, layer) whose top-k *sets* agree, over every routed position
                (prompt and response, the last token excluded: no engine routed it), per layer;
    gap       = mean |d|,  k3 = mean(exp(-d) - 1 + d), overall and per response-position bucket.

With a ``sglang`` arm, the in-process sigma closest to it (distance: ``|d agreement| /
--agreement-band + |log(gap ratio)| / log(--gap-factor)``) is named and the band checked.
Output: a markdown table on stdout; ``--out X.json`` also writes ``X.json`` and ``X.md``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import socket
import sys
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parents[1]
if str(ROOT) not in sys.path:
    sys.path.insert(0, str(ROOT))

BUCKETS = ((0, 16), (16, 32), (32, 64), (64, 128))
# test-only shims the CPU server needs on its PYTHONPATH (tests/real_sglang/README.md)
SGLANG_SHIMS = ROOT / "tests" / "real_sglang" / "shims"
SGLANG_CPU_FLAGS = (
    "--device", "cpu", "--attention-backend", "torch_native", "--sampling-backend", "pytorch",
    "--disable-cuda-graph", "--disable-overlap-schedule", "--skip-server-warmup",
    "--grammar-backend", "none", "--max-total-tokens", "8192",
    "--sleep-on-idle",  # an idle scheduler otherwise spins one core (the trainer's)
)  # fmt: skip


def route_agreement(engine_TLK: torch.Tensor, trainer_TLK: torch.Tensor) -> torch.Tensor:
    """bool ``[T, L]``: whether the two top-k expert *sets* of each (token, layer) are equal."""
    if engine_TLK.shape != trainer_TLK.shape:
        raise RuntimeError(f"routes {tuple(engine_TLK.shape)} vs {tuple(trainer_TLK.shape)}")
    return (engine_TLK.sort(dim=-1).values == trainer_TLK.sort(dim=-1).values).all(dim=-1)


def gap_stats(trainer_R: torch.Tensor, engine_R: torch.Tensor) -> dict[str, float]:
    """``{"gap": mean |d|, "k3": mean(e^-d - 1 + d), "q99", "q999": the 99th / 99.9th
    percentile of |d| (linear interpolation), "tokens"}``, ``d = pi - mu`` (log-probs, clamped
    to +-20 as the trainer's ``mismatch/train_rollout_*`` metrics are)."""
    d = (trainer_R.double() - engine_R.double()).clamp(-20, 20)
    if d.numel() == 0:
        nan = float("nan")
        return {"gap": nan, "k3": nan, "q99": nan, "q999": nan, "tokens": 0}
    k3 = torch.expm1(-d) + d
    q99, q999 = torch.quantile(d.abs(), torch.tensor([0.99, 0.999], dtype=torch.float64))
    return {
        "gap": float(d.abs().mean()),
        "k3": float(k3.mean()),
        "q99": float(q99),
        "q999": float(q999),
        "tokens": int(d.numel()),
    }


def bucket_stats(trainer_R, engine_R, positions_R, buckets=BUCKETS) -> dict[str, dict]:
    """`gap_stats` of the response tokens whose position (0-based, in the response) lies in
    each ``[lo, hi)`` of ``buckets``, keyed ``"lo-hi"`` (inclusive: ``"0-15"``)."""
    out = {}
    for lo, hi in buckets:
        keep = (positions_R >= lo) & (positions_R < hi)
        out[f"{lo}-{hi - 1}"] = gap_stats(trainer_R[keep], engine_R[keep])
    return out


def summarize(agree_TL: torch.Tensor, trainer_R, engine_R, positions_R) -> dict:
    """One arm's metrics from its concatenated comparisons (see the module docstring)."""
    return {
        "agreement": float(agree_TL.float().mean()),
        "agreement_per_layer": [float(a) for a in agree_TL.float().mean(dim=0)],
        "token_layers": int(agree_TL.numel()),
        **gap_stats(trainer_R, engine_R),
        "buckets": bucket_stats(trainer_R, engine_R, positions_R),
    }


def closest_arm(real: dict, arms: dict[str, dict], agreement_band: float, gap_factor: float):
    """``(name, met)``: the arm of ``arms`` nearest ``real`` (``|d agreement| / band +
    |log(gap / real gap)| / log(factor)``) and whether it lies within both bands."""

    def distance(arm: dict) -> float:
        ratio = abs(math.log(max(arm["gap"], 1e-12) / max(real["gap"], 1e-12)))
        return abs(arm["agreement"] - real["agreement"]) / agreement_band + ratio / math.log(
            gap_factor
        )

    name = min(arms, key=lambda k: distance(arms[k]))
    arm = arms[name]
    met = abs(arm["agreement"] - real["agreement"]) <= agreement_band and (
        1 / gap_factor <= arm["gap"] / real["gap"] <= gap_factor
    )
    return name, bool(met)


class TrainerScorer:
    """The fp32 megatron model as the trainer builds and loads it, scoring samples and
    recording its own top-k per token and MoE layer (forward hooks on each ``TopKRouter``)."""

    def __init__(self, model_dir: str, seed: int) -> None:
        from megatron.core.transformer.moe.router import TopKRouter

        from megatron_rl.backend import init_distributed
        from megatron_rl.model import build_model, load_hf_config
        from megatron_rl.model.conversion import load_checkpoint
        from megatron_rl.model.options import ModelOptions
        from megatron_rl.parallel import ParallelConfig

        init_distributed(ParallelConfig(seed=seed), device="cpu")
        hf_config = load_hf_config(model_dir)
        hf_config._attn_implementation = "eager"
        self.model = build_model(hf_config, ModelOptions()).eval()
        load_checkpoint(self.model, model_dir, hf_config)
        self.topk = int(hf_config.num_experts_per_tok)
        self._maps: list[torch.Tensor] = []
        routers = [m for m in self.model.modules() if isinstance(m, TopKRouter)]
        for router in routers:
            router.register_forward_hook(lambda _m, _a, out: self._maps.append(out[1]))

    @torch.no_grad()
    def score(self, sequences: list[list[int]], batch: int = 32):
        """Per sequence ``(logprobs [S - 1] float32, routes [S, L, K] int64)``; right-padded
        batches (causal: padding never changes an earlier position)."""
        from megatron_rl.train.logprobs import forward_logits, token_logprobs

        out = []
        for start in range(0, len(sequences), batch):
            chunk = sequences[start : start + batch]
            width = max(map(len, chunk))
            tokens_BS = torch.zeros(len(chunk), width, dtype=torch.long)
            for b, seq in enumerate(chunk):
                tokens_BS[b, : len(seq)] = torch.tensor(seq)
            self._maps.clear()
            logprobs_BT = token_logprobs(forward_logits(self.model, tokens_BS), tokens_BS)
            # megatron's rows are [s, b]; a routing map row holds exactly K True experts
            picks = [m.to(torch.int8).topk(self.topk, dim=-1).indices for m in self._maps]
            routes_SBLK = torch.stack(picks, dim=1).reshape(width, len(chunk), len(picks), -1)
            for b, seq in enumerate(chunk):
                out.append((logprobs_BT[b, : len(seq) - 1], routes_SBLK[: len(seq), b]))
        return out


def sequences_of(samples) -> list[list[int]]:
    return [s.prompt_ids_P.tolist() + s.response_ids_R.tolist() for s in samples]


def compare_arm(samples, codec, scorer: TrainerScorer, scores=None) -> dict:
    """Score an arm's samples with the trainer (or take its ``scores`` of them) and
    `summarize` the comparison."""
    scores = scorer.score(sequences_of(samples)) if scores is None else scores
    agree, pi, mu, pos = [], [], [], []
    for sample, (logprobs_T, routes_SLK) in zip(samples, scores, strict=True):
        if sample.routes is None:
            raise RuntimeError("the engine returned no routed experts")
        num_response = sample.response_ids_R.numel()
        engine_TLK = codec.decode(sample.routes)  # [S - 1, L, K]
        agree.append(route_agreement(engine_TLK, routes_SLK[: engine_TLK.shape[0]]))
        pi.append(logprobs_T[-num_response:])
        mu.append(sample.logprobs_R)
        pos.append(torch.arange(num_response))
    return summarize(torch.cat(agree), torch.cat(pi), torch.cat(mu), torch.cat(pos))


def compare_teacher_forced(samples, scores, engine) -> dict:
    """``engine`` (an `InProcessEngine`) scores another engine's ``samples`` teacher-forced
    (`InProcessEngine.score`: the same tokens, no sampling of its own); its log-probs of the
    response tokens against the trainer's ``scores`` of the same samples, as `summarize`
    reports them without agreement (scoring returns no routes)."""
    pi, mu, pos = [], [], []
    for sample, (logprobs_T, _) in zip(samples, scores, strict=True):
        num_response = sample.response_ids_R.numel()
        engine_T = engine.score(sample.prompt_ids_P.tolist() + sample.response_ids_R.tolist())
        pi.append(logprobs_T[-num_response:])
        mu.append(engine_T[-num_response:])
        pos.append(torch.arange(num_response))
    pi_R, mu_R, pos_R = torch.cat(pi), torch.cat(mu), torch.cat(pos)
    return {
        "agreement": float("nan"),
        "agreement_per_layer": [],
        "token_layers": 0,
        **gap_stats(pi_R, mu_R),
        "buckets": bucket_stats(pi_R, mu_R, pos_R),
    }


ACROSS = ("gap", "k3", "q99", "q999", "agreement")


def across_draws(draws: list[dict]) -> dict[str, dict]:
    """Per arm and metric of `ACROSS`: mean, min and max over the draws (each draw a dict of
    arms), and the tokens of every draw together."""
    out = {}
    for name in draws[0]:
        values = {m: [d[name][m] for d in draws] for m in ACROSS}
        out[name] = {
            m: {"mean": sum(v) / len(v), "min": min(v), "max": max(v)} for m, v in values.items()
        }
        out[name]["tokens"] = sum(d[name]["tokens"] for d in draws)
    return out


def _port_below_ephemeral(low: int = 20000) -> int:
    """A port between ``low`` and the start of the kernel's ephemeral range, free now."""
    import contextlib
    import random

    high = 32768
    with contextlib.suppress(OSError, ValueError):
        high = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    draw = random.SystemRandom()
    for _ in range(100):
        port = draw.randrange(low, max(high, low + 1))
        with socket.socket() as sock:
            try:
                sock.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port in [{low}, {high})")


def start_sglang(model_dir: str, log_path: str):
    """The real SGLang server (``.venv-sglang``, bf16, CPU) on ``model_dir``; ``(process, url)``
    once ``/health`` answers."""
    from megatron_rl.rollout.launch import (
        SGLangServerConfig,
        server_command,
        start_process,
        wait_healthy,
    )

    env = {"SGLANG_USE_CPU_ENGINE": "1", "PYTHONPATH": str(SGLANG_SHIMS), "HF_HUB_OFFLINE": "1"}
    python = str(ROOT / ".venv-sglang" / "bin" / "python")
    # SGLang binds its port itself and cannot take port 0: a port drawn below the kernel's
    # ephemeral range (where no bind(0) or outgoing connection lands), and a new draw if the
    # server exits at start (another process took the port first), 3 starts at most
    for attempt in range(3):
        config = SGLangServerConfig(
            model_path=model_dir, port=_port_below_ephemeral(), dtype="bfloat16",
            mem_fraction_static=0.05, return_routed_experts=True, extra_args=SGLANG_CPU_FLAGS,
        )  # fmt: skip
        process = start_process(server_command(config, python), log_path=log_path, env=env)
        try:
            wait_healthy(config.url, timeout_s=600, process=process)
            break
        except RuntimeError:
            if process.poll() is None or attempt == 2:
                raise
    return process, config.url


def sglang_engine(url: str, model_dir: str):
    from megatron_rl.model import load_hf_config
    from megatron_rl.rollout.http_pool import HttpPoolConfig
    from megatron_rl.rollout.sglang_client import SGLangEngine, SGLangEngineConfig

    http = HttpPoolConfig(urls=(url,))  # no read timeout: on a loaded CPU a queued sample waits
    hf_config = load_hf_config(model_dir)
    return SGLangEngine(SGLangEngineConfig.from_hf_config(hf_config, http=http, max_in_flight=256))


def markdown(report: dict) -> str:
    """The arms as one markdown table, then the match line when there is one."""
    buckets = [f"{lo}-{hi - 1}" for lo, hi in BUCKETS]
    head = ["arm", "agreement", "per layer", "gap", "k3", *[f"gap {b}" for b in buckets], "tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, arm in report["arms"].items():
        layers = " / ".join(f"{a:.3f}" for a in arm["agreement_per_layer"])
        cells = [name, f"{arm['agreement']:.4f}", layers, f"{arm['gap']:.4f}", f"{arm['k3']:.5f}"]
        cells += [f"{arm['buckets'][b]['gap']:.4f}" for b in buckets]
        lines.append("| " + " | ".join([*cells, str(arm["tokens"])]) + " |")
    if "match" in report:
        m = report["match"]
        lines.append(
            f"\nClosest in-process arm to `sglang`: `{m['arm']}`; band (agreement within "
            f"+-{m['agreement_band']}, gap within a factor {m['gap_factor']}) "
            f"{'met' if m['met'] else 'NOT met'}."
        )
    return "\n".join(lines) + "\n"


def markdown_across(report: dict) -> str:
    """The arms over the draws as one table: mean [min, max] of each metric of `ACROSS`."""

    def cell(stat: dict, digits: int) -> str:
        if math.isnan(stat["mean"]):
            return "n/a"
        return f"{stat['mean']:.{digits}f} [{stat['min']:.{digits}f}, {stat['max']:.{digits}f}]"

    head = ["arm", "gap", "k3", "|d| q99", "|d| q99.9", "agreement", "tokens"]
    lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
    for name, arm in report["across_draws"].items():
        cells = [name, cell(arm["gap"], 4), cell(arm["k3"], 5), cell(arm["q99"], 3)]
        cells += [cell(arm["q999"], 3), cell(arm["agreement"], 4), str(arm["tokens"])]
        lines.append("| " + " | ".join(cells) + " |")
    note = (
        f"\nMean [min, max] over {len(report['draws'])} draws (sampling seeds "
        f"{report['seed']}..{report['seed'] + len(report['draws']) - 1}); d = log pi - log mu on "
        "the response tokens."
    )
    return "\n".join(lines) + "\n" + note + "\n"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.split("\n", 1)[0])
    p.add_argument("--model", required=True, help="HF checkpoint folder of the study's model")
    p.add_argument("--seed", type=int, default=1, help="sampling seed (and megatron's RNG)")
    p.add_argument("--samples", type=int, default=8, help="samples per held-out prompt")
    p.add_argument("--max-new-tokens", type=int, default=128)
    p.add_argument("--sglang-url", help="a running real SGLang server on --model (bf16)")
    p.add_argument("--start-sglang", action="store_true", help="start one from .venv-sglang")
    p.add_argument("--sglang-log", default="sglang_server.log", help="its log (--start-sglang)")
    p.add_argument("--router-noise", type=float, nargs="*", default=[], help="in-process sigmas")
    p.add_argument("--dtype", default="bfloat16", help="in-process engine dtype")
    p.add_argument("--router-noise-seed", type=int, default=0)
    p.add_argument("--agreement-band", type=float, default=0.01)
    p.add_argument("--gap-factor", type=float, default=1.5)
    p.add_argument(
        "--draws", type=int, default=1, help="sampling draws (seeds SEED, SEED+1, ...), each "
        "compared on its own; the report adds each metric's mean, min and max over them",
    )  # fmt: skip
    p.add_argument(
        "--teacher-force", action="store_true", help="the in-process arms score the sglang "
        "arm's tokens (the same tokens as the real engine: a paired comparison) instead of "
        "sampling their own",
    )  # fmt: skip
    p.add_argument("--out", help="write the report as OUT (json) and OUT's .md beside it")
    return p


def main(argv=None) -> int:
    args = _parser().parse_args(argv)
    if args.sglang_url and args.start_sglang:
        raise ValueError("--sglang-url and --start-sglang: give one of them")
    real = bool(args.sglang_url or args.start_sglang)
    if not (real or args.router_noise):
        raise ValueError("no engine arm: give --sglang-url, --start-sglang or --router-noise")
    if args.teacher_force and not (real and args.router_noise):
        raise ValueError(
            "--teacher-force scores the sglang arm's tokens with the in-process arms: give "
            "--sglang-url or --start-sglang and --router-noise"
        )
    if args.agreement_band <= 0 or args.gap_factor <= 1:
        raise ValueError("--agreement-band must be > 0 and --gap-factor > 1")
    if args.draws < 1:
        raise ValueError(f"--draws {args.draws}: must be >= 1")
    torch.manual_seed(args.seed)
    from megatron_rl.backend import destroy_distributed
    from megatron_rl.data.addition_trace import AdditionTraceConfig, addition_trace_heldout

    prompts = [list(r.prompt_ids) for r in addition_trace_heldout(AdditionTraceConfig())]
    report = {"model": os.path.basename(os.path.normpath(args.model)), "seed": args.seed}
    report.update(prompts=len(prompts), samples=args.samples, arms={})
    scorer = TrainerScorer(args.model, args.seed)
    process, url = (None, args.sglang_url)
    try:
        if args.start_sglang:
            process, url = start_sglang(args.model, args.sglang_log)
        draws = [
            measure_draw(args, prompts, scorer, url, seed=args.seed + k) for k in range(args.draws)
        ]
    finally:
        if process is not None:
            from megatron_rl.rollout.launch import stop_process

            stop_process(process)
        destroy_distributed()
    report["arms"] = draws[0]
    if args.draws > 1:
        report["draws"] = draws
        report["across_draws"] = across_draws(draws)
    inprocess = {k: v for k, v in report["arms"].items() if k.startswith("inprocess")}
    if "sglang bf16" in report["arms"] and inprocess and not args.teacher_force:
        name, met = closest_arm(
            report["arms"]["sglang bf16"], inprocess, args.agreement_band, args.gap_factor
        )
        report["match"] = {
            "arm": name, "met": met,
            "agreement_band": args.agreement_band, "gap_factor": args.gap_factor,
        }  # fmt: skip
    text = markdown(report) if args.draws == 1 else markdown_across(report)
    sys.stdout.write(text)
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2) + "\n")
        Path(args.out).with_suffix(".md").write_text(text)
    return 0


def measure_draw(args, prompts, scorer: TrainerScorer, url: str | None, seed: int) -> dict:
    """One draw's arms: the real engine's samples (``url``) and each in-process sigma's, its
    own samples or, with ``--teacher-force``, its scores of the real engine's samples."""
    from megatron_rl.data.addition_trace_tokenizer import EOS_ID
    from megatron_rl.rollout import InProcessEngine, InProcessEngineConfig, SamplingParams

    params = SamplingParams(
        temperature=1.0, max_new_tokens=args.max_new_tokens, stop_token_ids=(EOS_ID,), seed=seed
    )
    arms, real_samples, real_scores = {}, None, None
    if url is not None:
        with sglang_engine(url, args.model) as engine:
            real_samples = engine.generate(
                prompts, params, n=args.samples, return_routed_experts=True
            )
        real_scores = scorer.score(sequences_of(real_samples))
        arms["sglang bf16"] = compare_arm(real_samples, engine.codec, scorer, real_scores)
    for sigma in args.router_noise:
        config = InProcessEngineConfig(
            dtype=args.dtype, router_noise=sigma, router_noise_seed=args.router_noise_seed
        )
        engine = InProcessEngine.from_pretrained(args.model, config)
        name = f"inprocess {args.dtype} sigma={sigma:g}"
        if args.teacher_force:
            arms[name + " on sglang's tokens"] = compare_teacher_forced(
                real_samples, real_scores, engine
            )
        else:
            samples = engine.generate(prompts, params, n=args.samples, return_routed_experts=True)
            arms[name] = compare_arm(samples, engine.codec, scorer)
    return arms


if __name__ == "__main__":
    sys.exit(main())
