"""What the leader reads of one code's announcement: its rank, its version and how it was built (the code itself
stays on its rank; the runtime's control plane carries these few fields)."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Header:
    """One code's announcement: ``ages`` are the ages (in versions) of the cache entries it used (``valid`` of them).

    Bounded staleness: ``partition`` is the partition it carries (-1: the scheme's round robin). ``busy_s``: the
    seconds the sender spent on this version before sending the code, waiting excluded (-1: not measured); read by
    ``scheme="auto"``'s leader.
    """

    version: int
    sender: int
    valid: int = 0
    ages: tuple[int, ...] = ()
    skipped: int = 0  # versions the sender applied without computing so far (for rank statistics)
    partition: int = -1
    busy_s: float = -1.0
