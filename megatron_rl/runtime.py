"""Where a training process runs: its device and torch's intra-op threads."""

from __future__ import annotations

from dataclasses import dataclass

from megatron_rl.flags import bad_value, check_choice, option

DEVICES = ("auto", "cpu", "cuda")


@dataclass(frozen=True, kw_only=True, slots=True)
class RuntimeConfig:
    """The process: device and threads."""

    device: str = option("auto", choices=DEVICES, help="auto: CUDA when available, else CPU")
    torch_threads: int | None = option(
        None,
        help="torch intra-op threads per process (default: OMP_NUM_THREADS, else (cores - 1) / "
        "local ranks, at least 1)",
    )

    def __post_init__(self) -> None:
        check_choice(self, "device", DEVICES)
        if self.torch_threads is not None and self.torch_threads < 1:
            raise bad_value(self, "torch_threads", "must be >= 1")
