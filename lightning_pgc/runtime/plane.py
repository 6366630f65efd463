"""The collective runtime: the coded aggregate as one all-reduce per version on a dedicated data group.

Per version ``t``:

1. a rank encodes its code (:meth:`CollectiveRuntime.new_code`, :meth:`~CollectiveRuntime.submit`): the code stays
   on the rank, only a few-byte announcement goes to the leader;
2. the leader closes ``t`` with a plan (the codes its aggregate uses) and sends it to every member of the data
   group (:mod:`~lightning_pgc.runtime.coordinator`);
3. every member's comm thread contributes its share of the decode (:func:`~lightning_pgc.codes.shares.contribute`;
   zeros if the plan names none of its codes) to one ``all_reduce``; the sum is the decoded aggregate, the same
   bits on every member;
4. the training thread takes it (:meth:`~CollectiveRuntime.wait`) and applies it.

The comm thread runs the all-reduces in version order, independently of the training thread: a rank still
computing version ``t`` joins ``t``'s all-reduce on time with zeros and keeps the aggregate for its training thread.
On CUDA the comm thread runs on its own stream.

Faults reconfigure the data group: the leader asks every member what it completed, and the ones that answer build
a fresh group over the store; the version nobody completed is decided again without the lost ranks
(:class:`~lightning_pgc.runtime.coordinator.Coordinator`). With ``failover`` a dead or frozen leader is replaced by
a live member (:mod:`~lightning_pgc.runtime.succession`). A rank frozen inside an all-reduce costs the others
at most one liveness window (the group's timeout); a slow or sleeping rank costs them nothing.
"""

from __future__ import annotations

import itertools
import logging
import threading
import time
from datetime import timedelta
from typing import Callable, Optional, Sequence

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pgc.codes import Scheme
from lightning_pgc.codes.bounded import BoundedScheme
from lightning_pgc.runtime.aggregates import Aggregates, Code, PGCTimeoutError
from lightning_pgc.runtime.collectives import Contribution, LiveCollectives
from lightning_pgc.runtime.comm import CommLoop
from lightning_pgc.runtime.coordinator import Coordinator
from lightning_pgc.runtime.rejoin import Rejoins, StateFn
from lightning_pgc.runtime.control import Announcement, Bye, Channel, inbox, leader_box, live_store
from lightning_pgc.runtime.group import DataGroup, data_backend_for
from lightning_pgc.decisions.leader import Leader, StepRecord
from lightning_pgc.runtime.succession import Succession

log = logging.getLogger(__name__)

_RUNS = itertools.count()  # runtime starts in this process: every rank starts them in the same order


class PGCInterrupted(RuntimeError):
    """This rank was told to stop (SIGTERM) while it waited on the others: it leaves instead of waiting on."""


class PGCDetached(RuntimeError):
    """This rank fell more than ``max_lag`` versions behind (or left the data group): no aggregate comes until it
    rejoins."""


