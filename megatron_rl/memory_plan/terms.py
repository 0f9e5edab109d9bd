"""What a plan is made of: a term (bytes live for one reason, counted or estimated, on the GPU
or the host) and a phase (a moment of the step and the terms live then)."""

from __future__ import annotations

import dataclasses

GIB = 1024**3


@dataclasses.dataclass(frozen=True, slots=True)
class Term:
    name: str
    nbytes: int
    exact: bool
    on_gpu: bool = True
    note: str = ""

    @property
    def gib(self) -> float:
        return self.nbytes / GIB


@dataclasses.dataclass(frozen=True, slots=True)
class Phase:
    """A moment of the training step and the estimated bytes live then besides the static terms."""

    name: str
    terms: tuple[Term, ...]

    @property
    def nbytes(self) -> int:
        return sum(term.nbytes for term in self.terms if term.on_gpu)
