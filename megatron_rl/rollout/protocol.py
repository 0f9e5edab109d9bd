"""The interface the trainer drives; the in-process engine and the SGLang client both satisfy it.

The trainer only ever sees this protocol: which engine sits behind it is configuration. It holds
exactly what the trainer and its rollout phase call (`tests/train/test_engine_protocol.py`
checks both directions); an engine's other methods (``health``, ``flush_cache``, ``score``)
belong to the engine, not to the protocol.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import Protocol, runtime_checkable

import torch

from megatron_rl.rollout.types import RolloutSample, SamplingParams


@runtime_checkable
class RolloutEngine(Protocol):
    """Generates samples and receives weights.

    ``generate`` returns ``len(prompts) * n`` samples in prompt-major order (prompt ``i``,
    sample ``j`` at index ``i * n + j``); each carries the weight version that produced it.
    ``update_weights`` consumes a stream of (HF name, tensor) pairs and moves the engine to
    ``version``; when it raises, the engine still serves (and reports) the old version.
    """

    def generate(
        self,
        prompts: Sequence[Sequence[int]],
        params: SamplingParams,
        *,
        n: int = 1,
        return_routed_experts: bool = False,
    ) -> list[RolloutSample]: ...

    def update_weights(
        self, named_tensors: Iterable[tuple[str, torch.Tensor]], *, version: int
    ) -> None: ...

    def wait_until_ready(self) -> float:
        """Block until the engine can serve (servers up); the seconds waited."""
        ...

    def take_aborted(self) -> int:
        """Samples aborted by the engine (and generated again) since the last call."""
        ...

    def membership_metrics(self) -> dict[str, float]:
        """Metrics of the serving membership after a sync (servers up, dropped); {} if none."""
        ...

    def close(self) -> None:
        """Release the engine's threads, sockets and process groups."""
        ...


def check_generate_args(prompts: Sequence[Sequence[int]], n: int, vocab_size: int | None) -> None:
    """ValueError for an empty batch, an empty prompt, a bad ``n`` or an out-of-vocabulary id."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n={n!r}: the number of samples per prompt must be an int >= 1")
    if len(prompts) == 0:
        raise ValueError("prompts is empty: pass at least one prompt")
    for index, prompt in enumerate(prompts):
        if len(prompt) == 0:
            raise ValueError(f"prompt {index} is empty: every prompt needs at least one token")
        if vocab_size is not None:
            bad = [t for t in prompt if not 0 <= int(t) < vocab_size]
            if bad:
                raise ValueError(
                    f"prompt {index} holds token id {bad[0]}, outside [0, vocab_size={vocab_size})"
                )
