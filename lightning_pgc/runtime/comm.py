"""The comm thread of the collective runtime: the leader's messages in order, one all-reduce per decided version.

It runs independently of the training thread, so a rank still computing version ``t`` takes part in ``t``'s
all-reduce on time (with zeros) and keeps the aggregate; it also runs Lightning's collectives on the data group in
the order the leader sets, and joins each new configuration of the group. A mixin of
:class:`~lightning_pgc.runtime.plane.CollectiveRuntime`: what it uses of that class is :class:`CommHost`.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
import threading
import time
from datetime import timedelta
from typing import Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pgc.codes import Scheme
from lightning_pgc.runtime.collectives import CollectiveError, Contribution
from lightning_pgc.runtime.control import Announcement, Bye, Channel, inbox, leader_box, live_store
from lightning_pgc.runtime.group import DataGroup, open_group
from lightning_pgc.runtime.rejoin import StateFn
from lightning_pgc.runtime.succession import Succession
from lightning_pgc.decisions.leader import STAT_NAMES
from lightning_pgc.runtime.aggregates import Aggregates, Code, PGCTimeoutError
from lightning_pgc.codes.shares import contribute

log = logging.getLogger(__name__)


class CommHost(ABC):
    """What the comm thread uses of the runtime it runs in (:class:`~lightning_pgc.runtime.plane.CollectiveRuntime`
    sets all of it in its constructor): the run's layout, the leadership, and the state it shares with the training
    thread and the heartbeats."""

    scheme: Scheme
    rank: int
    world_size: int
    device: torch.device
    up_dtype: torch.dtype
    down_dtype: torch.dtype
    coded_numel: int
    agg_numel: int
    data_backend: str
    prefix: str
    kept_versions: int
    failover: bool
    heartbeat_interval: float
    heartbeat_window: float
    group_timeout: timedelta
    peer_timeout: float
    term: int
    leader_rank: int
    members: list[int]
    succession: Succession
    aggregates: Aggregates
    progress: int
    alive: int
    final_stats: Optional[list[dict[str, float]]]
    _frontier: int
    _lock: threading.Lock
    _codes: dict[int, Code]
    _free_codes: list[Code]
    _announced: dict[int, Announcement]
    _rejoining: Optional[int]
    _bye: Optional[Bye]
    _state_fn: Optional[StateFn]
    _leader_heard: float
    _comm_free_at: float
    _stopping: threading.Event
    _beats_done: threading.Event
    _ctl: Channel
    _chan: Channel
    _group_store: Optional[dist.Store]
    _attach_cond: threading.Condition
    _attachments: dict[int, list[tuple[int, int, str]]]
    _attach_info: Optional[tuple[int, int, str]]
    _attached: threading.Event

    @property
    @abstractmethod
    def is_leader(self) -> bool: ...

    @abstractmethod
    def fail(self, exc: BaseException) -> None: ...

    @abstractmethod
    def failure(self) -> Optional[BaseException]: ...

    @abstractmethod
    def _check_leader(self, doing: str) -> None: ...

    @abstractmethod
    def _leader_box(self) -> str: ...

    @abstractmethod
    def _set_gap(self, rank: int, version: int, detach: bool) -> None: ...

    @abstractmethod
    def _receives(self, rank: int, version: int) -> bool: ...

    @abstractmethod
    def _donate(self, version: int, state_fn: StateFn) -> None: ...


class CommLoop(CommHost):
    """The comm thread's methods (mixed into :class:`~lightning_pgc.runtime.plane.CollectiveRuntime`, which sets the
    state below in its constructor)."""

    group: Optional[DataGroup]  # the data group of configuration ``config`` (None: not a member now)
    config: int
    completed: int  # the last version whose all-reduce this rank completed
    _next: int  # the version whose decision it runs next
    _waiting: bool
    _busy: bool
    _stream: Optional[torch.cuda.Stream]
    _scratch: Optional[Tensor]  # the sum buffer when the payload's dtype is wider than the aggregate's
    allreduce_s: float
    allreduces: int
    data_bytes: int
    _coll_cond: threading.Condition
    _coll_seq: int
    _coll_mine: dict[int, Contribution]  # seq -> this rank's contribution, until the collective ran
    _coll_done: dict[int, dict[int, Contribution]]  # seq -> every member's, until the training thread takes them
    _coll_saved: dict[int, Optional[Contribution]]
    _coll_history: dict[int, dict[int, Contribution]]
    _coll_replay: dict[int, dict[int, Contribution]]

    def _comm(self) -> None:
        try:
            if self._stream is not None:
                with torch.cuda.stream(self._stream):
                    self._serve()
            else:
                self._serve()
        except BaseException as exc:
            log.error("PGC rank %d: comm thread failed: %r", self.rank, exc)
            self.fail(exc)

    def _serve(self) -> None:
        """The comm thread: the leader's messages in order; an all-reduce per decided version."""
        chan = self._chan
        while True:
            term, msg = chan.pop(inbox(self.rank))
            kind = msg[0]
            if kind == "halt":
                return
            if kind == "tick":  # this rank's own, every heartbeat interval, with the time it was sent
                if self._stopping.is_set() and self._beats_done.is_set():
                    return
                if not self._silence(chan, msg[1]):
                    return
                continue
            if 0 <= term < self.term:
                continue  # from a leader that was replaced
            if term > self.term:
                self.succession.learn(chan, term)
            self._leader_heard = time.monotonic()
            if kind == "beat":
                self._frontier, self.alive = msg[1], msg[2]
            elif kind == "decide":
                self._frontier = msg[1] + 1  # (the open version: the leader sends no heartbeat with a plan)
                if not self._waiting and msg[1] == self._next:
                    self._run_version(msg[1], msg[2], msg[3])
            elif kind == "detach":
                self._set_gap(msg[2], msg[1], detach=True)
            elif kind == "attach":
                _, version, rank, donor, transfer = msg
                self._set_gap(rank, version, detach=False)
                with self._attach_cond:
                    self._attachments.setdefault(version, []).append((rank, donor, transfer))
                    self._attach_cond.notify_all()
                if rank == self.rank:
                    self._attach_info = (version, donor, transfer)
                    self._attached.set()
            elif kind == "query":
                if msg[1] == self.config and not self._waiting:
                    self._leave_group(chan)
            elif kind == "conf":
                self._configure(msg[1], msg[2], msg[3])
            elif kind == "coll":
                if not self._waiting:
                    self._run_collective(msg[1])
            elif kind == "stop":
                self._read_final_stats(msg[1])
                if not self._stopping.is_set():  # (the leader gave up on this rank's BYE, or on it)
                    self.fail(RuntimeError(f"PGC rank {self.rank}: the leader ended the run before this rank did"))
                return
            elif kind == "lead":
                self._resend(chan)
            elif kind == "abort":
                self.fail(RuntimeError(f"the PGC leader failed: {msg[1]}"))
                return

    def _silence(self, chan: Channel, sent: float) -> bool:
        """On a tick sent at ``sent``: a leader silent too long is replaced (``failover``) or ends this rank (returns
        False). The silence is counted up to the tick's sending: the leader's messages sent before it were read
        before it, and those sent after it may still wait behind it (the comm thread was inside a collective)."""
        silent = sent - self._leader_heard
        if self.failover:
            if self.succession.due(silent):
                self.succession.elect(chan, silent)
            return True
        if not self.is_leader and silent > 2 * self.heartbeat_window:
            self.fail(
                PGCTimeoutError(
                    f"PGC rank {self.rank} lost the leader (rank {self.leader_rank}): no "
                    f"heartbeat for {silent:.1f} s; its process is gone or frozen"
                )
            )
            return False
        return True

    def _resend(self, chan: Channel) -> None:
        """On a new leader's ``lead``: send it again what the old leader's box may have held (see
        :mod:`~lightning_pgc.runtime.succession`)."""
        box = leader_box(self.term)
        floor = -1 if self.scheme.reuses_codes else self.completed  # (other codes serve their own version only)
        with self._lock:
            announced = [self._announced[v] for v in sorted(self._announced) if v > floor]
        for message in announced:
            chan.push(box, message)
        with self._coll_cond:
            seqs = sorted(set(self._coll_saved) | set(self._coll_mine))
        for seq in seqs:
            chan.push(box, ("coll", self.rank, seq))
        request: Optional[int] = self._rejoining
        if request is not None and not self._attached.is_set():
            chan.push(box, ("rejoin", self.rank, request))
        if self._bye is not None:
            chan.push(box, self._bye)
        if self._waiting:
            chan.push(box, ("report", self.rank, self.config, self.completed))

    def _leave_group(self, chan: Channel) -> None:
        """Tell the leader what this rank completed and wait for the next configuration."""
        self._waiting = True
        chan.push(self._leader_box(), ("report", self.rank, self.config, self.completed))

    def _abandon_group(self) -> None:
        """A collective of this group failed or did not finish in time: close the group now (NCCL: abort, which ends
        its kernels before NCCL's watchdog would), whatever it left in its buffers is never used, and report."""
        group, self.group = self.group, None
        if group is not None:
            group.close()
        self._leave_group(self._chan)

    def _configure(self, number: int, members: list[int], version: int) -> None:
        """Join configuration ``number`` (its group, from ``version`` on), or stay out of it."""
        if self.group is not None:
            self.group.close()
            self.group = None
        self.config, self._waiting = number, False
        self.members = list(members)
        self._next = version
        self.aggregates.discard_from(version)
        if self.rank not in members:
            self._waiting = True
            return
        try:
            self._busy = True
            self.group = self._open_group(number, members)
        except Exception as exc:
            log.warning("PGC rank %d: building the data group of configuration %d failed: %r", self.rank, number, exc)
            self._leave_group(self._chan)
        else:
            log.info("PGC rank %d: configuration %d with ranks %s from version %d", self.rank, number, members, version)
        finally:
            self._busy = False
            self._leader_heard = time.monotonic()

    def _open_group(self, number: int, members: list[int]) -> Optional[DataGroup]:
        """The data group of configuration ``number`` over this rank's group store (None: not a member)."""
        return open_group(
            live_store(self._group_store),
            self.prefix,
            number,
            members,
            self.rank,
            self.device,
            self.group_timeout,
            self.data_backend,
        )

    def _run_version(self, version: int, plan: Sequence[tuple[int, int, int]], table: tuple[int, ...]) -> None:
        """Contribute this rank's share of ``version``'s aggregate to the all-reduce; keep the result.

        The thread counts as busy for all of it, not only the all-reduce: allocating the sum buffer, the weighted
        contribution and the narrowing copy are model-sized and can take seconds on a loaded machine, and the leader's
        messages wait in the queue meanwhile (they are not its silence)."""
        assert self.group is not None
        self._busy = True
        try:
            self._reduce_version(version, plan, table)
        finally:
            self._busy = False
            self._comm_free_at = time.monotonic()

    def _reduce_version(self, version: int, plan: Sequence[tuple[int, int, int]], table: tuple[int, ...]) -> None:
        assert self.group is not None
        plan = _expand(version, plan)
        buf = self._sum_buffer()
        with self._lock:
            codes = {v: c for v, c in self._codes.items()}
        for code in codes.values():
            if code.event is not None:
                torch.cuda.current_stream(self.device).wait_event(code.event)
        contribute(self.scheme, plan, self.rank, {v: c.flat for v, c in codes.items()}, self.coded_numel, buf)
        if self._stream is not None:
            read = torch.cuda.current_stream(self.device).record_event()
            for code in codes.values():
                code.read = read
        try:
            started = time.monotonic()
            self.group.all_reduce(buf, f"the all-reduce of version {version}")  # (until it finished on the device)
            self.allreduce_s, self.allreduces = time.monotonic() - started, self.allreduces + 1
        except Exception as exc:
            log.warning(
                "PGC rank %d: the all-reduce of version %d failed (%r); the data group is reconfigured",
                self.rank,
                version,
                exc,
            )
            self._abandon_group()
            return
        # only now is the aggregate complete on this rank: reported (``completed``), published and applied from here
        self.completed, self._next = version, version + 1
        m = self.group.size
        self.data_bytes += 2 * (m - 1) * buf.numel() * buf.element_size() // m
        out = buf if buf.dtype == self.down_dtype else self._narrow(buf)
        event = torch.cuda.current_stream(self.device).record_event() if self._stream is not None else None
        if self._receives(self.rank, version):
            self.aggregates.put(version, out, event, tuple(table))
        else:
            self.aggregates.release(out, event)
        with self._lock:
            for v in [v for v in self._codes if v + self.kept_versions <= version + 1]:
                self._free_codes.append(self._codes.pop(v))
                self._announced.pop(v, None)

    def _sum_buffer(self) -> Tensor:
        if self.up_dtype == self.down_dtype:
            return self.aggregates.buffer(lambda e: torch.cuda.current_stream(self.device).wait_event(e))
        scratch = self._scratch
        if scratch is None:
            scratch = self._scratch = torch.empty(self.agg_numel, dtype=self.up_dtype, device=self.device)
        return scratch

    def _narrow(self, buf: Tensor) -> Tensor:
        out = self.aggregates.buffer(lambda e: torch.cuda.current_stream(self.device).wait_event(e))
        out.copy_(buf)  # Tandon codes: summed in float64, rounded once
        return out

    def _run_collective(self, seq: int) -> None:
        """Lightning's collective ``seq`` among the members: an all-gather on the data group."""
        assert self.group is not None
        with self._coll_cond:
            again = seq in self._coll_saved  # run again after a reconfiguration: this rank has its result
            mine = self._coll_saved[seq] if again else self._coll_mine.get(seq)
        try:
            self._busy = True
            got = self.group.all_gather_objects(mine)
        except Exception as exc:
            log.warning("PGC rank %d: collective %d failed (%r); the data group is reconfigured", self.rank, seq, exc)
            self._abandon_group()
            return
        finally:
            self._busy = False
            self._comm_free_at = time.monotonic()
        with self._coll_cond:
            if not again:
                self._coll_saved = {seq: self._coll_mine.pop(seq, None)}
                self._coll_done[seq] = {r: v for r, v in got.items() if v is not None}
                self._coll_history[seq] = self._coll_done[seq]
                self._coll_history.pop(seq - _HISTORY, None)
            self._coll_cond.notify_all()

    def gather(self, op: str, obj: object) -> dict[int, object]:
        """Training thread: every member's contribution to Lightning's next collective (an all-gather run by the comm
        threads on the data group in the order the leader sets, so it never interleaves differently with the
        all-reduces on two ranks); see :class:`~lightning_pgc.runtime.collectives.LiveCollectives`."""
        self._coll_seq += 1
        seq = self._coll_seq
        with self._coll_cond:
            replayed = self._coll_replay.pop(seq, None)
            if replayed is None:
                self._coll_mine[seq] = (op, obj)
            else:
                self._coll_history[seq] = replayed
        if replayed is not None:  # run by the others in a step this rank skipped to rejoin: their result
            return _checked(seq, replayed)
        self._ctl.push(self._leader_box(), ("coll", self.rank, seq))
        # (the leader names the members that never call it, peer_timeout after the first caller: this comes later)
        bound = self.peer_timeout + self.group_timeout.total_seconds()
        deadline = time.monotonic() + bound
        with self._coll_cond:
            while seq not in self._coll_done:
                failure = self.failure()
                if failure is not None:
                    raise RuntimeError(f"PGC collective {seq} abandoned: {failure}") from failure
                if time.monotonic() > deadline:
                    exc = PGCTimeoutError(
                        f"PGC rank {self.rank}: Lightning's collective {seq} (a barrier, broadcast or reduce) did not "
                        f"run within {bound:g} s: the leader did not start it, so some member never called it"
                    )
                    self.fail(exc)
                    raise exc
                if not self._coll_cond.wait(self.heartbeat_interval):
                    self._coll_cond.release()
                    try:
                        self._check_leader(f"in collective {seq} (a barrier, broadcast or reduce)")
                        state_fn = self._state_fn
                        if state_fn is not None:  # (at a step boundary: see StateTransfer.state_tree)
                            self._donate(self.progress + 1, lambda: state_fn(boundary=True))
                    finally:
                        self._coll_cond.acquire()
            got = self._coll_done.pop(seq)
        return _checked(seq, got)

    def _read_final_stats(self, words: Optional[list[float]]) -> None:
        if words is None:
            return
        k = len(STAT_NAMES)
        self.final_stats = []
        for r in range(self.world_size):
            row = dict(zip(STAT_NAMES, words[k * r : k * (r + 1)]))
            self.final_stats.append({"rank": r, **{n: v if n == "mean_lag_s" else int(v) for n, v in row.items()}})


#: collective results a rank keeps for a rank that rejoins through it
_HISTORY = 64


def _expand(version: int, plan: Sequence) -> list[tuple[int, int, int]]:
    """A plan as sent (ranks, for codes of ``version`` keyed by rank; or full entries) as full entries."""
    return [(p, p, version) if isinstance(p, int) else tuple(p) for p in plan]


def _checked(seq: int, got: dict[int, Contribution]) -> dict[int, object]:
    """The contributions of collective ``seq`` by rank, once every rank called the same operation."""
    ops = {r: o for r, (o, _) in got.items()}
    if len(set(ops.values())) > 1:
        raise CollectiveError(
            f"PGC collective {seq}: the ranks called different collectives: {ops}; every rank "
            "must call the same collectives in the same order (e.g. `self.log(..., "
            "sync_dist=True)` on every rank, not under `if self.global_rank == 0`)"
        )
    return {r: v for r, (_, v) in sorted(got.items())}
