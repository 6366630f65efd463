"""Leader failover on the collective data plane: who leads once the leader died or froze, and what every rank
sends the new leader again.

Leadership is numbered by terms; term 0 is rank 0's. A worker whose comm thread has heard nothing from the leader
for a heartbeat window (its process is gone or frozen) competes for the next term, the members of the data group in
rank order (each waits two heartbeat intervals more per member before it). The first to set the term's key in the
store (``compare_set``) leads it, and since the store outlives every rank (:mod:`~lightning_pgc.runtime.control`)
every rank learns the same winner. The winner starts a coordinator that succeeds the old leader
(:class:`~lightning_pgc.runtime.coordinator.Coordinator`, ``succeeds``) and tells every rank (``lead``). Each term
has a box of its own, so what the old leader read died with it: on ``lead`` every rank sends again the
announcements of the codes it keeps, its collective requests, its rejoin request, its BYE and, if it already left
the data group, its report. The successor then rebuilds the data group as after any lost member: the members report
what they completed, and version ``A + 1`` is decided afresh (:meth:`Coordinator._reconfigure`).

A leader that froze and resumes finds a newer term (in the store, or in a message of it): it steps down and goes on
as a worker. Its successor detached it, so it rejoins by state transfer. Messages of an older term are dropped.
"""

from __future__ import annotations

import logging
import threading
from typing import Optional, Protocol

from lightning_pgc.decisions.leader import Leader
from lightning_pgc.runtime.control import Channel, leader_box, term_key

log = logging.getLogger(__name__)


class SuccessionHost(Protocol):
    """What the terms use of their rank's runtime (:class:`~lightning_pgc.runtime.plane.CollectiveRuntime`)."""

    rank: int
    term: int
    leader_rank: int
    members: list[int]
    progress: int
    heartbeat_interval: float
    heartbeat_window: float
    leader: Optional[Leader]  # this rank's control plane while it leads (a deposed leader's is set to None here)

    @property
    def is_leader(self) -> bool: ...

    def follow(self, term: int, winner: int) -> None: ...


class Succession:
    """The terms of one :class:`~lightning_pgc.runtime.plane.CollectiveRuntime` (its ``failover``)."""

    def __init__(self, runtime: SuccessionHost) -> None:
        self.rt = runtime
        self._lock = threading.Lock()

    def due(self, silent: float) -> bool:
        """Whether this worker now competes for the next term: the leader has been ``silent`` for a heartbeat window
        plus two heartbeat intervals per member before this rank (so the lowest live member normally wins)."""
        rt = self.rt
        if rt.is_leader:
            return False
        order = [r for r in rt.members if r != rt.leader_rank]
        position = order.index(rt.rank) if rt.rank in order else len(order)
        return silent > rt.heartbeat_window + 2 * position * rt.heartbeat_interval

    def elect(self, chan: Channel, silent: float) -> None:
        """Comm thread: compete for the next term (the store keeps the first claim) and follow whoever won it."""
        rt = self.rt
        term = rt.term + 1
        winner = chan.claim(term_key(term), rt.rank)
        if winner is None:  # the term's key holds no rank (dropped and logged): nobody leads it
            return
        log.warning(
            "PGC rank %d: the leader (rank %d) is silent at version %d (no heartbeat for %.1f s: its process is "
            "gone or frozen); rank %d takes over",
            rt.rank,
            rt.leader_rank,
            rt.progress,
            silent,
            winner,
        )
        self._enter(chan, term, winner)

    def learn(self, chan: Channel, term: int) -> None:
        """A message of ``term`` (newer than this rank's) arrived: follow the leader the store names for it."""
        winner = chan.read(term_key(term))
        if winner is not None:
            self._enter(chan, term, winner)

    def settle(self, chan: Channel) -> None:
        """Any thread of a leader that may have been replaced (its process stopped): follow every newer term."""
        while True:
            term = self.rt.term + 1
            winner = chan.read(term_key(term))
            if winner is None:
                return
            self._enter(chan, term, winner)

    def _enter(self, chan: Channel, term: int, winner: int) -> None:
        rt = self.rt
        with self._lock:
            if term <= rt.term:
                return
            if rt.is_leader:
                rt.leader = None  # (its coordinator sees this and ends)
                chan.push(leader_box(rt.term), ("halt",))
                log.warning(
                    "PGC rank %d: rank %d took over as leader while this rank was frozen; this rank goes on as a "
                    "worker (it rejoins by state transfer)",
                    rt.rank,
                    winner,
                )
            rt.follow(term, winner)