# (Rejoins first: CommHost, CommLoop's interface, declares Rejoins._donate abstract, and a name resolves to the first
# class of the MRO that defines it; the other order leaves _donate abstract and the class refuses to be built.)
class CollectiveRuntime(Rejoins, CommLoop):
    """Every rank's runtime on the collective data plane; the leader's also runs the control plane.

    The worker API: :meth:`start`; per version :meth:`published`, :meth:`detached` /
    :meth:`rejoin`, :meth:`new_code` and :meth:`submit` (or :meth:`reject`), :meth:`wait`, :meth:`serve_rejoins`,
    :meth:`release`; :meth:`stop` at the end.

    Args:
        scheme: the straggler-tolerance scheme.
        store: the store of the control plane (see :mod:`~lightning_pgc.runtime.control`).
        rank, world_size: this rank and the number of ranks.
        numel: elements of a code (gradient, loss, buffers, padding); coded_numel: where the decoded region ends;
            agg_numel: elements of an aggregate (the payload without padding).
        down_dtype: dtype of the aggregate; codes and the all-reduce use ``scheme.payload_dtype``.
        start_version: the first version of this fit; timeout, max_lag: as for the leader.
        make_leader: the control plane's class (e.g. :class:`~lightning_pgc.decisions.bounded.BoundedLeader`).
        heartbeat_interval, heartbeat_misses: liveness; the window is their product.
        device: where codes and aggregates live (``cuda``: a comm stream, and NCCL unless ``data_backend`` says
            otherwise; else gloo).
        prefix: the run's namespace in the store (the same on every rank, new for every start).
        keep_versions: versions a code may serve (bounded staleness: the largest window the leader may widen to);
            default ``scheme.window`` for schemes that reuse codes, else 1.
        failover: when the leader dies or freezes, a live member takes over (the store must outlive rank 0:
            :func:`~lightning_pgc.runtime.control.host_store`); without it every rank fails naming the lost leader.
        data_backend: the data group's backend, ``nccl`` or ``gloo``; by default NCCL on CUDA, gloo elsewhere
            (:func:`~lightning_pgc.runtime.group.data_backend_for`); ``gloo`` on CUDA lets ranks share one GPU.
    """

    def __init__(
        self,
        scheme: Scheme,
        store: dist.Store,
        rank: int,
        world_size: int,
        numel: int,
        coded_numel: int,
        agg_numel: int,
        down_dtype: torch.dtype,
        start_version: int,
        timeout: float,
        max_lag: int,
        make_leader: Optional[Callable[..., Leader]] = None,
        heartbeat_interval: float = 0.2,
        heartbeat_misses: int = 15,
        device: torch.device = torch.device("cpu"),
        prefix: Optional[str] = None,
        keep_versions: Optional[int] = None,
        failover: bool = False,
        data_backend: Optional[str] = None,
    ) -> None:
        if heartbeat_interval <= 0 or heartbeat_misses < 1:
            raise ValueError(
                f"need heartbeat_interval > 0 and heartbeat_misses >= 1, got {heartbeat_interval}, {heartbeat_misses}"
            )
        self.scheme, self.rank, self.world_size = scheme, rank, world_size
        self.store: Optional[dist.Store] = store  # (None once stopped: every connection goes with the runtime)
        self.numel, self.coded_numel, self.agg_numel = numel, coded_numel, agg_numel
        self.up_dtype: torch.dtype = scheme.payload_dtype
        self.down_dtype = down_dtype
        self.device = torch.device(device)
        self.data_backend = data_backend_for(self.device, data_backend)  # (an unusable one fails here, not in a thread)
        self.timeout, self.max_lag = float(timeout), int(max_lag)
        self.heartbeat_interval = float(heartbeat_interval)
        self.heartbeat_window = self.heartbeat_interval * heartbeat_misses
        self.group_timeout = timedelta(seconds=self.heartbeat_window + self.timeout)  # one liveness window
        self.prefix = prefix if prefix is not None else f"pgc/{next(_RUNS)}"
        self.kept_versions = keep_versions or _kept_versions(scheme)
        self.failover = bool(failover)
        self.term = 0  # the leader's term (see :mod:`~lightning_pgc.runtime.succession`)
        self.leader_rank = 0
        self.members = list(range(world_size))  # the data group's, as the last configuration named them
        self._make_leader = make_leader or Leader
        self.leader: Optional[Leader] = None
        self.successions: list[tuple[int, int]] = []  # (old leader, new leader) of every change of term
        self.succession = Succession(self)
        self.aggregates = Aggregates(agg_numel, down_dtype, self.device)
        self.error: Optional[BaseException] = None
        self.skipped = self.rejected = 0
        self.progress = start_version
        self.alive = world_size
        self._frontier = start_version
        self.final_stats: Optional[list[dict[str, float]]] = None
        self._codes: dict[int, Code] = {}
        self._free_codes: list[Code] = []
        self._code_count = 0
        self._lock = threading.Lock()
        self._gaps: dict[int, list[tuple[int, Optional[int]]]] = {}
        self._attachments: dict[int, list[tuple[int, int, str]]] = {}  # version -> (recipient, donor, transfer)
        self._donated: dict[int, set[str]] = {}  # version -> transfers sent
        self._attach_cond = threading.Condition()
        self._attach_info: Optional[tuple[int, int, str]] = None
        self._attached = threading.Event()
        self._state_fn: Optional[StateFn] = None
        self._final_requests: list[tuple[int, int, str]] = []
        self.transfers: list[dict[str, object]] = []  # the state transfers this rank sent or received
        self._leader_heard = self._resumed_at = self._last_check = self._comm_free_at = time.monotonic()
        self._last_settle = 0.0
        self._announced_at = 0.0  # when this rank last announced a code (monotonic seconds)
        self._announced: dict[int, Announcement] = {}  # version -> the announcement of the code kept for it
        self._rejoining: Optional[int] = None  # the version this rank asked to rejoin at (until attached)
        self._bye: Optional[Bye] = None  # the BYE this rank said
        self._stopping = threading.Event()
        self._interrupted = threading.Event()  # SIGTERM: every wait of the training thread ends (interrupt())
        self._beats_done = threading.Event()
        self._stopped = False
        self._threads: list[threading.Thread] = []
        # every connection this rank uses, opened now (see :mod:`~lightning_pgc.runtime.control`): the training
        # thread's, the comm thread's, the heartbeat thread's, one for leading (rank 0, or any successor), and the
        # one the comm thread builds each data group over
        self._ctl = Channel(store, self.prefix, world_size)
        self._chan = Channel(store, self.prefix, world_size)
        self._beat_chan = Channel(store, self.prefix, world_size)
        self._lead_chan: Optional[Channel] = Channel(store, self.prefix, world_size) if rank == 0 or failover else None
        self._channels = [c for c in (self._ctl, self._chan, self._beat_chan, self._lead_chan) if c is not None]
        self._group_store: Optional[dist.Store] = store.clone()
        self._xfer_store: Optional[dist.Store] = store.clone()  # the training thread's, for state transfers' rendezvous
        # for the ranks to meet (the store's: the process group's timeout); torch's stubs leave out the `timeout`
        # property that its Store has
        self._start_timeout: timedelta = store.timeout  # type: ignore[attr-defined]
        # how long this rank waits for what other live ranks must do (call a Lightning collective, say BYE, donate
        # its state): the store's timeout too, which is the process group's (``process_group_timeout``) as under ddp
        self.peer_timeout = self._start_timeout.total_seconds()
        self.allreduce_s, self.allreduces = 0.0, 0  # the last all-reduce's seconds (read by scheme="auto"), how many
        self.data_bytes = 0  # bytes this rank's all-reduces sent (as many are received): a ring's 2 (m-1)/m payloads
        # comm thread state
        self.group: Optional[DataGroup] = None
        self.config = 0
        self.completed = start_version - 1
        self._next = start_version
        self._waiting = False  # the comm thread left its group and waits for the next configuration
        self._busy = False  # the comm thread is inside a collective (it reads no message until it ends, within the
        # group's timeout)
        self._stream = torch.cuda.Stream(self.device) if self.device.type == "cuda" else None
        self._scratch: Optional[Tensor] = None
        self._tables: dict[int, tuple[int, ...]] = {}  # the table ages of the last aggregate taken (bounded)
        self._coll_cond = threading.Condition()
        self._coll_mine: dict[int, Contribution] = {}
        self._coll_done: dict[int, dict[int, Contribution]] = {}
        self._coll_saved: dict[int, Optional[Contribution]] = {}  # the last collective's own contribution
        self._coll_history: dict[int, dict[int, Contribution]] = {}  # the last results (a rejoiner replays them)
        self._coll_replay: dict[int, dict[int, Contribution]] = {}  # a donor's results, for collectives this
        # rank calls in the steps it skips before the version it rejoins at
        self._coll_seq = 0  # Lightning's collectives this rank called
        self.collectives = LiveCollectives(self)
        self._coordinator: Optional[Coordinator] = None
        if rank == 0:
            self._lead(start_version)

    def _lead(self, start_version: Optional[int] = None, succeeds: Optional[int] = None) -> None:
        """Make this rank the leader: the first one (``start_version``), or the successor of leader ``succeeds`` (its
        control plane starts at the first version this rank did not complete and is corrected from the reports)."""
        version = start_version if start_version is not None else self.completed + 1
        leader = self._make_leader(
            self.scheme, self.world_size, version, self.timeout, self.max_lag, self.heartbeat_window
        )
        coordinator = self._coordinator = Coordinator(self, leader, succeeds=succeeds)
        self.leader = leader
        if succeeds is not None:
            self._spawn(coordinator.run, "pgc-leader")

    def leader_channel(self) -> Channel:
        """The connection of this rank's control plane (opened at construction; a rank that leads a second time
        opens another)."""
        chan, self._lead_chan = self._lead_chan, None
        if chan is None:
            chan = Channel(live_store(self.store), self.prefix, self.world_size)
            self._channels.append(chan)
        return chan

    def _leader_box(self) -> str:
        return leader_box(self.term)

    @property
    def is_leader(self) -> bool:
        return self.leader is not None

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Wait for every rank (within the store's timeout), build the first data group and start the comm,
        heartbeat and (leader) control threads; liveness is judged from here on."""
        ready = [f"{self.prefix}/ready/{r}" for r in range(self.world_size)]
        store = live_store(self._group_store)
        store.set(ready[self.rank], "1")
        store.wait(ready, self._start_timeout)
        self.group = self._open_group(0, list(range(self.world_size)))
        store.delete_key(ready[self.rank])  # (every rank is past its wait: each built the group)
        now = time.monotonic()
        self._leader_heard = self._resumed_at = self._last_check = self._comm_free_at = now
        if self.leader is not None:
            self.leader.restart_clock(now)
        self._spawn(self._comm, "pgc-comm")
        self._spawn(self._beat, "pgc-beat")
        if self._coordinator is not None:
            self._spawn(self._coordinator.run, "pgc-leader")

    def _spawn(self, fn: Callable[[], None], name: str) -> None:
        t = threading.Thread(target=fn, name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self, donate: Optional[StateFn] = None, leave: bool = False) -> None:
        """Say BYE, serve the all-reduces until the leader's STOP, join every thread, close the data group.

        ``donate`` (leader) gives the final training state to ranks that rejoin after the leader finished; with
        ``leave`` (a worker that stops alone, e.g. on SIGTERM) it returns at once and the others go on without it.
        """
        if self._stopped:
            return
        self._stopped = True
        self._stopping.set()
        try:
            self._bye = ("bye", self.rank, self.skipped, bool(leave and not self.is_leader))
            self._ctl.push(self._leader_box(), self._bye)
        except Exception as exc:  # the store is gone: nobody is left to tell
            log.warning("PGC rank %d: could not say BYE: %r", self.rank, exc)
        if leave and not self.is_leader:
            self._halt()
            log.warning("PGC rank %d left at version %d; the others go on without it", self.rank, self.progress)
            return
        comm = self._threads[0] if self._threads else None
        while comm is not None and comm.is_alive():
            comm.join(0.05)
            with self._lock:
                requests, self._final_requests = self._final_requests, []
            for rank, version, transfer in requests:
                self.send_state(rank, version, donate() if donate is not None else None, transfer)
            if self.failure() is not None:  # the leader failed (here, or it said so): nobody sends STOP
                break
            if self._interrupted.is_set():  # SIGTERM while serving the last all-reduces: leave as with ``leave``
                log.warning("PGC rank %d: interrupted while waiting for the leader's STOP; leaving", self.rank)
                break
        self._halt()

    def _halt(self) -> None:
        """End every thread of this rank and close its data group."""
        self._stopping.set()
        self._beats_done.set()
        try:
            self._ctl.push(inbox(self.rank), (-1, ("halt",)))
            if self.is_leader:
                self._ctl.push(self._leader_box(), ("halt",))
        except Exception:
            pass
        for t in self._threads:
            t.join(self.heartbeat_window + 5.0)
        alive = [t.name for t in self._threads if t.is_alive()]
        if alive:
            log.warning("PGC rank %d: threads still running after stop: %s", self.rank, alive)
        if self.group is not None:
            self.group.close()
            self.group = None
        # every connection to the store goes with this runtime (as ddp's do with its groups), even one a thread
        # above still holds: this drops the runtime's references, so a connection closes once no call of a thread
        # is inside it, and a thread that goes on finds the runtime stopped (its next store call raises)
        for chan in self._channels:
            chan.close()
        self.store = self._group_store = self._xfer_store = None

    # ------------------------------------------------------------------------------------------- worker API
    def published(self, version: int) -> bool:
        """Whether the aggregate of ``version`` is already here (this rank fell behind: skip computing)."""
        self.progress = version
        return self.aggregates.has(version)

    def detached(self, version: int) -> bool:
        return not self._receives(self.rank, version)

    def frontier(self) -> int:
        return self.leader.version if self.leader is not None else self._frontier

    def failure(self) -> Optional[BaseException]:
        return self.error if self.error is not None else self.aggregates.failure()

    def new_code(self, version: int) -> Code:
        """A buffer to encode this rank's code for ``version`` into (reused once no version can use it)."""
        with self._lock:
            code = self._free_codes.pop() if self._free_codes else None
        if code is None:
            code = Code(self.numel, self.up_dtype, self.device)
            self._code_count += 1
        elif code.read is not None:  # the comm stream may still read it: the training stream waits
            torch.cuda.current_stream(self.device).wait_event(code.read)
        code.version = -1
        return code

    def submit(self, version: int, code: Code, ages: Sequence[int], partition: int = -1, busy_s: float = -1.0) -> None:
        """Keep ``code`` (this rank's code for ``version``) for the comm thread and announce it to the leader, with the
        seconds this rank spent on it (``busy_s``, -1: not measured)."""
        ages = tuple(int(a) for a in ages)
        code.version = version
        if self._stream is not None:
            code.event = torch.cuda.current_stream(self.device).record_event()
        announcement = ("code", self.rank, version, ages, self.skipped, partition, float(busy_s))
        with self._lock:
            old = self._codes.pop(version, None)
            if old is not None:
                self._free_codes.append(old)
            self._codes[version] = code
            self._announced[version] = announcement
        self._ctl.push(self._leader_box(), announcement)
        self._announced_at = time.monotonic()

    def reject(self, version: int) -> None:
        """This rank's code for ``version`` is not finite and is not used: the leader treats it as a straggler."""
        self.rejected += 1
        self._ctl.push(self._leader_box(), ("reject", self.rank, version))

    def wait(self, version: int, donate: Optional[StateFn] = None) -> Tensor:
        """The aggregate of ``version`` (``agg_numel`` elements of ``down_dtype``, on the device).

        Raises:
            PGCTimeoutError: the leader stopped beating.
            PGCDetached: this rank is (or became, while waiting) :meth:`detached` at ``version``.
            RuntimeError: the leader failed (its error text).
        """
        if donate is not None:
            self._state_fn = donate
        while True:
            if donate is not None:
                self._donate(version, donate)
            if self.detached(version) and not self.aggregates.has(version):
                raise PGCDetached(f"PGC rank {self.rank} is detached at version {version}: rejoin first")
            try:
                buf, event, table = self.aggregates.take(version, self.heartbeat_interval)
            except PGCTimeoutError:
                self._check_leader(f"waiting for the aggregate of version {version}")
                continue
            if event is not None:
                torch.cuda.current_stream(self.device).wait_event(event)
            self._tables = {version: table} if table else {}
            return buf

    def table(self, version: int) -> Optional[tuple[int, ...]]:
        """Bounded staleness with ``choice="oldest"``: the table ages ``version`` closed with (once), else None."""
        return self._tables.pop(version, None)

    def release(self, aggregate: Tensor) -> None:
        """Give an aggregate from :meth:`wait` back once nothing (e.g. ``param.grad``) views it."""
        base = aggregate._base if aggregate._base is not None else aggregate
        event = torch.cuda.current_stream(self.device).record_event() if self._stream is not None else None
        self.aggregates.release(base, event)

    def interrupt(self) -> None:
        """End this rank's waits now (a signal handler may call it): the training thread's next check raises
        :class:`PGCInterrupted`, and :meth:`stop` returns without waiting for the leader's STOP."""
        self._interrupted.set()

    def _check_leader(self, doing: str) -> None:
        if self._interrupted.is_set():
            raise PGCInterrupted(f"PGC rank {self.rank} was interrupted (SIGTERM) while {doing}")
        if self.failure() is not None:
            raise RuntimeError(f"PGC rank {self.rank} runtime failed: {self.failure()}") from self.failure()
        now = time.monotonic()
        if now - self._last_check > 3 * self.heartbeat_interval:
            self._resumed_at = now  # this thread did not run for a while: the leader's beats may be queued
        self._last_check = now
        silent = now - max(self._leader_heard, self._resumed_at, self._comm_free_at)
        limit = 2 * self.heartbeat_window
        if self.failover:  # (a successor is elected first: see Succession.due)
            limit += self.heartbeat_window + 2 * self.world_size * self.heartbeat_interval
        if not self.is_leader and silent > limit and not self._busy:
            exc = PGCTimeoutError(
                f"PGC rank {self.rank} lost the leader (rank {self.leader_rank}): no heartbeat for "
                f"{silent:.1f} s while {doing}; its process is gone or frozen"
            )
            self.fail(exc)  # the runtime is done with this leader: stop() leaves instead of waiting for its STOP
            raise exc

    def seat_in_doubt(self) -> bool:
        """Whether this rank leads but may have been replaced: with ``failover``, once per heartbeat interval (a
        process that was stopped finds its last look older than that)."""
        if not self.failover or not self.is_leader or self.store is None:  # (a stopped runtime has no store)
            return False
        return time.monotonic() - self._last_settle > self.heartbeat_interval

    def settle_seat(self) -> bool:
        """Follow every newer term named in the store (stepping down if one exists); returns :attr:`is_leader`."""
        self._last_settle = time.monotonic()
        self.succession.settle(self._ctl)
        return self.is_leader

    # ------------------------------------------------------------------------------------------- statistics
    def record(self, version: int) -> Optional[StepRecord]:
        return self.leader.record(version) if self.leader is not None else None

    def rank_stats(self) -> list[dict[str, float]]:
        if self.leader is not None:
            return self.leader.rank_stats()
        return list(self.final_stats or [])

    def buffer_stats(self) -> dict[str, int]:
        control_sent = sum(c.bytes_sent for c in self._channels)
        control_received = sum(c.bytes_received for c in self._channels)
        return {
            "mailbox_high_water": self.aggregates.high_water,
            "aggregate_buffers": self.aggregates.allocated,
            "code_messages": self._code_count,
            "bytes_sent": self.data_bytes + control_sent,
            "bytes_received": self.data_bytes + control_received,
            "control_bytes_sent": control_sent,
            "control_bytes_received": control_received,
            "rejected": self.rejected,
            "configurations": self.config + 1,
        }

    def _receives(self, rank: int, version: int) -> bool:
        with self._lock:
            for start, end in self._gaps.get(rank, ()):
                if start <= version and (end is None or version < end):
                    return False
        return True

    def _set_gap(self, rank: int, version: int, detach: bool) -> None:
        with self._lock:
            spans = self._gaps.setdefault(rank, [])
            if detach:
                if not spans or spans[-1][1] is not None:
                    spans.append((version, None))
            elif spans and spans[-1][1] is None:
                spans[-1] = (spans[-1][0], version)
            if len(spans) > 16:
                del spans[0]

    # --------------------------------------------------------------------------------------------- threads
    def _beat(self) -> None:
        """Heartbeats to the leader with the training thread's version (the leader's own: a tick to its loop), and a
        tick to this rank's comm thread (its pops wait for messages only). A worker that announced a code within the
        interval sends none: the leader reads the announcement as its heartbeat."""
        chan = self._beat_chan
        while not self._beats_done.wait(self.heartbeat_interval):
            try:
                chan.push(inbox(self.rank), (-1, ("tick", time.monotonic())))
                if self.is_leader:
                    chan.push(self._leader_box(), ("tick",))
                elif time.monotonic() - self._announced_at >= self.heartbeat_interval:  # (an announcement is one)
                    chan.push(self._leader_box(), ("beat", self.rank, self.progress))
            except Exception as exc:  # the store is gone: the comm thread reports the lost leader
                log.debug("PGC rank %d: heartbeat failed: %r", self.rank, exc)

    # ---------------------------------------------------------------- for the control plane (leader, succession)
    @property
    def stopping(self) -> bool:
        """Whether this rank's training ended (it said, or is saying, BYE)."""
        return self._stopping.is_set()

    def detached_ranks(self) -> dict[int, int]:
        """The ranks this rank knows to be detached now, each with the first version it gets no aggregate for."""
        with self._lock:
            return {r: spans[-1][0] for r, spans in self._gaps.items() if spans and spans[-1][1] is None}

    def donate_final(self, rank: int, version: int, transfer: str) -> None:
        """This rank's training ended: give ``rank`` the final training state for ``version`` in transfer
        ``transfer`` (:meth:`stop` sends it while it serves the last all-reduces)."""
        with self._lock:
            self._final_requests.append((rank, version, transfer))

    def follow(self, term: int, winner: int) -> None:
        """Leadership passed to ``winner`` for ``term`` (:mod:`~lightning_pgc.runtime.succession`): follow it, or
        lead if this rank won."""
        old = self.leader_rank
        self.term, self.leader_rank = term, winner
        self._leader_heard = time.monotonic()
        self.successions.append((old, winner))
        if winner == self.rank:
            self._lead(succeeds=old)

    def fail(self, exc: BaseException) -> None:
        """End this rank's runtime with ``exc`` (the training thread raises it at its next wait)."""
        if self.error is None:
            self.error = exc
        self.aggregates.abort(exc)
        with self._coll_cond:
            self._coll_cond.notify_all()


def _kept_versions(scheme: Scheme) -> int:
    """Versions a code may serve by default: the window of a scheme that reuses codes (bounded staleness), else 1."""
    if not scheme.reuses_codes:
        return 1
    if not isinstance(scheme, BoundedScheme):
        raise TypeError(f"{type(scheme).__name__} reuses codes but has no window: pass keep_versions")
    return scheme.window
