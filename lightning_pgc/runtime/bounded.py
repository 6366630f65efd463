"""The bounded-staleness coordinator on the sharded data plane: the leader's table and coverage rule.

Ranks push one uncoded partition gradient per version (:class:`~lightning_pgc.codes.BoundedScheme`). The leader
sees shard 0 of every code, late ones included, and keeps the newest ``(rank, version)`` per partition in a
:class:`~lightning_pgc.codes.CoverageTable`. It closes version ``t`` once ``scheme.wait_for`` codes of ``t``
arrived and every partition has an entry with ``t - v_i < c``; its DECIDE names, per partition, the rank and
version of the code to use, so every shard owner sums the same entries and replicas stay identical. Owners keep
every code from the oldest entry in use on (``scheme.reuses_codes``). Coverage failure waits (counted, logged)
and, with ``widen_after``, widens ``c`` by one per ``widen_after`` seconds of waiting, up to ``max_window``.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from typing import Optional

from lightning_pgc.codes.bounded import BoundedScheme, CoverageTable, Entry
from lightning_pgc.runtime.leader import CoordinatorError, Leader, StepRecord
from lightning_pgc.runtime.messages import Header

log = logging.getLogger(__name__)

__all__ = ["BoundedLeader", "BoundedRecord"]


@dataclass
class BoundedRecord(StepRecord):
    """A closed version under bounded staleness: the entry of every partition and the window it closed with."""

    entries: tuple[Entry, ...] = ()
    window: int = 0  # c in effect (configured window + leader widening)
    coverage_wait_s: float = 0.0  # seconds the version waited for coverage after enough fresh codes arrived
    fresh: int = 0  # codes of this version that had arrived at the close

    def plan(self) -> list[tuple[int, int, int]]:
        return [(i, e.rank, e.version) for i, e in enumerate(self.entries)]

    def delays(self) -> list[int]:
        """``t - s(t, i)`` per partition."""
        return [self.version - e.version for e in self.entries]


class BoundedLeader(Leader):
    """:class:`Leader` with the bounded-staleness table and coverage rule (one thread, as the base class).

    Args:
        widen_after: seconds of coverage wait after which ``c`` grows by one (``None``: never widen, only wait).
            Set it when ``coverage_waits`` grow and steps stall on a missing partition.
        max_window: the largest ``c`` widening may reach.
        now: the clock's start (default ``time.monotonic()``; the simulator passes its virtual time).
    """

    def __init__(self, scheme: BoundedScheme, world_size: int, start_version: int, timeout: float, max_lag: int,
                 heartbeat_window: float = 3.0, widen_after: Optional[float] = None,
                 max_window: Optional[int] = None, now: Optional[float] = None) -> None:
        if not isinstance(scheme, BoundedScheme):
            raise TypeError(f"BoundedLeader needs a BoundedScheme, got {type(scheme).__name__}")
        if widen_after is not None and widen_after < 0:
            raise ValueError(f"widen_after must be >= 0 seconds or None, got {widen_after}")
        super().__init__(scheme, world_size, start_version, timeout, max_lag, heartbeat_window, now=now)
        self.bounded = scheme
        self.table = CoverageTable(scheme.n)
        self.widen_after = widen_after
        self.max_window = max(max_window or scheme.window, scheme.window)
        self.widened = 0  # leader-only widening on top of scheme.window (the replicated, configured window)
        self.coverage_waits = 0  # versions that waited for coverage
        self.displaced = 0  # table entries replaced by a newer version
        self._covered_since: Optional[float] = None
        self._uncoverable_since: Optional[float] = None

    @property
    def window(self) -> int:
        """The ``c`` in effect: ``scheme.window`` (identical on every rank) plus this leader's widening."""
        return min(self.bounded.window + self.widened, max(self.max_window, self.bounded.window))

    def on_code(self, header: Header, arrived: float) -> None:
        """Shard 0 of a code arrived (late ones too): offer it to the table as its partition's newest entry."""
        super().on_code(header, arrived)
        partition = self.bounded.evaluated(header.sender, header.version)
        old = self.table.entries[partition]
        if self.table.offer(partition, header.sender, header.version) and old is not None:
            self.displaced += 1

    def try_close(self, now: float) -> Optional[StepRecord]:
        """Close the open version if enough fresh codes arrived and every partition is covered (no rank is waited
        for beyond that)."""
        if len(self._order) < self.bounded.wait_for:
            return None
        t = self.version
        missing = self.table.missing(t, self.window)
        if missing:
            if self._covered_since is None:
                self._covered_since = now
                self.coverage_waits += 1
                log.info("bounded staleness: version %d waits for partitions %s (c=%d)", t, missing, self.window)
            if (self.widen_after is not None and self.window < self.max_window
                    and now - self._covered_since >= self.widen_after * (1 + self.widened)):
                self.widened += 1
                log.warning("bounded staleness: widening c to %d at version %d (partitions %s had no entry "
                            "within %.3g s)", self.window, t, missing, now - self._covered_since)
            if self.table.missing(t, self.window):
                return None
        entries = self.table.decision(t, self.window)
        waited = 0.0 if self._covered_since is None else now - self._covered_since
        self._covered_since = None
        weights: dict[int, float] = {}
        ages: dict[int, tuple[int, ...]] = {}
        for i, e in enumerate(entries):
            weights[e.rank] = weights.get(e.rank, 0.0) + self.bounded.partition_weights[i]
            ages[e.rank] = ages.get(e.rank, ()) + (t - e.version,)
        used = sorted(weights)
        for r in used:
            self._stats[r].admitted += 1
        rec = BoundedRecord(version=t, admitted=used, weights=weights, arrivals=dict(self._arrivals),
                            valid={r: len(a) for r, a in ages.items()}, ages=ages,
                            opened_at=self._opened_at or now, closed_at=now,
                            first_arrival=self._first_arrival or now, entries=entries, window=self.window,
                            coverage_wait_s=waited, fresh=len(self._order))
        self._close(rec, now)
        return rec

    def check(self, now: float) -> None:
        """Raise as :meth:`Leader.check` (too few live ranks), or once some partition has had no live holder for
        ``timeout`` seconds while the open version waits for its coverage. A slow but live holder is waited for.

        Raises:
            CoordinatorError: naming the partitions without a recent entry and their holders.
        """
        super().check(now)
        missing = self.table.missing(self.version, self.window) if self._first_arrival is not None else []
        orphans = {i: list(self.bounded.holders(i)) for i in missing
                   if not any(self.is_alive(h, now) and h not in self.byes for h in self.bounded.holders(i))}
        if not orphans:
            self._uncoverable_since = None
            return
        if self._uncoverable_since is None:
            self._uncoverable_since = now
        if now - self._uncoverable_since > self.timeout:
            raise CoordinatorError(
                f"Version {self.version} cannot close: partitions without an entry younger than c={self.window} "
                f"and without a live holder: {orphans} (partition: holders; missing ranks {self.missing(now)}). "
                "Raise `replication` so that every partition has a live holder, or set `widen_after`."
            )
