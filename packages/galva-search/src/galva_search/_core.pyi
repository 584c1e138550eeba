"""Type stub of the C++ extension (cpp/bindings.cpp). Use :mod:`galva_search.dp`, which wraps it."""

from collections.abc import Sequence
from typing import Any

Buffer = Any  # float64 buffers (numpy arrays or array('d'))

__version__: str

_Solution = tuple[tuple[int, ...], float, float] | None
_Problem = tuple[int, int, Buffer, Buffer, Buffer, float]  # layers, strategies, intra, memory, inter, budget

def solve_stage(
    layers: int,
    strategies: int,
    intra: Buffer,
    memory: Buffer,
    inter: Buffer,
    budget: float,
    memory_resolution: float = 0.0,
    prune_strategies: bool = True,
    use_bounds: bool = True,
) -> tuple[_Solution, dict[str, Any]]: ...
def solve_many(
    problems: Sequence[_Problem],
    threads: int = 0,
    memory_resolution: float = 0.0,
    prune_strategies: bool = True,
    use_bounds: bool = True,
) -> list[_Solution]: ...

class StageLevels:
    """One stage's transient levels, reduced and bounded, with their solutions (cpp/stage_levels.hpp)."""

    def __init__(
        self,
        layers: int,
        strategies: int,
        intra: Buffer,
        memory: Buffer,
        inter: Buffer,
        transient: Buffer,
        block: Sequence[int] = ...,
    ) -> None: ...
    @property
    def levels(self) -> list[tuple[float, tuple[int, ...]]]: ...
    @property
    def classes(self) -> tuple[int, ...]: ...
    def bound(self, level: int, budget: float) -> float: ...

def solve_stages(
    stages: Sequence[tuple[StageLevels, float]], threads: int = 0, cutoffs: bool = True
) -> tuple[list[_Solution], int, int]: ...
