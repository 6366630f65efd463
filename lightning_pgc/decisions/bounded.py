"""The bounded-staleness coordinator: the leader's table and coverage rule.

Ranks compute one uncoded partition gradient per version (:class:`~lightning_pgc.codes.BoundedScheme`). The leader
sees every code's announcement, late ones included, and keeps the newest ``(rank, version)`` per partition in a
:class:`~lightning_pgc.codes.CoverageTable`. It closes version ``t`` once ``scheme.wait_for`` codes of ``t``
arrived and every partition has an entry with ``t - v_i < c``; its DECIDE names, per partition, the rank and
version of the code to use, so every member contributes the same entries to the all-reduce and replicas stay
identical. Ranks keep every code from the oldest entry in use on (``scheme.reuses_codes``). Coverage failure waits (counted, logged)
and, with ``widen_after``, widens ``c`` by one per ``widen_after`` seconds of waiting, up to ``max_window``. A
partition that cannot be covered at the open version (no entry younger than ``c``, and every live holder's code of
it carries another partition: e.g. the first version after a holder died at the start of fit, under round robin)
would wait for ever, since no rank computes version ``t + 1`` before ``t`` closes: the version closes without it,
the other partitions averaged (counted in ``uncovered``, logged).

Faults: a dead or frozen rank's entries are forgotten (:meth:`BoundedLeader.forget`: its codes died with it), and a
version whose all-reduce it broke is decided again without them. Every rank keeps its own codes of its last ``c``
versions, so a successor leader rebuilds the table from the codes announced again to it.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass
from typing import Optional

from lightning_pgc.codes.bounded import BoundedScheme, CoverageTable, Entry
from lightning_pgc.decisions.leader import CoordinatorError, Leader, StepRecord
from lightning_pgc.decisions.header import Header

log = logging.getLogger(__name__)

__all__ = ["BoundedLeader", "BoundedRecord"]


@dataclass
class BoundedRecord(StepRecord):
    """A closed version under bounded staleness: the entry of every partition and the window it closed with."""

    entries: tuple[Optional[Entry], ...] = ()  # per partition; None: not covered, left out of this aggregate
    window: int = 0  # c in effect (configured window + leader widening)
    coverage_wait_s: float = 0.0  # seconds the version waited for coverage after enough fresh codes arrived
    fresh: int = 0  # codes of this version that had arrived at the close

    def plan(self) -> list[tuple[int, int, int]]:
        """``(partition, rank, version)`` per partition; rank -1 for one left out (see :class:`BoundedLeader`)."""
        return [(i, -1, self.version) if e is None else (i, e.rank, e.version) for i, e in enumerate(self.entries)]

    def delays(self) -> list[int]:
        """``t - s(t, i)`` per partition in the aggregate."""
        return [self.version - e.version for e in self.entries if e is not None]


class BoundedLeader(Leader):
    """:class:`Leader` with the bounded-staleness table and coverage rule (one thread, as the base class).

    Args:
        widen_after: seconds of coverage wait after which ``c`` grows by one (``None``: never widen, only wait).
            Set it when ``coverage_waits`` grow and steps stall on a missing partition.
        max_window: the largest ``c`` widening may reach.
        now: the clock's start (default ``time.monotonic()``; the simulator passes its virtual time).
    """

    def __init__(
        self,
        scheme: BoundedScheme,
        world_size: int,
        start_version: int,
        timeout: float,
        max_lag: int,
        heartbeat_window: float = 3.0,
        widen_after: Optional[float] = None,
        max_window: Optional[int] = None,
        now: Optional[float] = None,
    ) -> None:
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
        self.duplicates = 0  # codes carrying a partition another code of the same version already carried
        self.uncovered = 0  # partitions left out of an aggregate because no live holder could cover them
        self._carried: dict[int, dict[int, list[int]]] = {}  # version -> partition -> ranks whose codes carried it
        # (recent versions only: what :meth:`forget` falls back on)
        self._counts_from: dict[int, float] = {}  # forgotten rank -> first version whose codes count again
        self._covered_since: Optional[float] = None
        self._uncoverable_since: Optional[float] = None

    @property
    def window(self) -> int:
        """The ``c`` in effect: ``scheme.window`` (identical on every rank) plus this leader's widening."""
        return min(self.bounded.window + self.widened, max(self.max_window, self.bounded.window))

    def on_code(self, header: Header, arrived: float) -> None:
        """A code was announced (late ones too): offer it to the table as its partition's newest entry.

        Raises:
            CoordinatorError: the code names a partition its sender does not hold.
        """
        super().on_code(header, arrived)
        partition = header.partition if header.partition >= 0 else self.bounded.evaluated(header.sender, header.version)
        if partition not in self.bounded.partitions(header.sender):
            raise CoordinatorError(
                f"rank {header.sender}'s code of version {header.version} carries partition "
                f"{partition}, which it does not hold"
            )
        if header.version < self._counts_from.get(header.sender, -1):
            return  # a code of a forgotten rank (sent before it froze, say), from before it rejoined
        carried = self._carried.setdefault(header.version, {})
        if header.sender in carried.get(partition, ()):
            return  # the same code announced again (to a new leader)
        self.duplicates += partition in carried
        carried.setdefault(partition, []).append(header.sender)
        for v in [v for v in self._carried if v < self.version - 16]:
            del self._carried[v]
        old = self.table.entries[partition]
        if self.table.offer(partition, header.sender, header.version) and old is not None:
            self.displaced += 1

    def forget(self, rank: int, floor: int) -> None:
        """``rank`` died (or froze): its codes died with it, so none of them enters an aggregate again. Each partition whose entry was its code falls back
        on the newest other code of that partition seen lately of a version from ``floor`` on (owners keep those),
        or on none: the partition waits for coverage. Its codes count again from the version it rejoins at."""
        self._counts_from[rank] = math.inf
        for carried in self._carried.values():
            for ranks in carried.values():
                if rank in ranks:
                    ranks.remove(rank)
        for i, e in enumerate(self.table.entries):
            if e is not None and e.rank == rank:
                self.table.entries[i] = self._newest(i, floor=floor - 1)

    def _newest(
        self, partition: int, floor: int, below: Optional[int] = None, gone: frozenset[int] = frozenset()
    ) -> Optional[Entry]:
        """The newest code of ``partition`` seen lately, of a version in ``(floor, below]`` and not from ``gone``."""
        for v in sorted(self._carried, reverse=True):
            if (below is not None and v > below) or v <= floor:
                continue
            ranks = [r for r in self._carried[v].get(partition, ()) if r not in gone]
            if ranks:
                return Entry(ranks[0], v)
        return None

    def on_rejoin(self, rank: int, leader_rank: int, leader_finished: bool = False) -> tuple[int, int]:
        """As :meth:`Leader.on_rejoin`; a forgotten rank's codes count again from the version it rejoins at."""
        u, donor = super().on_rejoin(rank, leader_rank, leader_finished)
        if rank in self._counts_from:
            self._counts_from[rank] = u
        return u, donor

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
            if (
                self.widen_after is not None
                and self.window < self.max_window
                and now - self._covered_since >= self.widen_after * (1 + self.widened)
            ):
                self.widened += 1
                log.warning(
                    "bounded staleness: widening c to %d at version %d (partitions %s had no entry within %.3g s)",
                    self.window,
                    t,
                    missing,
                    now - self._covered_since,
                )
            missing = self.table.missing(t, self.window)
            dropped = self._uncoverable(t, missing, now)
            if len(dropped) < len(missing):
                return None
            self.uncovered += len(dropped)
            log.warning(
                "bounded staleness: version %d closes without partitions %s: no entry younger than c=%d and "
                "no live holder's code of version %d carries them (the others are averaged)",
                t,
                dropped,
                self.window,
                t,
            )
        entries = tuple(None if e is None or t - e.version >= self.window else e for e in self.table.entries)
        waited = 0.0 if self._covered_since is None else now - self._covered_since
        self._covered_since = None
        weights: dict[int, float] = {}
        ages: dict[int, tuple[int, ...]] = {}
        partition_weights = self.bounded.decoding_weights([i for i, e in enumerate(entries) if e is not None])
        for i, e in enumerate(entries):
            if e is None:
                continue
            weights[e.rank] = weights.get(e.rank, 0.0) + partition_weights[i]
            ages[e.rank] = ages.get(e.rank, ()) + (t - e.version,)
        used = sorted(weights)
        for r in used:
            self._stats[r].admitted += 1
        rec = BoundedRecord(
            version=t,
            admitted=used,
            weights=weights,
            arrivals=dict(self._arrivals),
            valid={r: len(a) for r, a in ages.items()},
            ages=ages,
            opened_at=self._opened_at or now,
            closed_at=now,
            first_arrival=self._first_arrival or now,
            entries=entries,
            window=self.window,
            coverage_wait_s=waited,
            fresh=len(self._order),
        )
        self._close(rec, now)
        return rec

    def _could_close(self, ranks: list[int]) -> bool:
        """Whether ``ranks`` are enough fresh codes (coverage may still be waited for or left out)."""
        return len(ranks) >= self.bounded.wait_for

    def _uncoverable(self, t: int, missing: list[int], now: float) -> list[int]:
        """The partitions of ``missing`` no code can cover at ``t``: each has a live attached holder, and every such
        holder's code of ``t`` arrived carrying another partition or was not finite (rejected). (A partition without
        a live holder is waited for, and fails after ``timeout``: see :meth:`check`.)"""
        out = []
        rejected = self._rejected.get(t, set())
        for i in missing:
            live = [
                h
                for h in self.bounded.holders(i)
                if self.is_alive(h, now) and h not in self.byes and h not in self.detached
            ]
            if live and all(h in self._arrivals or h in rejected for h in live) and i not in self._carried.get(t, {}):
                out.append(i)
        return out

    def check(self, now: float) -> None:
        """Raise as :meth:`Leader.check` (too few live ranks), or once some partition has had no live holder for
        ``timeout`` seconds while the open version waits for its coverage. A slow but live holder is waited for.

        Raises:
            CoordinatorError: naming the partitions without a recent entry and their holders.
        """
        super().check(now)
        missing = self.table.missing(self.version, self.window) if self._first_arrival is not None else []
        orphans = {
            i: list(self.bounded.holders(i))
            for i in missing
            if not any(self.is_alive(h, now) and h not in self.byes for h in self.bounded.holders(i))
        }
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
