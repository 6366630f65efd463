"""The leader's thread on the collective data plane: admission, liveness and reconfiguration of the data group.

It reads the leader's inbox (announcements, heartbeats, rejects, rejoins, reports, collective requests) and drives a
:class:`~lightning_pgc.decisions.leader.Leader` (or :class:`~lightning_pgc.decisions.bounded.BoundedLeader`): when a
version closes it sends its plan to every member of the data group, whose comm threads all-reduce it.

Reconfiguration. When a member's all-reduce fails (a member died), a member misses its heartbeats for a window
(frozen) or leaves (SIGTERM), the leader asks every member what it completed (``query``). The members that answer,
within a liveness window, form the next configuration: a fresh group over the store. Let ``A`` be the last version
some of them completed: one that completed less is detached (it rejoins by state transfer, as a rank that fell
``max_lag`` behind), and version ``A + 1`` is decided again without the lost ranks' codes (they died with them).
A lost rank counts as dead: at most ``s`` are survived, and beyond that the leader fails naming them.

Succession. The coordinator of a rank that took over from a dead or frozen leader (``succeeds``,
:mod:`~lightning_pgc.runtime.succession`) knows only what its rank knows: the members, who is detached, the versions
it completed. It tells every rank it leads (``lead``: they send it again what the old leader had read) and starts
with a reconfiguration; the codes announced meanwhile wait until it knows ``A`` and opens ``A + 1`` afresh.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, field
from datetime import timedelta
from typing import Optional, Protocol

from lightning_pgc.codes import Scheme
from lightning_pgc.codes.bounded import BoundedScheme
from lightning_pgc.runtime.control import Channel, inbox, leader_box, term_key
from lightning_pgc.runtime.succession import Succession
from lightning_pgc.runtime.wire import DropLog, WireError
from lightning_pgc.decisions.auto_leader import AutoLeader
from lightning_pgc.decisions.leader import CoordinatorError, Leader, NoDonorYet, StepRecord
from lightning_pgc.decisions.header import Header

log = logging.getLogger(__name__)


#: What a given-up rank's inbox keeps (see :meth:`Coordinator._give_up`): its own halt, and the events a rank that
#: comes back acts on (who is detached or attached, a new term, the end); heartbeats, plans, queries and
#: configurations it missed are of no use to it (it left the data group: it rejoins by state transfer).
LASTING = frozenset({"halt", "detach", "attach", "lead", "stop", "abort"})


class CoordinatorHost(Protocol):
    """What the control plane uses of its rank's runtime (:class:`~lightning_pgc.runtime.plane.CollectiveRuntime`):
    the run's layout, what the rank knows of the data group, and the state the training thread and the comm thread
    keep (the coordinator only writes ``alive``)."""

    scheme: Scheme
    rank: int
    world_size: int
    timeout: float
    failover: bool
    heartbeat_interval: float
    heartbeat_window: float
    group_timeout: timedelta
    peer_timeout: float
    kept_versions: int
    term: int
    members: list[int]
    config: int
    progress: int
    alive: int
    allreduce_s: float
    allreduces: int
    leader: Optional[Leader]
    succession: Succession

    @property
    def stopping(self) -> bool: ...

    def leader_channel(self) -> Channel: ...

    def detached_ranks(self) -> dict[int, int]: ...

    def donate_final(self, rank: int, version: int, transfer: str) -> None: ...

    def fail(self, exc: BaseException) -> None: ...


@dataclass
class _Reconfiguration:
    since: float
    why: str
    reports: dict[int, int] = field(default_factory=dict)  # member -> last version it completed


class Coordinator:
    """The control plane of one :class:`~lightning_pgc.runtime.plane.CollectiveRuntime` (the leader's rank)."""

    def __init__(self, runtime: CoordinatorHost, leader: Leader, succeeds: Optional[int] = None) -> None:
        self.rt = runtime
        self.leader = leader
        self.term = runtime.term
        self.box = leader_box(self.term)
        self.members = list(runtime.members)
        self.config = runtime.config
        self.succeeds = succeeds
        self._stash: Optional[list[tuple]] = [] if succeeds is not None else None  # codes before A + 1 is open
        self._configs_seen = {runtime.config}
        self._last_look = 0.0
        self._reconf: Optional[_Reconfiguration] = None
        self._leaving: set[int] = set()
        self._rejoins: list[int] = []
        self._transfers = 0  # state transfers this term named (each gets a rendezvous of its own)
        self._colls: dict[int, set[int]] = {}  # seq -> ranks that asked for it
        self._coll_waiting: tuple[int, float] = (0, 0.0)  # the next collective some rank asked for, and since when
        self._stopping_since: Optional[float] = None  # when this rank's training ended (it said BYE)
        self._issued = 0  # last collective sent to the members
        self._last_beat = 0.0
        self._missing: set[int] = set()
        self._given_up: set[int] = set()  # ranks out of the data group and silent past the liveness window
        self._told: set[int] = set()  # ranks sent a plan since the last heartbeat
        self._allreduces = 0  # all-reduces of this rank whose time the leader has read (scheme="auto")
        self._early_codes = DropLog(f"leader of term {self.term}")  # announcements of versions not open yet

    def run(self) -> None:
        rt = self.rt
        self.chan = rt.leader_channel()
        try:
            if self.succeeds is not None:
                self._take_over(time.monotonic(), self.succeeds)
            self._loop()
        except BaseException as exc:
            if not self._deposed_or_stopped():
                log.error("PGC rank %d: the leader failed: %s", rt.rank, exc)
                rt.fail(exc)
                try:
                    self.chan.push_all(
                        [inbox(r) for r in range(rt.world_size) if r != rt.rank],
                        (self.term, ("abort", f"{type(exc).__name__}: {exc}")),
                    )
                except Exception:
                    pass

    def _send_members(self, message: tuple) -> None:
        self.chan.push_all([inbox(r) for r in self.members], (self.term, message))

    def _send_all(self, message: tuple) -> None:
        """To every rank (one that left the data group may come back: it must hear the leader)."""
        self.chan.push_all([inbox(r) for r in range(self.rt.world_size)], (self.term, message))

    def _take_over(self, now: float, old: int) -> None:
        """A successor's start: what its rank knows (who is detached), the old leader silent, every rank told."""
        rt, leader = self.rt, self.leader
        leader.detached.update(rt.detached_ranks())
        leader.silence(old, now)
        log.warning(
            "PGC rank %d is the leader now (term %d, after rank %d); the next version is decided once the members "
            "reported what they completed",
            rt.rank,
            self.term,
            old,
        )
        self._send_all(("lead", rt.rank))
        self._start(now, f"the leader (rank {old}) is silent")

    def _deposed_or_stopped(self) -> bool:
        """Whether this coordinator ended because its runtime stopped (its connections closed) or a newer term
        replaced it: either way it has nobody to tell."""
        return self.chan.closed or self._deposed()

    def _deposed(self) -> bool:
        """Whether a newer term replaced this coordinator (its rank froze, say): it then ends without a word."""
        rt = self.rt
        if rt.leader is not self.leader:
            return True
        now = time.monotonic()
        if rt.failover and now - self._last_look > rt.heartbeat_interval:
            self._last_look = now
            if self.chan.read(term_key(self.term + 1)) is not None:
                rt.succession.settle(self.chan)
                return True
        return False

    def _loop(self) -> None:
        rt, leader = self.rt, self.leader
        while True:
            batch = [self.chan.pop(self.box)]  # (its rank's heartbeat thread ticks it every interval)
            batch += self.chan.drain(self.box)
            if self._deposed():
                return
            now = time.monotonic()
            for item in batch:
                if item[0] == "halt":
                    return
                self._handle(item, now)
            leader.on_beat(rt.rank, rt.progress, now)
            self._watch(now)
            if self._reconf is not None:
                self._reconfigure(now)
            if self._reconf is None:
                self._decide(now)
            if now - self._last_beat >= rt.heartbeat_interval:
                self._beat(now)
            leader.check(now)
            if rt.stopping and self._finished(now):
                self._send_all(("stop", leader.stats_words()))
                for term in range(1, self.term + 1):  # (the run is over: nobody competes for a term any more)
                    self.chan.forget(term_key(term))
                return

    def _beat(self, now: float) -> None:
        """The leader's heartbeat (the open version, the live ranks) to every rank that got no plan since the last
        one (a plan is heard as the leader's heartbeat, and carries the open version) and is not given up on."""
        rt, leader = self.rt, self.leader
        self._last_beat = now
        rt.alive = len(leader.alive(now))
        skip = self._given_up | self._told
        self._told = set()
        beaten = [inbox(r) for r in range(rt.world_size) if r not in skip]
        self.chan.push_all(beaten, (self.term, ("beat", leader.version, rt.alive)))

    def _finished(self, now: float) -> bool:
        """Whether every other rank said BYE or is gone, or the live ones that did not were waited for
        ``peer_timeout`` since this rank's own BYE (logged, naming them: the run ends without them)."""
        rt, leader = self.rt, self.leader
        if self._stopping_since is None:
            self._stopping_since = now
        others = [p for p in range(rt.world_size) if p != rt.rank and p not in leader.byes]
        live = [p for p in others if not leader.gone(p, now)]
        if live and now - self._stopping_since <= rt.peer_timeout:
            return False
        if live:
            log.warning(
                "PGC: ranks %s did not finish within %g s of the leader's end (they still beat: a step or a "
                "collective of theirs never ends); the run ends without them",
                live,
                rt.peer_timeout,
            )
        gone = [p for p in others if p not in live]
        if gone:
            log.warning(
                "PGC: ranks %s did not finish (process gone, or no heartbeat for %.1f s)",
                gone,
                rt.heartbeat_window + rt.timeout,
            )
        return True

    def _handle(self, item: tuple, now: float) -> None:
        leader, kind = self.leader, item[0]
        if kind == "code":
            _, rank, version, ages, skipped, partition, busy_s = item
            leader.on_beat(rank, version, now)  # (an announcement is its sender's heartbeat: it sends none with it)
            if self._stash is not None:
                self._stash.append(item)
            elif version > leader.version:  # (no rank computes a version before the leader opened it)
                why = f"rank {rank}'s code for version {version} while version {leader.version} is open"
                self._early_codes.drop(self.box, WireError(why, kind))
            elif rank in self.members:
                leader.on_code(Header(version, rank, len(ages), tuple(ages), skipped, partition, busy_s), now)
        elif kind == "beat":
            leader.on_beat(item[1], item[2], now)
        elif kind == "reject":
            log.warning("PGC: rank %d's code for version %d is not finite: not used", item[1], item[2])
            leader.on_reject(item[1], item[2], now)
        elif kind == "rejoin":
            leader.on_beat(item[1], item[2], now)
            if item[1] not in self._rejoins:
                self._rejoins.append(item[1])
        elif kind == "bye":
            _, rank, skipped, leaving = item
            leader.on_bye(rank, skipped)
            if rank in self._rejoins:  # (it gave up waiting for a donor)
                self._rejoins.remove(rank)
            if leaving and rank in self.members:
                log.warning(
                    "PGC: rank %d left at version %d (SIGTERM on that rank); training goes on with %d of %d ranks",
                    rank,
                    leader.version,
                    len(leader.alive(now)),
                    self.rt.world_size,
                )
                self._leaving.add(rank)
                self._start(now, f"rank {rank} left")
        elif kind == "report":
            _, rank, config, completed = item
            if self._stash is not None and rank in self.members:  # a successor: whatever configuration it was in
                self._configs_seen.add(config)
                config = self.config
            if config == self.config and rank in self.members:
                self._start(now, f"rank {rank}'s collective failed")
                assert self._reconf is not None
                self._reconf.reports[rank] = completed
        elif kind == "coll":
            self._colls.setdefault(item[2], set()).add(item[1])

    def _start(self, now: float, why: str) -> None:
        if self._reconf is None:
            self._reconf = _Reconfiguration(since=now, why=why)
            self._send_members(("query", self.config))

    def _watch(self, now: float) -> None:
        """Members silent for a heartbeat window (frozen, or gone) start a reconfiguration."""
        leader = self.leader
        missing = {
            r
            for r in range(self.rt.world_size)
            if r != self.rt.rank and r not in leader.byes and not leader.is_alive(r, now)
        }
        for r in sorted(missing - self._missing):
            log.warning(
                "PGC: rank %d is missing (no heartbeat for %.1f s, or its process is gone) at version %d",
                r,
                self.rt.heartbeat_window,
                leader.version,
            )
        for r in sorted(self._missing - missing - leader.byes):
            log.warning("PGC: rank %d is alive again at version %d", r, leader.version)
        self._missing = missing
        self._give_up(now)
        silent = sorted(r for r in missing if r in self.members)
        if silent and self._reconf is None:
            self._start(now, f"ranks {silent} are silent")

    def _give_up(self, now: float) -> None:
        """Ranks out of the data group that stayed silent past the liveness window (dead, or frozen) get no
        heartbeats until they are heard again, and their inboxes keep only what they need if they come back
        (:data:`LASTING`): an inbox nobody reads stays as small as the events it holds, however long the run."""
        out = set(range(self.rt.world_size)) - set(self.members) - {self.rt.rank}
        given_up = {r for r in out if self.leader.gone(r, now)}  # (one that left alone, too: it said BYE)
        for r in sorted(given_up - self._given_up):
            removed = self.chan.prune(inbox(r), LASTING)
            log.info("PGC: rank %d is given up on: %d messages removed from its inbox", r, removed)
        self._given_up = given_up

    def _reconfigure(self, now: float) -> None:
        rt, leader, rec = self.rt, self.leader, self._reconf
        assert rec is not None
        if self._stash is not None:  # a successor: the members beat the old leader's box until they hear of it
            expected = [r for r in self.members if r != self.succeeds and r not in self._leaving]
        else:
            expected = [r for r in self.members if r not in self._leaving and leader.is_alive(r, now)]
        waited = now - rec.since
        if (
            any(r not in rec.reports for r in expected)
            and waited < rt.group_timeout.total_seconds() + rt.heartbeat_window
        ):
            return
        reporters = sorted(rec.reports)
        lost = [r for r in self.members if r not in rec.reports]
        if not reporters:
            raise CoordinatorError(f"no member of the data group answered within {waited:.1f} s ({rec.why})")
        top = max(rec.reports.values())
        for r in lost:  # (a frozen one is alive again when its heartbeats come back; a dead one never is)
            leader.drop_open(r)
            leader.detached.setdefault(r, top + 1)
            leader.forget(r, leader.version - rt.kept_versions)
        stash, self._stash = self._stash, None
        if stash is None:
            self._reopen(top + 1, set(lost), now)
        else:  # a successor: what the old leader decided after A is unknown here; A + 1 is decided afresh
            leader.reopen(top + 1, now)
            for item in stash:
                if item[1] not in lost:
                    self._handle(item, now)
            self.config = max(self._configs_seen)
            self._issued = min(self._colls, default=1)  # every member asked again for the last collective it ran:
            # it runs again (below), then the next
        for r in reporters:
            if rec.reports[r] < top:
                start = rec.reports[r] + 1
                log.warning(
                    "PGC: rank %d did not complete version %d (others did): detached, it rejoins by state transfer",
                    r,
                    top,
                )
                leader.detached[r] = start
                self._send_all(("detach", start, r))
        for r in lost:
            self._send_all(("detach", top + 1, r))
        self.config += 1
        self.members = reporters
        if lost:
            alive = len([r for r in leader.alive(now) if r not in lost])
            for r in lost:
                if r not in leader.byes:
                    log.warning(
                        "PGC: rank %d died at version %d or froze (%s); training goes on without it: %d of %d "
                        "ranks alive, scheme '%s' needs %d",
                        r,
                        top + 1,
                        rec.why,
                        alive,
                        rt.world_size,
                        rt.scheme.name,
                        rt.scheme.wait_for,
                    )
            log.warning(
                "PGC: ranks %s left the data group at version %d; training goes on with ranks %s",
                lost,
                top + 1,
                reporters,
            )
        self._send_members(("conf", self.config, reporters, top + 1))
        self._reconf = None
        self._leaving.clear()
        if self._issued > 0:  # the last collective may not have completed everywhere: run it again (the members
            self._issued -= 1  # that completed it give the same contribution and keep their result)

    def _reopen(self, version: int, lost: set[int], now: float) -> None:
        """Version ``version`` is the open one again, without the ``lost`` ranks' codes."""
        leader = self.leader
        if leader.version == version:
            for r in lost:
                leader.drop_open(r)
        elif leader.version == version + 1:
            leader.reopen_decided(version, lost, now)
        else:
            raise CoordinatorError(
                f"the members completed versions up to {version - 1}, but version {leader.version} "
                "is open: the data group lost a decided version"
            )

    def _decide(self, now: float) -> None:
        rt, leader = self.rt, self.leader
        while self._rejoins:
            rank = self._rejoins[0]
            try:
                u, donor = leader.on_rejoin(rank, rt.rank, rt.stopping)
            except NoDonorYet:
                break  # (asked again at every loop: the leader donates once its own training ended)
            self._rejoins.pop(0)
            self._transfers += 1
            transfer = f"{self.term}.{self._transfers}"
            self._send_all(("attach", u, rank, donor, transfer))
            if rank not in self.members:  # it left the data group (frozen): every member has every version before
                self.config += 1  # u queued before this configuration, which takes it back from u on
                self.members = sorted(self.members + [rank])
                log.warning(
                    "PGC: rank %d rejoins the data group at version %d (configuration %d)", rank, u, self.config
                )
                self._send_members(("conf", self.config, self.members, u))
            if rt.stopping and donor == rt.rank:
                rt.donate_final(rank, u, transfer)
        rec = leader.try_close(now)
        if rec is not None:
            for r in leader.detach(rec.version):
                log.warning(
                    "PGC: rank %d is more than %d versions behind at version %d: detached (it rejoins by "
                    "state transfer)",
                    r,
                    leader.max_lag,
                    rec.version,
                )
                self._send_all(("detach", rec.version, r))
            if isinstance(leader, AutoLeader):
                if rt.allreduces != self._allreduces:  # the all-reduce time this rank measured last
                    self._allreduces = rt.allreduces
                    leader.on_allreduce(rt.allreduce_s)
                notes: tuple[int, ...] = leader.notes(rec.version)
            else:
                notes = _table(rt, rec)
            self._send_members(("decide", rec.version, _compact(rec), notes))
            self._told.update(self.members)
        pending = [rank for rank in self.members if rank not in leader.byes]
        while self._issued + 1 in self._colls and set(pending) <= self._colls[self._issued + 1]:
            self._issued += 1
            self._colls.pop(self._issued - 16, None)
            self._send_members(("coll", self._issued))
        self._check_collective(now, pending)

    def _check_collective(self, now: float, pending: list[int]) -> None:
        """The next collective waits for members that never call it: ``peer_timeout`` after the first call was seen,
        fail naming them (every rank's collective then raises with this error)."""
        seq = self._issued + 1
        if seq not in self._colls:
            return
        if self._coll_waiting[0] != seq:  # (a collective run again after a reconfiguration counts afresh)
            self._coll_waiting = (seq, now)
        if now - self._coll_waiting[1] <= self.rt.peer_timeout:
            return
        missing = sorted(set(pending) - self._colls.get(seq, set()))
        raise CoordinatorError(
            f"Lightning's collective {seq} (a barrier, broadcast or reduce): ranks {missing} did not call it within "
            f"{self.rt.peer_timeout:g} s of the first rank that did; every rank must call the same collectives "
            "(e.g. `self.log(..., sync_dist=True)` on every rank, not under `if self.global_rank == 0`)"
        )


def _compact(rec: StepRecord) -> list:
    """The plan as sent: the ranks, when every code is its rank's own of this version (a list of at most ``n``
    entries), else ``(partition, rank, version)`` entries."""
    plan = rec.plan()
    if all(key == rank and v == rec.version for key, rank, v in plan):
        return [rank for _, rank, _ in plan]
    return [tuple(p) for p in plan]


def _table(rt: CoordinatorHost, rec: StepRecord) -> tuple[int, ...]:
    """What workers read to pick their next partition under ``choice="oldest"``: each partition's entry age."""
    scheme = rt.scheme
    if not isinstance(scheme, BoundedScheme) or scheme.choice != "oldest":  # (the one scheme with a choice)
        return ()
    return tuple(rec.version - v if k >= 0 else scheme.window for _, k, v in rec.plan())
