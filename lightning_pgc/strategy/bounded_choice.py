"""ChoiceBook: what one rank remembers between steps to choose its partition under the ``bounded`` scheme.

The rule itself is pure math (:meth:`~lightning_pgc.codes.BoundedScheme.choose`); this keeps its inputs: the table
ages at the last close this rank saw and the last version it chose each partition.
"""

from __future__ import annotations

from typing import Optional

from lightning_pgc.codes import BoundedScheme


class ChoiceBook:
    """The bounded partition choice bookkeeping of one rank (free of Lightning and torch.distributed).

    Call order: :meth:`reset` when fit starts; per version :meth:`choose` before the step, :meth:`record` once the
    version's aggregate is held.
    """

    def __init__(self) -> None:
        self.table: Optional[tuple[int, Optional[tuple[int, ...]]]] = None  # (version, its table ages)
        self.own: dict[int, int] = {}  # partition -> the last version this rank chose it (sent or not)

    def reset(self) -> None:
        """Forget everything (a new fit)."""
        self.table = None
        self.own = {}

    def choose(
        self, scheme: BoundedScheme, rank: int, version: int, start: int
    ) -> tuple[tuple[int, ...], tuple[int, ...]]:
        """``(evaluations, sampled)`` of ``rank`` at ``version``; under "oldest" from the table as of the close of
        ``version - 1``."""
        table = self.table
        ages = table[1] if table is not None and table[0] == version - 1 else None
        evaluations = scheme.choose(rank, version, ages, self.own)
        sampled = scheme.sampled(rank, version, start=start)
        # the choice counts whether or not this rank computes it (it may skip a version it is late for): a
        # rank that forgot a skipped choice would pick that partition again, next to its other holder
        self.own[evaluations[0]] = version
        return evaluations, sampled

    def record(self, version: int, ages: Optional[tuple[int, ...]]) -> None:
        """The table ages when ``version`` closed (what the next version's choice reads)."""
        self.table = (version, ages)
