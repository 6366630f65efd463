"""The leader's control plane: which ranks' codes close each version (no payload, no communication).

The leader sees shard 0 of every code (it owns shard 0), so it knows when each rank's code for a version
arrived. It closes the open version as soon as the codes in decode (``scheme.admits``) and no live rank would
fall more than ``max_lag`` versions behind; every shard owner then decodes its shard with that same ordered set,
so every replica applies the identical aggregate. It keeps a record per version and per-rank statistics.
"""

from __future__ import annotations

import threading
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from lightning_pgc.codes import Scheme
from lightning_pgc.runtime.messages import Header


class CoordinatorError(RuntimeError):
    """The leader could not close a version: too many ranks missing, or a protocol violation."""


@dataclass
class StepRecord:
    """What the leader saw for one version (read by the diagnostics callback)."""

    version: int
    admitted: list[int]
    weights: dict[int, float]
    arrivals: dict[int, float]  # seconds from the version's opening to each code's arrival
    valid: dict[int, int]  # cache entries each admitted code was built from
    ages: dict[int, tuple[int, ...]]  # ages of those entries, per admitted rank
    opened_at: float
    closed_at: float
    first_arrival: float = 0.0  # monotonic time of the first code
    late: dict[int, float] = field(default_factory=dict)  # codes that arrived after the close

    @property
    def wait_s(self) -> float:
        """Seconds the version stayed open."""
        return self.closed_at - self.opened_at

    def plan(self) -> list[tuple[int, int, int]]:
        """``(decode key, rank, code version)`` of every code the aggregate uses, in decode order."""
        return [(k, k, self.version) for k in self.admitted]


@dataclass
class RankStats:
    """Per-rank counters kept by the leader (see :meth:`Leader.rank_stats`)."""

    admitted: int = 0
    late: int = 0
    skipped: int = 0
    lag_sum_s: float = 0.0
    lag_count: int = 0

    def as_dict(self, rank: int) -> dict[str, float]:
        return {"rank": rank, "admitted": self.admitted, "late": self.late, "skipped": self.skipped,
                "mean_lag_s": self.lag_sum_s / self.lag_count if self.lag_count else 0.0}


