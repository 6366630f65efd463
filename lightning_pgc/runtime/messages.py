"""What the leader reads of one code: its rank, its version and how it was built (the code itself stays on its
rank; :mod:`~lightning_pgc.runtime.control` carries these few fields as an announcement)."""

from __future__ import annotations

from dataclasses import dataclass
from enum import IntEnum


class Kind(IntEnum):
    """What an announcement is about."""

    CODE = 0  # a rank's code for one version is ready


STAT_FIELDS = 6  # per rank in the leader's STOP: admitted, late, skipped, mean lag, rejected, rejoined


@dataclass(frozen=True)
class Header:
    """One code's announcement: ``ages`` are the ages (in versions) of the cache entries it used.

    Bounded staleness: ``partition`` is the partition it carries (-1: the scheme's round robin).
    """

    kind: Kind
    version: int
    sender: int
    shard: int = 0
    valid: int = 0
    max_age: int = 0
    ages: tuple[int, ...] = ()
    skipped: int = 0  # versions the sender applied without computing so far (for rank statistics)
    partition: int = -1
    table: tuple[int, ...] = ()
