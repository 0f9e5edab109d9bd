"""Loss-kernel report: how each registered loss weights a token or a sequence against its log
importance ratio, as PNG pictures and a text table.

    python tools/loss_report.py --out runs/loss_report

For every loss the curves come from the library itself (``compute_policy_loss`` + autograd) on
one-token sequences, so they show exactly what training uses: the gradient weight
``w = -(d loss / d log pi) / A`` (1 for on-policy REINFORCE, 0 where a clip removes the
gradient) as a function of the log-ratio (token-level losses: ``log r_t``; sequence-level:
``log W``; EPIC and CTPO: the prefix log-ratio at ``t = 1``), for ``A = +1`` and ``A = -1``.
EPIC also gets its calibrated bounds ``l_t^(1/t)``, ``u_t^(1/t)`` against the prefix position ``t``.
"""

from __future__ import annotations

import argparse
import dataclasses
from pathlib import Path

import matplotlib

matplotlib.use("Agg")  # before pyplot: no display on CI machines
import matplotlib.pyplot as plt
import torch
from rich.console import Console
from rich.table import Table

from megatron_rl.losses import available_losses, compute_policy_loss, get_loss_spec
from megatron_rl.losses.epic import EPICConfig, epic_log_bounds

OLD_LOGPROB = -1.0  # behaviour log-prob of the one-token sequences (matters for EPIC only)
LEVEL = {
    "gspo": "sequence (length-normalised)",
    "gspo_token": "sequence ratio, token gradient",
    "vespo": "sequence",
    "topr": "sequence",
    "epic": "prefix",
    "ctpo": "prefix",
}
X_RANGE = {"gspo": 2e-3, "gspo_token": 2e-3}  # half-width of the log-ratio axis; default 3
TABLE_POINTS = (-1.0, -0.2, 0.0, 0.2, 1.0)


def gradient_weights(name: str, log_ratio: torch.Tensor, advantage: float) -> torch.Tensor:
    """Gradient weight ``w = -(d loss / d log pi) / A`` of one-token sequences at each log-ratio."""
    n = log_ratio.numel()
    old = torch.full((n, 1), OLD_LOGPROB, dtype=torch.float64)
    lp = (old + log_ratio[:, None]).requires_grad_()
    out = compute_policy_loss(
        name,
        logprobs=lp,
        old_logprobs=old,
        advantages=torch.full((n,), advantage, dtype=torch.float64),
        loss_mask=torch.ones(n, 1, dtype=torch.bool),
        loss_agg_mode="seq-mean-token-sum",
        global_num_seqs=1,  # loss = sum of per-token losses
    )
    (grad,) = torch.autograd.grad(out.loss, lp)
    return -grad[:, 0] / advantage + 0.0  # + 0.0 turns -0.0 into 0.0


def plot_kernel(name: str, out_dir: Path) -> Path:
    half = X_RANGE.get(name, 3.0)
    x = torch.linspace(-half, half, 801, dtype=torch.float64)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for adv, color in ((1.0, "tab:blue"), (-1.0, "tab:red")):
        ax.plot(x, gradient_weights(name, x, adv), color=color, label=f"A = {adv:+.0f}")
    level = LEVEL.get(name, "token")
    xlabel = {"token": "log r (token log-ratio)", "prefix": "L_1 (prefix log-ratio at t = 1)"}.get(
        level, "log W (sequence log-ratio)"
    )
    ax.set(
        title=f"{name} ({level}): gradient weight, {hyperparameters(name)}",
        xlabel=xlabel,
        ylabel="w = -(d loss / d log pi) / A",
    )
    ax.title.set_fontsize(8)
    ax.axvline(0.0, color="grey", lw=0.5)
    ax.axhline(1.0, color="grey", lw=0.5, ls=":")
    ax.grid(alpha=0.3)
    ax.legend()
    fig.tight_layout()
    path = out_dir / f"{name}.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def plot_epic_bounds(out_dir: Path) -> Path:
    config = EPICConfig()
    t = torch.arange(1, 4097)
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for mean_log_mu, style in ((-0.1, "-"), (-0.5, "--"), (-1.5, ":")):
        old = torch.full((1, t.numel()), mean_log_mu, dtype=torch.float64)
        mask = torch.ones_like(old, dtype=torch.bool)
        log_lo, log_up, _ = epic_log_bounds(old, mask, config.delta_low, config.delta_high)
        suffix = f"mean log mu = {mean_log_mu}"
        ax.plot(t, log_up[0].exp(), "tab:blue", ls=style, label=f"u^(1/t), {suffix}")
        ax.plot(t, log_lo[0].exp(), "tab:red", ls=style, label=f"l^(1/t), {suffix}")
    ax.set(
        xscale="log",
        xlabel="prefix position t",
        ylabel="bound on g_t = (pi/mu)^(1/t) of the prefix",
        title=f"EPIC bounds, delta=({config.delta_low:g}, {config.delta_high:g})",
    )
    ax.axhline(1.0, color="grey", lw=0.5)
    ax.grid(alpha=0.3)
    ax.legend(fontsize=7)
    fig.tight_layout()
    path = out_dir / "epic_bounds.png"
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path


def hyperparameters(name: str) -> str:
    config = get_loss_spec(name).config_cls()
    fields = dataclasses.fields(config)
    return ", ".join(f"{f.name}={getattr(config, f.name)}" for f in fields) or "-"


def build_tables(names: list[str]) -> tuple[Table, Table]:
    overview = Table(title="registered policy losses")
    for column in ("loss", "level", "default aggregation", "hyperparameters (defaults)"):
        overview.add_column(column)
    weights = Table(title="gradient weight w at log-ratio x (A = +1 / A = -1)")
    weights.add_column("loss")
    for point in TABLE_POINTS:
        weights.add_column(f"x={point:+g}", justify="right")
    x = torch.tensor(TABLE_POINTS, dtype=torch.float64)
    for name in names:
        spec = get_loss_spec(name)
        level = LEVEL.get(name, "token")
        overview.add_row(name, level, spec.default_agg_mode, hyperparameters(name))
        w_pos, w_neg = gradient_weights(name, x, 1.0), gradient_weights(name, x, -1.0)
        cells = (f"{p:.3f} / {n:.3f}" for p, n in zip(w_pos, w_neg, strict=True))
        weights.add_row(name, *cells)
    return overview, weights


def main() -> None:
    parser = argparse.ArgumentParser(description="Loss-kernel report (PNG + text table).")
    parser.add_argument("--out", type=Path, default=Path("runs/loss_report"))
    args = parser.parse_args()
    args.out.mkdir(parents=True, exist_ok=True)

    names = [n for n in available_losses()]
    paths = [plot_kernel(name, args.out) for name in names]
    paths.append(plot_epic_bounds(args.out))
    overview, weights = build_tables(names)

    console = Console(width=140)
    console.print(overview)
    console.print(weights)
    with (args.out / "report.txt").open("w") as report:
        file_console = Console(file=report, width=140)
        file_console.print(overview)
        file_console.print(weights)
    console.print(f"wrote {len(paths)} pictures and report.txt to {args.out}/")


if __name__ == "__main__":
    main()