class Leader:
    """Admission decisions for a scheme on ``world_size`` ranks, starting at ``start_version``.

    Call order (one thread): :meth:`on_code` / :meth:`on_bye` / :meth:`on_dead` as events arrive, then
    :meth:`try_close` after each event and :meth:`check` periodically. :meth:`record` and :meth:`rank_stats`
    may be called from any thread.

    Args:
        timeout: seconds after the first code of a version within which it must close; beyond, :meth:`check`
            raises naming the missing ranks. Raise it if steps are legitimately that slow (compilation).
        max_lag: versions a live rank may fall behind before the leader waits for it; bounds the aggregates a
            slow rank buffers. Lower it if a slow rank's memory grows; raise it if fast ranks log waits.
    """

    def __init__(self, scheme: Scheme, world_size: int, start_version: int, timeout: float, max_lag: int,
                 keep_records: int = 4096) -> None:
        self.scheme = scheme
        self.world_size = world_size
        self.version = start_version
        self.start_version = start_version
        self.timeout = timeout
        self.max_lag = max_lag
        self.records: deque[StepRecord] = deque(maxlen=keep_records)
        self.late_codes = 0
        self.dead: set[int] = set()
        self.byes: set[int] = set()
        self._lock = threading.Lock()
        self._stats = [RankStats() for _ in range(world_size)]
        self._last_seen = {r: start_version - 1 for r in range(world_size)}
        self._last_heard: dict[int, float] = {}
        self._open(now=None)

    def _open(self, now: Optional[float]) -> None:
        self._order: list[int] = []
        self._arrivals: dict[int, float] = {}
        self._valid: dict[int, int] = {}
        self._ages: dict[int, tuple[int, ...]] = {}
        self._opened_at = now
        self._first_arrival: Optional[float] = None

    # -------------------------------------------------------------------------------------------- events
    def on_code(self, header: Header, arrived: float) -> None:
        """Shard 0 of ``header.sender``'s code for ``header.version`` arrived at monotonic time ``arrived``.

        Raises:
            CoordinatorError: a code for a version that is not open yet (ranks out of step).
        """
        sender, version = header.sender, header.version
        if self._opened_at is None:
            self._opened_at = arrived
        self._last_heard[sender] = arrived
        self._last_seen[sender] = max(self._last_seen[sender], version)
        stats = self._stats[sender]
        stats.skipped = max(stats.skipped, header.skipped)
        if version == self.version:
            if sender in self._arrivals:
                return
            if self._first_arrival is None:
                self._first_arrival = arrived
            self._order.append(sender)
            self._arrivals[sender] = arrived - self._opened_at
            self._valid[sender] = header.valid
            self._ages[sender] = header.ages
            stats.lag_sum_s += arrived - self._first_arrival
            stats.lag_count += 1
        elif version < self.version:
            self.late_codes += 1
            stats.late += 1
            rec = self.record(version)
            if rec is not None:
                rec.late[sender] = arrived - rec.opened_at
                stats.lag_sum_s += arrived - rec.first_arrival
                stats.lag_count += 1
        else:
            raise CoordinatorError(
                f"rank {sender} sent a code for version {version} while version {self.version} is open; ranks "
                "are out of step (was the step counter changed?)"
            )

    def on_bye(self, rank: int, skipped: int = 0) -> None:
        """``rank`` finished training and sends nothing more."""
        self.byes.add(rank)
        self._stats[rank].skipped = max(self._stats[rank].skipped, skipped)

    def on_dead(self, rank: int) -> None:
        """``rank``'s stream broke (its process is gone)."""
        if rank not in self.byes:
            self.dead.add(rank)

    # ------------------------------------------------------------------------------------------ decisions
    def try_close(self, now: float) -> Optional[StepRecord]:
        """Close the open version if the codes in decode it and no live rank lags too far; else None."""
        order = self._order
        if not order or not self.scheme.admits(order) or not self._lag_ok(now):
            return None
        weights = self.scheme.decoding_weights(order)
        for r in order:
            self._stats[r].admitted += 1
        rec = StepRecord(version=self.version, admitted=list(order), weights=weights, arrivals=dict(self._arrivals),
                         valid=dict(self._valid), ages=dict(self._ages), opened_at=self._opened_at or now,
                         closed_at=now, first_arrival=self._first_arrival or now)
        with self._lock:
            self.records.append(rec)
        self.version += 1
        self._open(now)
        return rec

    def _lag_ok(self, now: float) -> bool:
        """True unless a live, responsive rank would fall more than ``max_lag`` versions behind."""
        for r, seen in self._last_seen.items():
            heard = self._last_heard.get(r, self._opened_at or now)
            if r in self.dead or r in self.byes or now - heard > self.timeout:
                continue
            if self.version - seen > self.max_lag:
                return False
        return True

    def check(self, now: float) -> None:
        """Raise if the open version cannot close within ``timeout`` of its first code.

        Raises:
            CoordinatorError: naming the missing ranks and how many the scheme tolerates.
        """
        if self._first_arrival is None or now - self._first_arrival <= self.timeout:
            return
        if not self.scheme.admits(self._order):
            missing = sorted(set(range(self.world_size)) - set(self._order))
            raise CoordinatorError(
                f"Missing ranks: {missing}. Version {self.version}: only ranks {sorted(self._order)} sent their "
                f"code within {self.timeout:g} s; scheme '{self.scheme.name}' needs {self.scheme.wait_for} of "
                f"{self.world_size} (tolerates {self.world_size - self.scheme.wait_for} missing)."
            )

    # ------------------------------------------------------------------------------------------- reading
    def record(self, version: int) -> Optional[StepRecord]:
        """The record of a closed version, if still kept."""
        with self._lock:
            for rec in reversed(self.records):
                if rec.version == version:
                    return rec
                if rec.version < version:
                    return None
        return None

    @property
    def closed(self) -> int:
        """Versions closed since this leader started."""
        return self.version - self.start_version

    def rank_stats(self) -> list[dict[str, float]]:
        """One dict per rank: ``rank``, ``admitted``, ``late``, ``skipped``, ``mean_lag_s``."""
        return [s.as_dict(r) for r, s in enumerate(self._stats)]

    def stats_words(self) -> list[float]:
        """The statistics flattened (admitted, late, skipped, mean lag per rank), for the STOP message."""
        out: list[float] = []
        for s in self._stats:
            out += [s.admitted, s.late, s.skipped, s.lag_sum_s / s.lag_count if s.lag_count else 0.0]
        return out
