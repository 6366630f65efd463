"""The leader's decisions: which ranks' codes close each version, and who is alive (no payload, no I/O).

Every rank announces its code for a version to the leader, so the leader knows when each one is ready. It
closes the open version as soon as the codes in decode (``scheme.admits``): it never waits for a rank. Every member
of the data group then contributes its share of that same plan to one all-reduce, so every replica applies the
identical aggregate. Liveness is separate from progress: a rank is alive while its heartbeats arrive. A rank
whose training thread falls more than ``max_lag`` versions behind is *detached* (it gets no more aggregates, so
its memory stays bounded) until it asks to rejoin, when a live rank donates the current training state.
It keeps a record per version and per-rank statistics.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Optional

from lightning_pgc.codes import Scheme
from lightning_pgc.decisions.header import Header


class CoordinatorError(RuntimeError):
    """The leader could not close a version: too many ranks missing, or a protocol violation."""


class NoDonorYet(CoordinatorError):
    """A rank asks to rejoin while no rank can send it the training state (see :meth:`Leader.on_rejoin`)."""


class DivergedError(CoordinatorError):
    """The open version can never close: too many ranks' gradients for it were NaN or inf (and skipped)."""


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
    rejected: int = 0  # codes not sent because they were not finite
    rejoined: int = 0  # state transfers after falling more than ``max_lag`` behind

    def as_dict(self, rank: int) -> dict[str, float]:
        return {
            "rank": rank,
            "admitted": self.admitted,
            "late": self.late,
            "skipped": self.skipped,
            "mean_lag_s": self.lag_sum_s / self.lag_count if self.lag_count else 0.0,
            "rejected": self.rejected,
            "rejoined": self.rejoined,
        }

    def words(self) -> list[float]:
        """The statistics in :data:`STAT_NAMES` order (for the STOP message)."""
        d = self.as_dict(0)
        return [float(d[k]) for k in STAT_NAMES]


#: Order of the per-rank statistics in a STOP message.
STAT_NAMES = ("admitted", "late", "skipped", "mean_lag_s", "rejected", "rejoined")


