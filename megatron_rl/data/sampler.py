"""Deterministic, resumable prompt order: one permutation per epoch, drawn from (seed, epoch)."""

from __future__ import annotations

from typing import Any

import numpy as np


class PromptSampler:
    """Hands out dataset indices batch by batch, epoch after epoch.

    Epoch ``e`` visits every index once, in the permutation drawn from
    ``numpy.random.default_rng([seed, e])`` (or in order with ``shuffle=False``). A batch may
    cross an epoch boundary: its tail then comes from the next epoch's permutation. The state is
    ``(epoch, position)``, so a sampler restored from ``state_dict()`` continues with exactly the
    batches the original would have produced.
    """

    def __init__(self, num_records: int, *, seed: int, shuffle: bool = True) -> None:
        if isinstance(num_records, bool) or not isinstance(num_records, int) or num_records < 1:
            raise ValueError(
                f"num_records={num_records!r}: the dataset must hold at least one prompt"
            )
        if isinstance(seed, bool) or not isinstance(seed, int) or seed < 0:
            raise ValueError(f"seed={seed!r}: pass a non-negative int")
        self.num_records = num_records
        self.seed = seed
        self.shuffle = shuffle
        self.epoch = 0
        self.position = 0
        self._order: np.ndarray | None = None

    def _epoch_order(self) -> np.ndarray:
        if self._order is None:
            if self.shuffle:
                rng = np.random.default_rng([self.seed, self.epoch])
                self._order = rng.permutation(self.num_records)
            else:
                self._order = np.arange(self.num_records)
        return self._order

    def next_batch(self, batch_size: int) -> list[int]:
        """The next ``batch_size`` indices, each in ``[0, num_records)``."""
        if isinstance(batch_size, bool) or not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size={batch_size!r}: pass a positive int")
        batch: list[int] = []
        while len(batch) < batch_size:
            order = self._epoch_order()
            take = min(batch_size - len(batch), self.num_records - self.position)
            batch.extend(int(i) for i in order[self.position : self.position + take])
            self.position += take
            if self.position == self.num_records:
                self.epoch += 1
                self.position = 0
                self._order = None
        return batch

    def state_dict(self) -> dict[str, Any]:
        """JSON-serialisable state: epoch, position, seed (plus num_records and shuffle, checked
        on load)."""
        return {
            "epoch": self.epoch,
            "position": self.position,
            "seed": self.seed,
            "num_records": self.num_records,
            "shuffle": self.shuffle,
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from ``state``; ValueError when it belongs to a different dataset or seed."""
        for key in ("epoch", "position", "seed"):
            if key not in state:
                raise ValueError(f"sampler state lacks {key!r}: pass a PromptSampler.state_dict()")
        checks = {"seed": self.seed, "num_records": self.num_records, "shuffle": self.shuffle}
        for key, mine in checks.items():
            if key in state and state[key] != mine:
                raise ValueError(
                    f"sampler state has {key}={state[key]!r} but this sampler has {key}={mine!r}: "
                    "build the sampler with the same dataset, seed and shuffle as the saved run"
                )
        epoch, position = int(state["epoch"]), int(state["position"])
        if epoch < 0 or not 0 <= position < self.num_records:
            raise ValueError(
                f"sampler state epoch={epoch}, position={position} is out of range for "
                f"num_records={self.num_records}"
            )
        self.epoch, self.position, self._order = epoch, position, None