class Leader:
    """Admission decisions and liveness for a scheme on ``world_size`` ranks, starting at ``start_version``.

    Call order (one thread): :meth:`on_code`, :meth:`on_beat`, :meth:`on_reject`, :meth:`on_bye`,
    :meth:`on_dead` as events arrive; then :meth:`try_close` and, for each version it closes, :meth:`detach`
    before the decision is sent; :meth:`on_rejoin` when a detached rank is back; :meth:`check` periodically.
    :meth:`record` and :meth:`rank_stats` may be called from any thread.

    Args:
        timeout: seconds the job may stay without ``n - s`` live ranks (not counting the heartbeat window that
            detects a death) before :meth:`check` raises naming them. Raise it if frozen ranks are expected back.
        max_lag: versions a rank's training thread may fall behind before it is detached (no more aggregates;
            it catches up by state transfer). Lower it if a slow rank's memory grows; raise it if ranks log
            frequent rejoins (``rank_stats()[k]['rejoined']``) after short hiccups.
        heartbeat_window: seconds without a heartbeat after which a rank counts as dead.
    """

    def __init__(
        self,
        scheme: Scheme,
        world_size: int,
        start_version: int,
        timeout: float,
        max_lag: int,
        heartbeat_window: float = 3.0,
        keep_records: int = 4096,
        now: Optional[float] = None,
    ) -> None:
        self.scheme = scheme
        self.world_size = world_size
        self.version = start_version
        self.start_version = start_version
        self.timeout = timeout
        self.max_lag = max_lag
        self.heartbeat_window = heartbeat_window
        self.records: deque[StepRecord] = deque(maxlen=keep_records)
        self.late_codes = 0
        self.dead: set[int] = set()  # streams broken: gone for good
        self.byes: set[int] = set()
        self.detached: dict[int, int] = {}  # rank -> first version it gets no aggregate for
        self.rejoining: dict[int, int] = {}  # rank -> version it rejoins at (it has the state once that one applies)
        self._lock = threading.Lock()
        self._stats = [RankStats() for _ in range(world_size)]
        self.progress = {r: start_version for r in range(world_size)}  # version each training thread is at
        start = time.monotonic() if now is None else now
        self._last_beat = {r: start for r in range(world_size)}
        self._last_close = start
        self._short_since: Optional[float] = None
        self._rejected: dict[int, set[int]] = {}  # version (open or later) -> ranks whose code for it was not finite
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
        """``header.sender``'s code for ``header.version`` was announced at monotonic time ``arrived``.

        Raises:
            CoordinatorError: a code for a version that is not open yet (ranks out of step).
        """
        sender, version = header.sender, header.version
        if self._opened_at is None:
            self._opened_at = arrived
        self.on_beat(sender, version, arrived)
        stats = self._stats[sender]
        stats.skipped = max(stats.skipped, header.skipped)
        if version == self.version:
            if sender in self._arrivals or sender in self.detached:  # a detached rank's code is never admitted
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

    def on_beat(self, rank: int, progress: int, now: float) -> None:
        """``rank`` is alive and its training thread is at version ``progress``."""
        self._last_beat[rank] = max(self._last_beat[rank], now)
        if rank not in self.detached:
            self.progress[rank] = max(self.progress[rank], progress)

    def silence(self, rank: int, now: float) -> None:
        """``rank`` is known to be silent (a leader that was replaced): not alive until its next heartbeat."""
        self._last_beat[rank] = min(self._last_beat[rank], now - self.heartbeat_window - 1e-3)

    def on_reject(self, rank: int, version: int, now: float) -> None:
        """``rank``'s code for ``version`` was not finite: counted, and the rank is a straggler for it."""
        self._stats[rank].rejected += 1
        self.on_beat(rank, version, now)
        if version >= self.version:
            self._rejected.setdefault(version, set()).add(rank)

    def on_bye(self, rank: int, skipped: int = 0) -> None:
        """``rank`` finished training and sends nothing more."""
        self.byes.add(rank)
        self._stats[rank].skipped = max(self._stats[rank].skipped, skipped)

    def on_dead(self, rank: int) -> None:
        """``rank``'s stream broke (its process is gone). A code of it for the open version is no longer admitted:
        its code died with it."""
        if rank not in self.byes:
            self.dead.add(rank)
            self.drop_open(rank)

    def drop_open(self, rank: int) -> None:
        """Forget ``rank``'s code for the open version (it died or froze: its code is gone with it)."""
        if rank in self._arrivals:
            self._order.remove(rank)
            for d in (self._arrivals, self._valid, self._ages):
                d.pop(rank, None)

    def forget(self, rank: int, floor: int) -> None:
        """``rank`` died or froze: no code of it enters a later aggregate (``floor``: the oldest version whose codes
        every owner still keeps). Nothing to do here (a code serves only its own version); bounded staleness's table
        overrides this."""

    def on_rejoin(self, rank: int, leader_rank: int, leader_finished: bool = False) -> tuple[int, int]:
        """Detached ``rank`` is back: it gets aggregates again from the open version ``u`` on, and the training
        state at the start of ``u`` from a donor. Returns ``(u, donor)``. The donor is the leader (whose training
        thread applies ``u`` or has finished), unless the leader is the one rejoining, is detached itself or rejoins
        at ``u`` too (it has the state of ``u`` only once its own donor sent it): then the attached live rank
        furthest ahead that does not rejoin at ``u``. Several ranks may rejoin at one version (two that missed a
        dead leader's last aggregate, say).

        Raises:
            NoDonorYet: no rank can donate now (every other one finished or is detached while the leader still
                trains): nothing changed; ask again later (the leader donates once it finished).
            CoordinatorError: the leader's own rank rejoins and every other rank finished or died: none ever can.
        """
        u = self.version
        rejoining = {r: v for r, v in self.rejoining.items() if v >= u}
        rejoining[rank] = u
        detached = {r: v for r, v in self.detached.items() if r != rank}
        if leader_finished or (rank != leader_rank and leader_rank not in detached and rejoining.get(leader_rank) != u):
            donor = leader_rank
        else:
            now = time.monotonic()
            candidates = [
                r
                for r in range(self.world_size)
                if r != rank
                and r not in detached
                and rejoining.get(r) != u
                and r not in self.byes
                and self.is_alive(r, now)
            ]
            if (
                not candidates
                and rank == leader_rank
                and all(r in self.byes or r in self.dead for r in range(self.world_size) if r != rank)
            ):  # nobody is left who could ever donate: fail now, not wait for ever
                raise CoordinatorError(
                    f"the leader's rank {rank} fell {self.max_lag} or more versions behind and was detached, and every "
                    f"other rank has finished or died: no rank is left to send it the state of version {u}. Raise "
                    "max_lag (PGCStrategy(liveness={'max_lag': ...})) so that a slow leader keeps its aggregates"
                )
            if not candidates:
                raise NoDonorYet(f"rank {rank} asks to rejoin at version {u} but no live rank can donate the state yet")
            donor = max(candidates, key=lambda r: (self.progress[r], -r))
        self.detached, self.rejoining = detached, rejoining
        self.progress[rank] = u
        self._stats[rank].rejoined += 1
        return u, donor

    def reopen(self, version: int, now: float) -> None:
        """A successor leader: ``version`` is the open one (the dead leader's last decisions are unknown here, and
        every version before ``version`` reached some live rank whole). Codes of it that arrived are forgotten:
        ranks announce them again to the new leader."""
        self.version = version
        self._last_close = now
        for r in self.progress:  # until their heartbeats say more: at the open version (none is detached for lag)
            self.progress[r] = max(self.progress[r], version)
        self._open(None)

    def reopen_decided(self, version: int, lost: set[int], now: float) -> None:
        """Version ``version`` was closed but its aggregate reached no rank (the data group lost a member during its
        all-reduce): it is open again, with the codes that had arrived for it except the ``lost`` ranks'.

        Raises:
            CoordinatorError: ``version`` is not the last closed version.
        """
        with self._lock:
            if not self.records or self.records[-1].version != version or self.version != version + 1:
                raise CoordinatorError(f"cannot open version {version} again: version {self.version} is open")
            rec = self.records.pop()
        for r in rec.admitted:
            self._stats[r].admitted = max(self._stats[r].admitted - 1, 0)
        self.version = version
        self._open(rec.opened_at)
        arrived = dict(rec.arrivals)
        arrived.update(rec.late)
        for r in sorted(arrived, key=arrived.__getitem__):
            if r in lost or r in self.detached or r in self.dead:
                continue
            self._order.append(r)
            self._arrivals[r] = arrived[r]
            self._valid[r] = rec.valid.get(r, 0)
            self._ages[r] = rec.ages.get(r, ())
        self._first_arrival = rec.first_arrival
        self._last_close = now

    def restart_clock(self, now: float) -> None:
        """Judge liveness from ``now`` (every rank has just started): no rank has been silent yet."""
        self._last_beat = {r: now for r in range(self.world_size)}
        self._last_close = now

    # ------------------------------------------------------------------------------------------ decisions
    def try_close(self, now: float) -> Optional[StepRecord]:
        """Close the open version if the codes in decode it (no rank is waited for); else None."""
        order = self._order
        if not order or not self.scheme.admits(order):
            return None
        weights = self.scheme.decoding_weights(order)
        for r in order:
            self._stats[r].admitted += 1
        rec = StepRecord(
            version=self.version,
            admitted=list(order),
            weights=weights,
            arrivals=dict(self._arrivals),
            valid=dict(self._valid),
            ages=dict(self._ages),
            opened_at=self._opened_at or now,
            closed_at=now,
            first_arrival=self._first_arrival or now,
        )
        self._close(rec, now)
        return rec

    def _close(self, rec: StepRecord, now: float) -> None:
        """Keep ``rec`` and open the next version."""
        with self._lock:
            self.records.append(rec)
        self._rejected.pop(rec.version, None)
        self.version += 1
        self._last_close = now
        self._open(now)

    def detach(self, version: int) -> list[int]:
        """Ranks to detach from ``version`` (just closed): those that would hold more than ``max_lag`` aggregates
        they have not applied yet. Call before the decision for ``version`` is sent."""
        out = []
        for r in range(self.world_size):
            if r in self.detached or r in self.byes or r in self.dead:
                continue
            if version - self.progress[r] >= self.max_lag:
                self.detached[r] = version
                out.append(r)
        return out

    def is_alive(self, rank: int, now: float) -> bool:
        """Whether ``rank`` is alive: its stream is up and its last heartbeat is within the window."""
        return rank not in self.dead and now - self._last_beat[rank] <= self.heartbeat_window

    def gone(self, rank: int, now: float) -> bool:
        """Whether ``rank`` is given up on: its stream broke, or it has been silent for the heartbeat window plus
        ``timeout`` (a frozen rank that resumes within that rejoins instead)."""
        return rank in self.dead or now - self._last_beat[rank] > self.heartbeat_window + self.timeout

    def alive(self, now: float) -> list[int]:
        """Ranks alive and still training (not finished)."""
        return [r for r in range(self.world_size) if r not in self.byes and self.is_alive(r, now)]

    def missing(self, now: float) -> list[int]:
        """Ranks that neither finished nor are alive."""
        return [r for r in range(self.world_size) if r not in self.byes and not self.is_alive(r, now)]

    def check(self, now: float) -> None:
        """Raise once the open version has codes but fewer than the ``n - s`` ranks it needs have been alive and
        training for ``timeout`` seconds (heartbeats missed, process gone); raise at once when it can never close
        because too many ranks' codes for it were not finite, or too many ranks finished (said BYE) without sending
        one (ranks that finish normally have closed every version a rank still waits for: this is a rank that
        stopped on an error).

        Raises:
            DivergedError: the ranks that rejected their codes, the gone ones, and what the scheme needs.
            CoordinatorError: naming the missing ranks, the last version closed and how many the scheme tolerates.
        """
        rejected = self._rejected.get(self.version)
        if rejected:
            may_send = set(range(self.world_size)) - rejected - self.dead - self.byes  # (a detached rank may rejoin)
            if not self._could_close(sorted(may_send | set(self._order))):
                raise self.diverged_error(sorted(rejected))
        if self._first_arrival is not None:  # finished ranks send nothing more: a version they cannot close is lost now
            may_send = (set(range(self.world_size)) - self.dead - self.byes) | set(self._order)
            if not self._could_close(sorted(may_send)):
                raise self.missing_error(now)
        active = self.alive(now)
        if len(active) >= self.scheme.wait_for or self._first_arrival is None:
            self._short_since = None
            return
        if self._short_since is None:
            self._short_since = now
        if now - self._short_since > self.timeout:
            raise self.missing_error(now)

    def _could_close(self, ranks: list[int]) -> bool:
        """Whether codes of the open version from ``ranks`` (every rank that has sent one or still may) close it."""
        return bool(ranks) and self.scheme.admits(ranks)

    def diverged_error(self, rejected: list[int]) -> DivergedError:
        """The error for an open version that too many non-finite codes left impossible to close."""
        gone = sorted(self.dead | self.byes)
        return DivergedError(  # the key facts first: workers get this text truncated to a control message
            f"Training diverged: ranks {rejected}'s gradients for version {self.version} are NaN or inf (skipped, "
            f"nonfinite='skip')" + (f" and ranks {gone} are gone" if gone else "") + f", so it cannot close: "
            f"scheme '{self.scheme.name}' needs {self.scheme.wait_for} of {self.world_size} ranks. Lower the "
            "learning rate (or clip gradients); pass nonfinite='raise' to stop at the first such gradient."
        )

    def missing_error(self, now: float) -> CoordinatorError:
        """The error for too few live ranks: the missing ones, the last version closed, what the scheme needs."""
        missing = self.missing(now)
        early = sorted(self.byes)
        return CoordinatorError(  # the key facts first: workers get this text truncated to a control message
            f"Missing ranks: {missing}; the last version closed is {self.version - 1}, "
            f"{now - self._last_close:.1f} s ago (no heartbeat for {self.heartbeat_window:g} s, or process gone)"
            + (f"; ranks {early} finished early" if early else "")
            + f". Version {self.version} cannot close: scheme '{self.scheme.name}' needs "
            f"{self.scheme.wait_for} of {self.world_size} ranks (tolerates "
            f"{self.world_size - self.scheme.wait_for} missing)."
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
        """One dict per rank: ``rank`` and the fields of :data:`STAT_NAMES`."""
        return [s.as_dict(r) for r, s in enumerate(self._stats)]

    def stats_words(self) -> list[float]:
        """The statistics flattened (:data:`STAT_NAMES` per rank), for the STOP message."""
        return [w for s in self._stats for w in s.words()]
