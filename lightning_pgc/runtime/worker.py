"""The per-rank manager of the sharded data plane: what the strategy talks to on every rank.

Every rank is a worker and the owner of one shard of the flat payload; rank ``leader`` also runs the control
plane (:class:`~lightning_pgc.runtime.leader.Leader`). Per version ``t``:

1. a worker encodes its code into a preallocated message (one row per shard) and sends shard ``j`` to owner
   ``j`` (:meth:`PGCRuntime.submit`); the leader owns shard 0, so its arrival announces the code;
2. the leader closes ``t`` with an ordered set of ranks and tells every owner (a few bytes);
3. each owner decodes its shard with that set's weights and sends it to every rank;
4. each rank assembles the shards into one flat buffer and applies it (:meth:`PGCRuntime.wait`).

All receiving, decoding and sending runs on background threads, so a rank whose training thread is slow still
serves its shard on time. Per rank and step, ``4 (n-1)/n`` times the payload crosses its links, as for a ring
all-reduce.

Liveness is separate from progress: every rank's background thread sends the leader a heartbeat carrying the
version its training thread is at, and the leader beats back. A rank whose training thread falls more than
``max_lag`` versions behind is detached (no aggregates from then on, so its memory stays bounded); when its
training thread is back it asks to rejoin and a live rank donates the training state at the open version
(:meth:`PGCRuntime.rejoin`, :meth:`PGCRuntime.donation`, :meth:`PGCRuntime.send_state`). Nobody waits for it.

A shard owner that dies (or freezes: then every rank first stops accepting its shards) hands its shards to live
ranks (:meth:`PGCRuntime._recover`): every rank tells the leader the last version of each lost shard it got;
ranks that missed versions another rank got rejoin by state transfer; the version nobody could complete (at most
one) has the lost shards decoded again by their new owners from the live ranks' kept codes, and every rank
replaces what it had of them, so replicas stay identical. Under bounded staleness (a code may serve later
versions) every rank keeps its own codes of its last ``c`` versions for such re-sends, and the leader plans that
version again from live codes (:meth:`~lightning_pgc.runtime.bounded.BoundedLeader.replan`).
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from dataclasses import dataclass, field
from typing import Callable, Optional, Sequence

import torch
from torch import Tensor

from lightning_pgc.codes import Scheme
from lightning_pgc.runtime.bounded import BoundedLeader
from lightning_pgc.runtime.collectives import LiveCollectives, LiveGather
from lightning_pgc.runtime.leader import STAT_NAMES, CoordinatorError, Leader, StepRecord
from lightning_pgc.runtime.mailbox import Mailbox, PGCTimeoutError
from lightning_pgc.runtime.messages import (
    CONTROL_FIELDS,
    STAT_FIELDS,
    Header,
    Kind,
    control,
    control_numel,
    decide_words,
    header_numel,
    message_numel,
    payload_text,
    read_control,
    read_decide,
    read_header,
    text_payload,
    write_header,
)
from lightning_pgc.runtime.shards import OwnerMap, ShardLayout
from lightning_pgc.runtime.transport import Channel, Handle, Transport

log = logging.getLogger(__name__)

LATEST = 1 << 62  # a version after every reassignment: ``owners.shards_of(rank, LATEST)`` is what it owns now
SERVED_KEPT = 64  # versions an owner remembers which shards it published (older late codes are dropped)
FOREIGN_SLACK = 8  # versions a code for a shard this rank does not own yet is kept (its ASSIGN is on the way)

__all__ = ["CodeMessage", "PGCDetached", "PGCRuntime", "PGCTimeoutError", "CoordinatorError", "Mailbox"]


class PGCDetached(RuntimeError):
    """This rank fell more than ``max_lag`` versions behind: no aggregate comes until it rejoins."""


class CodeMessage:
    """One rank's code for one version, laid out as ``num_shards`` ready-to-send messages (header + shard).

    Encode straight into :attr:`shards` (a ``[num_shards, shard_numel]`` view): no copy is needed to send.
    """

    def __init__(self, layout: ShardLayout, dtype: torch.dtype, pin_memory: bool = False) -> None:
        self.layout = layout
        self.hn = header_numel(dtype)
        self.rows = torch.zeros(layout.num_shards, self.hn + layout.shard_numel, dtype=dtype, pin_memory=pin_memory)
        self.shards = self.rows[:, self.hn :]
        self.version = -1
        self.sends_pending = 0  # isends not yet completed
        self._lock = threading.Lock()

    def write(self, start: int, flat: Tensor) -> None:
        """Copy ``flat`` into the payload at global offset ``start`` (e.g. the averaged buffers region)."""
        size = self.layout.shard_numel
        pos, end = start, start + flat.numel()
        while pos < end:
            row, col = divmod(pos, size)
            take = min(size - col, end - pos)
            self.shards[row, col : col + take].copy_(flat[pos - start : pos - start + take])
            pos += take

    def _sent(self) -> None:
        with self._lock:
            self.sends_pending -= 1


class _Pool:
    """Free data-message buffers of one size and dtype (allocated on demand, reused forever)."""

    def __init__(self, numel: int, dtype: torch.dtype) -> None:
        self.numel, self.dtype = numel, dtype
        self._free: list[Tensor] = []
        self._lock = threading.Lock()
        self.allocated = 0

    def get(self) -> Tensor:
        with self._lock:
            if self._free:
                return self._free.pop()
            self.allocated += 1
        return torch.zeros(self.numel, dtype=self.dtype)

    def put(self, buf: Tensor) -> None:
        with self._lock:
            self._free.append(buf)


class PGCRuntime:
    """Every rank's runtime: worker API for the training thread plus the background service of one shard owner.

    Call order: :meth:`start` once; per version ``t``: :meth:`published` (skip computing if True); if
    :meth:`detached`, :meth:`rejoin` once and apply nothing until the version it returns; else :meth:`new_code`
    then :meth:`submit` (or :meth:`reject` for a non-finite code); then :meth:`wait`, :meth:`donation` (if it
    names a rank, :meth:`send_state` with the training state before applying ``t``) and, once the returned
    aggregate is no longer referenced, :meth:`release`; :meth:`stop` once at the end. :meth:`rank_stats`,
    :meth:`record` and :meth:`buffer_stats` may be called at any time.

    Args:
        scheme: the straggler-tolerance scheme (placement, encoder, decoding weights).
        transport: point-to-point streams to the other ranks.
        rank: this rank; world_size: number of ranks.
        layout: how the payload is cut into shards (``num_shards <= world_size``; shard ``j`` starts at rank ``j``).
        down_dtype: dtype of the aggregate (float32, or float64 for double models). Codes travel in
            ``scheme.payload_dtype`` (float64 for Tandon-coded schemes, whose decode needs it).
        start_version: the first version of this fit (the global step).
        timeout: seconds the job may run short of the ``n - s`` live ranks a version needs before the leader
            fails naming them (see :class:`~lightning_pgc.runtime.leader.Leader`).
        max_lag: versions a rank's training thread may fall behind before it is detached (it then catches up by
            state transfer instead of buffering aggregates).
        leader: the rank that runs the control plane (owns shard 0).
        pin_memory: allocate message and aggregate buffers in pinned host memory (CUDA models).
        make_leader: builds the control plane on the leader's rank from ``(scheme, world_size, start_version,
            timeout, max_lag, heartbeat_window)``; default :class:`Leader` (e.g.
            :class:`~lightning_pgc.runtime.bounded.BoundedLeader`).
        heartbeat_interval: seconds between heartbeats; heartbeat_misses: missed heartbeats after which a rank
            (or the leader, seen from a worker) counts as dead.
        failover: when the leader dies (its streams break), the lowest live rank takes over the control plane and
            shard 0 (:meth:`_leader_gone`) instead of every rank failing. Under bounded staleness the successor
            rebuilds the table from the codes the live ranks keep and send it again.
        frozen_failover: also replace a *frozen* leader (needs ``failover``; the strategy turns both on). Without
            it a frozen leader (no heartbeat for twice the window) fails every worker; with it the others take
            over, and the leader steps down and rejoins when it resumes. A resumed leader must not do rank-zero
            work before it knows whether it was replaced: :meth:`seat_in_doubt`, :meth:`settle_seat`.
    """

    def __init__(
        self,
        scheme: Scheme,
        transport: Transport,
        rank: int,
        world_size: int,
        layout: ShardLayout,
        down_dtype: torch.dtype,
        start_version: int,
        timeout: float,
        max_lag: int,
        leader: int = 0,
        pin_memory: bool = False,
        make_leader: Optional[Callable[..., Leader]] = None,
        heartbeat_interval: float = 0.2,
        heartbeat_misses: int = 15,
        failover: bool = False,
        frozen_failover: bool = False,
    ) -> None:
        if heartbeat_interval <= 0 or heartbeat_misses < 1:
            raise ValueError(
                f"need heartbeat_interval > 0 and heartbeat_misses >= 1, got {heartbeat_interval}, {heartbeat_misses}"
            )
        if leader != 0:
            raise ValueError("the leader owns shard 0 and must be rank 0")
        if layout.num_shards > world_size:
            raise ValueError(f"{layout.num_shards} shards for {world_size} ranks: at most one shard per rank")
        self.scheme = scheme
        self.transport = transport
        self.rank = rank
        self.world_size = world_size
        self.layout = layout
        self.up_dtype: torch.dtype = scheme.payload_dtype
        self.down_dtype = down_dtype
        self.timeout = timeout
        self.pin_memory = pin_memory
        self.leader_rank = leader
        self.peers = [r for r in range(world_size) if r != rank]
        self.owners = OwnerMap(layout.num_shards, world_size)
        self.mailbox = Mailbox(layout.num_shards, layout.shard_numel, down_dtype, pin_memory=pin_memory)
        self.heartbeat_interval = float(heartbeat_interval)
        self.heartbeat_window = float(heartbeat_interval) * heartbeat_misses
        self.max_lag = max_lag
        self._make_leader = make_leader or Leader
        self.leader: Optional[Leader] = (
            self._make_leader(scheme, world_size, start_version, timeout, max_lag, self.heartbeat_window)
            if rank == leader
            else None
        )
        self.failover = failover
        # Under bounded staleness a code may serve the next ``c - 1`` versions: every rank keeps its own codes of its
        # last ``c`` versions, to send them again to a new owner when an owner or the leader dies.
        self.kept_versions = scheme.window if scheme.reuses_codes else 1
        self.frozen_failover = self.failover and frozen_failover
        self._failover_lock = threading.Lock()
        self._deposed: set[int] = set()  # leaders that died or froze and were replaced (this rank too, if it stepped
        # down): their streams carry nothing valid any more
        self.successions: list[tuple[int, int]] = []  # (dead leader, successor), in order
        self.error: Optional[BaseException] = None
        self.skipped = 0
        self.rejected = 0
        self._rejects: list[int] = []  # versions of this rank's last rejected codes (told again to a new leader)
        self.progress = start_version  # the version this rank's training thread is at (heartbeats carry it)
        self._gaps: dict[int, list[tuple[int, Optional[int]]]] = {}  # rank -> versions it gets no aggregate for
        self._gap_lock = threading.Lock()
        self._attach_info: Optional[tuple[int, int]] = None  # (version, donor) of this rank's last ATTACH
        self._attached = threading.Event()
        self._leader_heard = time.monotonic()
        self._last_check = self._resumed_at = time.monotonic()  # see _check_leader
        self._watched = self._watch_grace = time.monotonic()  # see _watch_leader
        self._service_tick = time.monotonic()  # the service loop's last turn (see seat_in_doubt)
        self._doubt_since: Optional[float] = None  # a leader whose process stopped for a window (see seat_in_doubt)
        self._notes: dict[int, list[tuple[int, int]]] = {}  # leader: version -> (rank rejoining at it, its donor)
        # every rank: version -> the (rank, donor) ATTACH messages seen for it, and the ranks this one sent its state
        # to at it (from wait(), or between steps)
        self._attachments: dict[int, list[tuple[int, int]]] = {}
        self._donated: dict[int, set[int]] = {}
        self._attach_cond = threading.Condition()
        self._state_fn: Optional[Callable[[], Tensor]] = None  # the training state, as last given to :meth:`wait`
        self._final_requests: queue.Queue = queue.Queue()  # leader: (rank, version) to donate from stop()
        self._beats_done = threading.Event()
        self._small_lock = threading.Lock()
        self.final_stats: Optional[list[dict[str, float]]] = None
        self._hn_up = header_numel(self.up_dtype)
        self._hn_down = header_numel(down_dtype)
        self._code_pool = _Pool(message_numel(layout.shard_numel, self.up_dtype), self.up_dtype)
        self._agg_pool = _Pool(message_numel(layout.shard_numel, down_dtype), down_dtype)
        self._scratch: Optional[Tensor] = None
        self._codes: list[CodeMessage] = []
        self._inbox: queue.Queue = queue.Queue()
        self._reaper_q: queue.Queue = queue.Queue()
        self._send_lock = threading.Lock()
        self._bytes_lock = threading.Lock()
        self.bytes_sent = 0
        self.bytes_received = 0
        self._stopping = threading.Event()
        self._stopped = False
        self._threads: list[threading.Thread] = []
        self._service: Optional[threading.Thread] = None
        self._keep_from = -1  # codes of versions below this are never used again (see _aggregate_ready)
        self._broken: set[int] = set()  # peers whose streams broke (their process is gone): nothing is sent to them
        self._finished: set[int] = set()  # peers that said BYE on their code stream (no aggregates for them)
        self.alive = world_size  # ranks alive and training, as the leader last counted them (its heartbeats carry it)
        self._frontier = start_version  # the leader's open version, as its last heartbeat said
        self._shard_seen = [start_version - 1] * layout.num_shards  # last version of each shard that arrived here
        self._served: dict[int, set[int]] = {}  # service thread: version -> shards this rank published
        self._served_floor = start_version  # codes older than this are dropped (``_served`` forgot them)
        self._lost: dict[tuple[int, int], dict[int, int]] = {}  # leader: (dead owner, shard) -> {rank: last version
        # of that shard the rank got}
        self._recovery: Optional[_Recovery] = None  # leader: dead owners whose shards are being moved
        self._fenced: dict[int, int] = {}  # frozen owner -> first version of its shards accepted again (moved back)
        self._fence_locks = {p: threading.Lock() for p in range(world_size)}
        self._owners_checked = self._owners_grace = time.monotonic()  # see _check_owners
        self.collectives = LiveCollectives(
            LiveGather(
                transport,
                rank,
                world_size,
                leader,
                self.heartbeat_interval,
                members=self._members,
                failure=self.failure,
                check_leader=self._check_leader,
                send=lambda channel, message, peers: self._send_all(channel, message, peers),
                waiting=self._donate_between_steps,
                failover=self.failover,
            )
        )

    @property
    def is_leader(self) -> bool:
        return self.leader is not None

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        """Start the receiver threads (one per peer and channel), the service loop and the send reaper."""
        for peer in self.peers:
            self._spawn(self._receive_codes, peer, name=f"pgc-code-recv-{peer}")
            self._spawn(self._receive_aggregates, peer, name=f"pgc-agg-recv-{peer}")
            if self.is_leader:
                self._spawn(self._receive_beats, peer, name=f"pgc-beat-recv-{peer}")
        if not self.is_leader:
            self._spawn(self._receive_control, self.leader_rank, name="pgc-ctrl-recv")
            self._spawn(self._send_beats, -1, name="pgc-beat")
        self._spawn(self._reap, -1, name="pgc-reaper")
        self.collectives.gather.start()
        self._threads.extend(self.collectives.gather.threads)
        self._service = threading.Thread(target=self._serve_safely, name="pgc-service", daemon=True)
        self._service.start()

    def _spawn(self, fn: Callable[[int], None], peer: int, name: str) -> None:
        t = threading.Thread(target=fn, args=(peer,), name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def stop(self, donate: Optional[Callable[[], Tensor]] = None, leave: bool = False) -> None:
        """Say BYE on every code stream, serve until the leader's STOP, join every thread.

        Every rank's training is over once all live ranks said BYE, so the last rank to finish sets when all
        return. On the leader, ``donate`` gives the final training state (a uint8 tensor) to ranks that rejoin
        after the leader finished. With ``leave`` (a worker that stops alone, e.g. on SIGTERM) it says BYE on every
        stream and returns at once: the others go on without it, and its shards move to live ranks as a dead
        owner's do.
        """
        if self._stopped:
            return
        if leave and not self.is_leader:
            self._leave()
            return
        self._stopped = True
        self._beats_done.set()
        bye = torch.zeros(message_numel(self.layout.shard_numel, self.up_dtype), dtype=self.up_dtype)
        write_header(bye, Header(Kind.BYE, -1, self.rank, skipped=self.skipped))
        self._send_all(Channel.CODE, bye, self.peers)
        self.collectives.gather.stop()
        if not self.is_leader:
            self._send_small(Channel.BEAT, control(self.world_size, Kind.BYE, -1), self.leader_rank)
        self._end_deposed_streams()
        self._stopping.set()
        while self._service is not None and self._service.is_alive():
            self._service.join(0.05)
            while not self._final_requests.empty():
                rank, version = self._final_requests.get()
                self.send_state(rank, version, donate() if donate is not None else torch.zeros(0, dtype=torch.uint8))
            silent = time.monotonic() - max(self._leader_heard, self._resumed_at)
            if not self.is_leader and silent > self.heartbeat_window + self.timeout:
                log.warning("PGC rank %d: no STOP from the leader (silent for %.1f s); leaving", self.rank, silent)
                break
        self._reaper_q.put(None)
        for t in self._threads:
            t.join(min(self.timeout, 10.0))
        alive = [t.name for t in self._threads + [self._service] if t is not None and t.is_alive()]
        if alive:
            log.warning("PGC rank %d: threads still running after stop: %s", self.rank, alive)
        self.transport.close()

    def _end_deposed_streams(self) -> None:
        """End the streams that only a leader reads or writes, towards or from leaders that froze and were replaced
        (they are alive, so nothing breaks them): BYE to their heartbeat receivers, and, from a leader that
        stepped down, BYE to the control receivers every other rank still has for it."""
        for r in sorted(self._deposed - self._broken - {self.rank}):
            self._send_small(Channel.BEAT, control(self.world_size, Kind.BYE, -1), r)
        if self.rank in self._deposed:
            self._send_all(Channel.CTRL, control(self.world_size, Kind.BYE, -1), self.peers)

    def _leave(self) -> None:
        """Worker: BYE on every stream it sends on, then return without waiting for the others (their streams
        to this rank break when its process exits; receiver threads are daemons)."""
        self._stopped = True
        self._beats_done.set()
        self._stopping.set()
        bye = torch.zeros(message_numel(self.layout.shard_numel, self.up_dtype), dtype=self.up_dtype)
        write_header(bye, Header(Kind.BYE, -1, self.rank, valid=1, skipped=self.skipped))  # valid=1: leaving early
        self._send_all(Channel.CODE, bye, self.peers)
        self.collectives.gather.stop()
        self._send_small(Channel.BEAT, control(self.world_size, Kind.BYE, -1), self.leader_rank)
        self._say_agg_bye(leaving=True)
        self._reaper_q.put(None)  # the reaper ends once these sends are done
        log.warning("PGC rank %d left at version %d; the others go on without it", self.rank, self.progress)

    # ------------------------------------------------------------------------------------------- worker API
    def published(self, version: int) -> bool:
        """Whether the aggregate of ``version`` is already complete here (this rank fell behind). Also tells the
        runtime that the training thread is at ``version`` (the heartbeats carry it)."""
        self.progress = version
        return self.mailbox.has(version)

    def detached(self, version: int) -> bool:
        """Whether this rank gets no aggregate for ``version``: it fell more than ``max_lag`` behind and must
        :meth:`rejoin`."""
        return not self._receives(self.rank, version)

    def frontier(self) -> int:
        """The open version: the leader's own, or as its last heartbeat said (at most a heartbeat old)."""
        return self.leader.version if self.leader is not None else self._frontier

    def rejoin(self, version: int) -> tuple[int, Tensor]:
        """Ask to rejoin at ``version`` (this rank is :meth:`detached`); block until a donor sent the training
        state. Returns ``(u, state)``: aggregates come again from version ``u`` on, and ``state`` (uint8, as given
        to the donor's :meth:`send_state`) is the training state at the start of ``u``.

        A donor that dies during the transfer (its stream breaks) is survived as a dead rank: this rank asks again,
        naming it, and the leader attaches it at the open version with another donor.

        Raises:
            PGCTimeoutError: the leader stopped beating (without failover).
            RuntimeError: the runtime failed.
        """
        failed = -1  # a donor whose stream broke during the transfer, named in the next request
        while True:
            u, donor = self._ask_to_rejoin(version, failed)
            header = torch.zeros(2, dtype=torch.int64)
            try:
                self.transport.recv(Channel.STATE, donor, header)
                state = torch.empty(int(header[1]), dtype=torch.uint8)
                if state.numel():
                    self.transport.recv(Channel.STATE, donor, state)
                break
            except Exception as exc:
                log.warning(
                    "PGC rank %d: rank %d died while sending the training state for version %d (%r); asking again",
                    self.rank,
                    donor,
                    u,
                    exc,
                )
                self._broken.add(donor)
                failed = donor
        self._count(received=16 + state.numel())
        log.warning(
            "PGC rank %d: rejoined at version %d with the state of rank %d (%.1f MB), asked at version %d",
            self.rank,
            u,
            donor,
            state.numel() / 1e6,
            version,
        )
        return u, state

    def _ask_to_rejoin(self, version: int, failed: int) -> tuple[int, int]:
        """Send ``REJOIN`` (naming a ``failed`` donor, or -1) and wait for the leader's ``ATTACH``: ``(u, donor)``.
        Asks the successor again if the leader dies before answering."""
        self._attached.clear()
        asked = self.leader_rank
        self._to_leader(Kind.REJOIN, version, failed + 1)
        while not self._attached.wait(self.heartbeat_interval):
            self._check_leader(f"rejoining at version {version}")
            if self.leader_rank != asked:  # the leader died before answering: ask its successor
                asked = self.leader_rank
                self._to_leader(Kind.REJOIN, version, failed + 1)
        assert self._attach_info is not None
        return self._attach_info

    def table(self, version: int) -> Optional[tuple[int, ...]]:
        """Bounded staleness with ``choice="oldest"``: ``t - v_i`` per partition of the entries ``version`` closed
        with, from its aggregate's header (call after :meth:`wait` of ``version``, once); None if not carried."""
        return self.mailbox.pop_table(version)

    def donation(self, version: int) -> list[int]:
        """The ranks this rank must send its training state to before applying ``version`` (call after
        :meth:`wait`; empty if none, or if :meth:`wait` sent it already).

        The aggregate of ``version`` says how many ranks rejoin at it; their donors are named in the leader's
        ``ATTACH`` messages, which come on another stream: this waits until all of them arrived (or the leader
        changed, whose successor answers rejoins afresh).

        Raises:
            PGCTimeoutError: the leader stopped beating (without failover).
            RuntimeError: the runtime failed.
        """
        count = self.mailbox.pop_note(version) or 0
        asked = self.leader_rank
        with self._attach_cond:
            while len(self._attachments.get(version, ())) < count and self.leader_rank == asked:
                if not self._attach_cond.wait(self.heartbeat_interval):
                    self._check_leader(f"waiting for the rejoins at version {version}")
            recipients = self._recipients(version)
            for v in [v for v in self._attachments if v <= version]:
                del self._attachments[v]
            for v in [v for v in self._donated if v <= version]:
                del self._donated[v]
        return recipients

    def _note_attach(self, version: int, rank: int, donor: int) -> None:
        """``rank`` rejoins at ``version`` with the state of ``donor`` (from the leader's ATTACH; any thread)."""
        with self._attach_cond:
            self._attachments.setdefault(version, []).append((rank, donor))
            self._attach_cond.notify_all()

    def _recipients(self, version: int) -> list[int]:
        """The ranks that rejoin at ``version`` with this rank as donor and did not get its state yet."""
        with self._attach_cond:
            sent = self._donated.get(version, set())
            return [
                r for r, d in self._attachments.get(version, ()) if d == self.rank and r != self.rank and r not in sent
            ]

    def _donate(self, version: int, state_fn: Callable[[], Tensor]) -> None:
        """Send the state at the start of ``version`` to every rank that rejoins at it from this one, once."""
        recipients = self._recipients(version)
        if not recipients:
            return
        state = state_fn()
        for rank in recipients:
            self.send_state(rank, version, state)
            with self._attach_cond:
                self._donated.setdefault(version, set()).add(rank)

    def send_state(self, rank: int, version: int, state: Tensor) -> None:
        """Send ``state`` (a uint8 tensor, left unchanged until sent) to ``rank``, which rejoins at ``version``."""
        header = torch.tensor([version, state.numel()], dtype=torch.int64)
        self._send_all(Channel.STATE, header, [rank])
        if state.numel():
            self._send_all(Channel.STATE, state, [rank])

    def reject(self, version: int) -> None:
        """This rank's code for ``version`` is not finite and is not sent: the leader counts it and treats this
        rank as a straggler for ``version``."""
        self.rejected += 1
        self._rejects = self._rejects[-7:] + [version]
        self._to_leader(Kind.REJECT, version)

    def new_code(self, version: int) -> CodeMessage:
        """A message to encode this rank's code for ``version`` into (reused once its sends completed and its
        version closed, or under bounded staleness once ``c`` versions old; payload padding is zero)."""
        with self._send_lock:
            for msg in self._codes:
                if (
                    0 <= msg.version <= version - self.kept_versions
                    and msg.sends_pending == 0
                    and self._unused_here(msg.version)
                ):
                    break
            else:
                msg = CodeMessage(self.layout, self.up_dtype, self.pin_memory)
                self._codes.append(msg)
            msg.version = -1  # being written: never re-sent until submitted
        return msg

    def _unused_here(self, version: int) -> bool:
        """Whether this rank's own shards no longer need its code of ``version`` (under bounded staleness an owner
        keeps the local rows of its own code, by reference, while a later version may still use them)."""
        if not self.scheme.reuses_codes or not self.owners.shards_of(self.rank, version):
            return True
        return version < self._keep_from

    def submit(self, version: int, code: CodeMessage, ages: Sequence[int], partition: int = -1) -> None:
        """Send shard ``j`` of ``code`` (this rank's code for ``version``, from cache entries of ``ages``) to the
        owner of shard ``j``. Returns at once; the code stays kept until its version closes (for re-sends).
        ``partition``: under bounded staleness, the partition the code carries (-1: the scheme's round robin)."""
        ages = tuple(int(a) for a in ages)
        for j in range(self.layout.num_shards):
            write_header(
                code.rows[j],
                Header(
                    Kind.CODE, version, self.rank, j, len(ages), max(ages, default=0), ages, self.skipped, partition
                ),
            )
        with self._send_lock:
            code.version = version
            for j in _rotated(list(range(self.layout.num_shards)), version + self.rank):
                self._send_code_shard(code, j, self.owners.owner(j, version))

    def _send_code_shard(self, code: CodeMessage, shard: int, owner: int) -> None:
        row = code.rows[shard]
        if owner == self.rank:
            self._inbox.put(("code", read_header(row), row, time.monotonic(), True))
            return
        if owner in self._broken:  # its process is gone: the code stays kept and goes to the shard's new owner
            return
        try:
            handle = self.transport.isend(Channel.CODE, owner, row)
        except Exception as exc:  # (gloo may refuse at once) as above; the owner's streams report its death
            self._broken.add(owner)
            log.warning(
                "PGC rank %d: sending shard %d of its code for version %d to rank %d failed: %r",
                self.rank,
                shard,
                code.version,
                owner,
                exc,
            )
            return
        with code._lock:
            code.sends_pending += 1
        self._count(sent=row.numel() * row.element_size())
        self._reaper_q.put(([handle], code._sent))

    def wait(self, version: int, donate: Optional[Callable[[], Tensor]] = None) -> Tensor:
        """The aggregate of ``version`` as a flat view of ``layout.numel`` elements (``down_dtype``).

        Blocks while the leader is alive: the leader decides when too few ranks are left, and says so. ``donate``
        gives this rank's training state (uint8, as for :meth:`send_state`): if this rank is the donor for a rank
        that rejoins at ``version``, it sends the state while waiting, so a version that needs the rejoining rank's
        code (too few others alive) can still close; :meth:`donation` then returns None for it.

        Raises:
            PGCTimeoutError: the leader stopped beating (without failover).
            PGCDetached: this rank is (or became, while waiting) :meth:`detached` at ``version``.
            RuntimeError: the leader failed (its error text) or a stream broke.
        """
        if donate is not None:
            self._state_fn = donate
        while True:
            if donate is not None:
                self._donate(version, donate)
            if self.detached(version) and not self.mailbox.has(version):
                raise PGCDetached(f"PGC rank {self.rank} is detached at version {version}: rejoin first")
            try:
                buf = self.mailbox.take(version, self.heartbeat_interval)
            except PGCTimeoutError:
                self._check_leader(f"waiting for the aggregate of version {version}")
                continue
            return buf[: self.layout.numel]

    def _donate_between_steps(self) -> None:
        """A collective waits on the training thread, between two steps: the state now is the state at the start of
        the next version. If a rank rejoins at that version with this rank as donor, send it now; otherwise the
        donation would come only with that version, after the collective, which may be waiting for that very rank
        (it joins once it has the state)."""
        if self._state_fn is not None:
            self._donate(self.progress + 1, self._state_fn)

    def _check_leader(self, doing: str) -> None:
        """Raise if the runtime failed, or this worker has not heard from the leader for a heartbeat window (twice
        that with ``failover``: a dead leader's streams break, and the service thread replaces it, but on a busy
        machine that may come after its last heartbeats are a window old); with ``frozen_failover`` the service
        thread replaces a silent leader instead."""
        if self.error is not None:
            raise RuntimeError(f"PGC rank {self.rank} runtime failed: {self.error}") from self.error
        now = time.monotonic()
        if now - self._last_check > 3 * self.heartbeat_interval:
            # This thread did not run for a while (this process was frozen, or busy elsewhere): the leader's
            # heartbeats may be waiting in the socket, so give them a window from now.
            self._resumed_at = now
        self._last_check = now
        silent = now - max(self._leader_heard, self._resumed_at)
        window = self.heartbeat_window * (2 if self.failover else 1)
        if not self.is_leader and silent > window and not self.frozen_failover:
            raise PGCTimeoutError(
                f"PGC rank {self.rank} lost the leader (rank {self.leader_rank}): no heartbeat for {silent:.1f} s "
                f"while {doing}; its process is gone or frozen"
            )

    def seat_in_doubt(self) -> bool:
        """Whether this rank leads but may have been replaced: with ``frozen_failover``, its process stopped (or was
        starved) for a heartbeat window, long enough for the others to take over. Until :meth:`settle_seat` it must
        not do rank-zero work (write checkpoints or logs the successor writes too). Any thread."""
        if not (self.frozen_failover and self.is_leader):
            return False
        if self._doubt_since is not None:
            return True
        turning = self._service is not None and self._service.is_alive() and not self._stopping.is_set()
        return turning and time.monotonic() - self._service_tick > self.heartbeat_window

    def settle_seat(self) -> bool:
        """Call when :meth:`seat_in_doubt`: wait up to a heartbeat window for a successor's ``DEPOSE`` (sent while
        this process was stopped, so it is among the first things read after) and return whether this rank still
        leads (it steps down meanwhile if deposed)."""
        start = time.monotonic()
        while self.is_leader and time.monotonic() - start < self.heartbeat_window:
            time.sleep(self.heartbeat_interval / 4)
        if self.is_leader:
            log.warning(
                "PGC rank %d: this leader's process stopped for more than a heartbeat window, but no rank took "
                "over; it goes on leading",
                self.rank,
            )
            self._doubt_since = None
        return self.is_leader

    def release(self, aggregate: Tensor) -> None:
        """Return an aggregate from :meth:`wait` to the pool once nothing (e.g. ``param.grad``) views it."""
        base = aggregate._base if aggregate._base is not None else aggregate
        self.mailbox.release(base)

    def reassign(self, shard: int, owner: int, from_version: int) -> None:
        """Leader only: rank ``owner`` owns ``shard`` from version ``from_version`` (not closed yet) on.

        Every rank is told; a worker whose kept code for such a version went to the old owner re-sends it.

        Raises:
            RuntimeError: called on a rank that is not the leader.
        """
        if not self.is_leader:
            raise RuntimeError("only the leader reassigns shards")
        self._inbox.put(("reassign", shard, owner, from_version))

    # ------------------------------------------------------------------------------------------- statistics
    def record(self, version: int) -> Optional[StepRecord]:
        """The leader's record of a closed version (None on other ranks or once dropped)."""
        return self.leader.record(version) if self.leader is not None else None

    def rank_stats(self) -> list[dict[str, float]]:
        """One dict per rank (``rank``, ``admitted``, ``late``, ``skipped``, ``mean_lag_s``): live on the leader;
        on the other ranks the final table once the runtime stopped, else an empty list."""
        if self.leader is not None:
            return self.leader.rank_stats()
        return list(self.final_stats or [])

    def _receives(self, rank: int, version: int) -> bool:
        """Whether ``rank`` gets the aggregate of ``version`` (not in one of its detached spans)."""
        with self._gap_lock:
            for start, end in self._gaps.get(rank, ()):
                if start <= version and (end is None or version < end):
                    return False
        return True

    def _set_gap(self, rank: int, version: int, detach: bool) -> None:
        """Open (``detach``) or close ``rank``'s span of versions without aggregates at ``version``."""
        with self._gap_lock:
            spans = self._gaps.setdefault(rank, [])
            if detach:
                spans.append((version, None))
            elif spans and spans[-1][1] is None:
                spans[-1] = (spans[-1][0], version)
            if len(spans) > 16:  # old spans end long before any version still published
                del spans[0]

    def buffer_stats(self) -> dict[str, int]:
        """High-water marks and totals of the buffers and bytes this rank handled."""
        return {
            "mailbox_high_water": self.mailbox.high_water,
            "aggregate_buffers": self.mailbox.allocated,
            "code_messages": len(self._codes),
            "code_recv_buffers": self._code_pool.allocated,
            "aggregate_send_buffers": self._agg_pool.allocated,
            "bytes_sent": self.bytes_sent,
            "bytes_received": self.bytes_received,
            "rejected": self.rejected,
        }

    def _count(self, sent: int = 0, received: int = 0) -> None:
        with self._bytes_lock:
            self.bytes_sent += sent
            self.bytes_received += received

    # ---------------------------------------------------------------------------------------------- threads
    def _send_all(
        self, channel: Channel, message: Tensor, peers: Sequence[int], done: Optional[Callable[[], None]] = None
    ) -> None:
        handles: list[Handle] = []
        for p in peers:
            if p in self._broken:
                continue
            try:
                handles.append(self.transport.isend(channel, p, message))
            except Exception as exc:  # a peer that is gone; its streams report it
                self._broken.add(p)
                log.warning("PGC rank %d: send to rank %d failed: %r", self.rank, p, exc)
        self._count(sent=len(handles) * message.numel() * message.element_size())
        self._reaper_q.put((handles, done))

    def _send_small(self, channel: Channel, message: Tensor, peer: int) -> None:
        """Send a small control message from any thread (one lock per rank keeps sends on a stream ordered)."""
        with self._small_lock:
            self._send_all(channel, message, [peer])

    def _send_beats(self, _: int) -> None:
        """Worker: a heartbeat with this rank's progress every ``heartbeat_interval`` until :meth:`stop` (to the
        current leader; it ends if this rank takes over as leader)."""
        while not self._beats_done.wait(self.heartbeat_interval):
            leader = self.leader_rank
            if leader == self.rank:
                return
            self._send_small(Channel.BEAT, control(self.world_size, Kind.BEAT, self.progress), leader)

    def _to_leader(self, kind: Kind, version: int, a: int = 0, b: int = 0) -> None:
        """A small message to the leader (its own inbox if this rank is the leader, or is taking over)."""
        if self.leader_rank == self.rank:
            self._inbox.put(
                (kind.name.lower(), self.rank, version, a, b)
                if kind == Kind.LOST
                else (kind.name.lower(), self.rank, version, time.monotonic(), a)
            )
        else:
            self._send_small(Channel.BEAT, control(self.world_size, kind, version, a, b), self.leader_rank)

    def _receive_beats(self, peer: int) -> None:
        """Leader: heartbeats, rejected codes and rejoin requests of ``peer``."""
        buf = torch.zeros(control_numel(self.world_size), dtype=torch.int64)
        while True:
            try:
                self.transport.recv(Channel.BEAT, peer, buf)
            except Exception:  # the code stream reports the loss
                return
            kind, version, a, b, _ = read_control(buf)
            if kind == Kind.BYE:
                return
            if kind == Kind.LOST:
                self._inbox.put(("lost", peer, version, a, b))
                continue
            self._inbox.put((kind.name.lower(), peer, version, time.monotonic(), a))

    def _reap(self, _: int) -> None:
        """Wait for sends in order and release their buffers (gloo reads them asynchronously)."""
        while True:
            item = self._reaper_q.get()
            if item is None:
                return
            handles, done = item
            for h in handles:
                try:
                    h.wait()
                except Exception as exc:
                    log.debug("PGC rank %d: a send failed: %r", self.rank, exc)
            if done is not None:
                done()

    def _receive_codes(self, peer: int) -> None:
        while True:
            buf = self._code_pool.get()
            try:
                self.transport.recv(Channel.CODE, peer, buf)
            except Exception as exc:  # the peer's process is gone
                self._broken.add(peer)
                self._inbox.put(("dead", peer, repr(exc)))
                return
            arrived = time.monotonic()
            self._count(received=buf.numel() * buf.element_size())
            header = read_header(buf)
            if header.kind == Kind.BYE:
                self._finished.add(peer)  # its training is over: it needs no more aggregates
                if header.valid == 1:  # it left early (SIGTERM): its process is about to exit, send it nothing
                    self._broken.add(peer)
                self._inbox.put(("bye", peer, header.skipped, header.valid == 1))
                self._code_pool.put(buf)
                return
            self._inbox.put(("code", header, buf, arrived, False))

    def _receive_aggregates(self, peer: int) -> None:
        buf = self._agg_pool.get()
        while True:
            try:
                self.transport.recv(Channel.AGG, peer, buf)
            except Exception as exc:
                self._broken.add(peer)
                shards = self.owners.shards_of(peer, LATEST)
                leader_lost = self._fails_over(peer)
                if leader_lost:  # every aggregate it sent is in (the stream is ordered): report, then move on
                    self._leader_gone(peer, repr(exc))
                if not self._stopping.is_set() and shards and peer not in self._fenced:
                    if peer == self.leader_rank and not leader_lost:
                        self.mailbox.abort(f"lost the PGC leader (rank {peer}, owner of shard 0): {exc!r}")
                    else:
                        self._report_lost(peer, shards)
                return
            self._count(received=buf.numel() * buf.element_size())
            header = read_header(buf)
            if header.kind == Kind.BYE:
                shards = self.owners.shards_of(peer, LATEST)
                if header.valid == 1 and shards and not self._stopping.is_set() and peer not in self._fenced:
                    self._report_lost(peer, shards)  # an owner that left early (SIGTERM): its shards move
                return
            note = header.valid if header.shard == 0 and header.valid > 0 else None
            table = header.table if header.shard == 0 and header.table else None
            with self._fence_locks[peer]:
                if header.version < self._fenced.get(peer, -1):
                    continue  # a frozen owner's shard, moved to another rank
                self.mailbox.put_shard(header.version, header.shard, buf[self._hn_down :], note, table)
                self._shard_seen[header.shard] = max(self._shard_seen[header.shard], header.version)

    def _fence(self, owner: int) -> None:
        """Owner ``owner`` froze and its shards move: accept none of its shards from now on (a stale one sent
        when it resumes would differ from the new owner's), and report what arrived (:meth:`_report_lost`)."""
        with self._fence_locks[owner]:
            self._fenced[owner] = LATEST
            self._report_lost(owner, self.owners.shards_of(owner, LATEST))

    def _report_lost(self, owner: int, shards: list[int]) -> None:
        """The aggregate stream of shard owner ``owner`` broke (its process is gone): tell the leader the last
        version of each of its shards that arrived here (the stream is ordered, so every older one did too)."""
        for j in shards:
            self._to_leader(Kind.LOST, self._shard_seen[j], owner, j)

    def _receive_control(self, leader: int) -> None:
        buf = torch.zeros(control_numel(self.world_size), dtype=torch.int64)
        while True:
            try:
                self.transport.recv(Channel.CTRL, leader, buf)
            except Exception as exc:
                if self._fails_over(leader):
                    self._leader_gone(leader, repr(exc))
                    return
                if not self._stopping.is_set():
                    self.mailbox.abort(f"lost the connection to the PGC leader: {exc!r}")
                self._inbox.put(("stop", None, None))
                return
            self._count(received=buf.numel() * 8)
            kind, version, a, b, data = read_control(buf)
            if leader != self.leader_rank:  # a leader that froze and was replaced: what it sent on resuming is void
                if kind == Kind.BYE:
                    return
                continue
            self._leader_heard = time.monotonic()
            if kind == Kind.BEAT:
                self.alive = a
                self._frontier = version
                continue
            if kind in (Kind.DETACH, Kind.ATTACH):  # through the inbox: ordered with the decisions
                if kind == Kind.ATTACH:  # a donor sends from wait(version), or else when its aggregate came
                    self._note_attach(version, a, b)
                self._inbox.put((kind.name.lower(), version, a, b))
            elif kind == Kind.DECIDE:
                self._inbox.put(("decide", version, read_decide(version, a, b, data)))
            elif kind == Kind.ASSIGN:
                self._apply_assign(a, b, version)
            elif kind == Kind.QUERY:
                self._fence(a)
            elif kind == Kind.STOP:
                self._inbox.put(("stop", version, data.clone()))
                return
            elif kind == Kind.ABORT:
                text = payload_text(data[1 : 1 + int(data[0])].clone())
                self.mailbox.abort(f"the PGC leader failed: {text}")
                self._inbox.put(("stop", None, None))
                return

    def _fails_over(self, peer: int) -> bool:
        """Whether ``peer``'s broken stream means a leader to replace (or one already replaced) rather than the end."""
        return self.failover and (peer == self.leader_rank or peer in self._deposed)

    def _leader_gone(self, dead: int, why: str, frozen: bool = False) -> None:
        """Any thread: the streams of leader ``dead`` broke (its process is gone). The lowest rank whose streams are
        up takes over; every rank makes the same choice, since every stream of a dead process breaks (a rank that
        picked a successor that is dead too moves on when that one's streams break). Heartbeats, control messages,
        reports and collectives go to the successor from now on; it builds its control plane on its service thread
        (:meth:`_take_over`) and moves the dead leader's shards as a dead owner's (:meth:`_recover`). A ``frozen``
        leader (alive, silent) is fenced first, as a frozen owner is (:meth:`_fence`), and is told to step down."""
        with self._failover_lock:
            if dead != self.leader_rank:
                return  # already handled (another of its streams broke first)
            if not frozen:
                self._broken.add(dead)
            self._deposed.add(dead)
            successor = min(r for r in range(self.world_size) if r not in self._broken and r not in self._deposed)
            self._inbox.put(("succeed", dead, successor, frozen))  # before anyone can see the new leader_rank
            self.leader_rank = successor
            self._leader_heard = time.monotonic()
            self.successions.append((dead, successor))
        log.warning(
            "PGC rank %d: the leader (rank %d) is %s at version %d (%s); rank %d takes over",
            self.rank,
            dead,
            "frozen" if frozen else "gone",
            self.progress,
            why,
            successor,
        )
        self.collectives.gather.set_leader(successor, gone=not frozen)
        if frozen:
            self._fence(dead)  # accept none of its shards from now on, and report what arrived (to the successor)

    def _watch_leader(self, now: float) -> None:
        """Service thread of a worker (with failover): a leader silent for a heartbeat window froze; replace it. If
        this loop itself did not run for a while (this process was frozen or busy), the leader's heartbeats may be
        waiting in the socket: it gets a window from now first."""
        if now - self._watched > 3 * self.heartbeat_interval:
            self._watch_grace = now
        self._watched = now
        silent = now - max(self._leader_heard, self._watch_grace)
        if silent > self.heartbeat_window:
            self._leader_gone(self.leader_rank, f"no heartbeat for {silent:.1f} s", frozen=True)

    def _step_down(self, successor: int, now: float) -> None:
        """Service thread of a leader that froze and was replaced (``DEPOSE``): go on as a worker. The control
        messages the successor sent meanwhile (its DETACH of this rank, ASSIGN of shard 0) wait in the stream; this
        rank reads them, finds itself detached and rejoins by state transfer."""
        with self._failover_lock:
            self.leader = None
            self._recovery = None
            self._deposed.add(self.rank)
            self.leader_rank = successor
            self._leader_heard = self._watch_grace = now
            self.successions.append((self.rank, successor))
        log.warning(
            "PGC rank %d: rank %d took over as leader while this rank was frozen; this rank goes on as a "
            "worker (it rejoins by state transfer)",
            self.rank,
            successor,
        )
        self.collectives.gather.set_leader(successor, gone=False)
        self._spawn(self._receive_control, successor, name=f"pgc-ctrl-recv-{successor}")
        self._spawn(self._send_beats, -1, name="pgc-beat")

    def _take_over(self, dead: int, now: float, frozen: bool) -> None:
        """Service thread, on the successor of leader ``dead``: a control plane at the first version whose shard 0
        did not arrive here (:meth:`_recover` corrects it from every rank's report), with what every rank knows:
        who finished, who is gone, who is detached. Statistics and records start afresh. A ``frozen`` leader is
        detached (no more aggregates; it rejoins by state transfer) and told to step down when it resumes."""
        leader = self._make_leader(
            self.scheme, self.world_size, self._shard_seen[0] + 1, self.timeout, self.max_lag, self.heartbeat_window
        )
        for r in self._finished:
            leader.on_bye(r)
        for r in self._broken:
            leader.on_dead(r)
        with self._gap_lock:
            for r, spans in self._gaps.items():
                if spans and spans[-1][1] is None:
                    leader.detached[r] = spans[-1][0]
        if frozen and dead not in leader.detached:  # from before anything this rank lacks: safe, if early
            start = self._shard_seen[0] + 1
            leader.detached[dead] = start
            self._send_all(Channel.CTRL, control(self.world_size, Kind.DETACH, start, dead), self.peers)
            self._set_gap(dead, start, detach=True)
        if frozen:
            self._send_small(Channel.BEAT, control(self.world_size, Kind.DEPOSE, leader.version, self.rank), dead)
        self.leader = leader
        for peer in self.peers:
            if peer not in self._broken:  # (a frozen leader too: it beats here once it stepped down)
                self._spawn(self._receive_beats, peer, name=f"pgc-beat-recv-{peer}")
        self._lose(dead, self.owners.shards_of(dead, LATEST), now)
        assert self._recovery is not None
        self._recovery.failover = True
        log.warning(
            "PGC rank %d is the leader now (rank %d %s); shard 0 moves here and the next version is decided "
            "once every live rank reported what it got",
            self.rank,
            dead,
            "froze" if frozen else "died",
        )

    def _apply_assign(self, shard: int, owner: int, from_version: int) -> None:
        """Take a reassignment into account and re-send kept codes that went to the old owner: those of versions
        from ``from_version`` on that this rank has not completed, and under bounded staleness every code it kept
        (its last ``c`` versions: a later version's entry may name it). A new leader (shard 0 moves) is told again of
        this rank's rejected codes of those versions: without them it could wait for ever for codes that never come."""
        if owner in self._fenced:  # a frozen owner that came back owns a shard again: its new shards count
            with self._fence_locks[owner]:
                self._fenced[owner] = min(self._fenced[owner], from_version)
        with self._send_lock:
            old = self.owners.owner(shard, from_version)
            self.owners.reassign(shard, owner, from_version)
            # Oldest first: a stream is ordered, so once a rank's code of a version arrived, its older ones have too
            # (the bounded leader relies on it to tell a partition no code can cover any more).
            for code in sorted(self._codes, key=lambda c: c.version):
                if old == owner or code.version < 0:
                    continue
                if self.scheme.reuses_codes:
                    resend = code.version > from_version - self.kept_versions
                else:
                    resend = code.version >= from_version and not self.mailbox.has(code.version)
                if resend:
                    self._send_code_shard(code, shard, owner)
        if shard == 0 and old != owner:
            for version in self._rejects:
                if version >= from_version:
                    self._to_leader(Kind.REJECT, version)

    # ------------------------------------------------------------------------------------------- service loop
    def _serve_safely(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # surfaced to the local worker, and by the leader to the peers as ABORT
            self.error = exc
            log.error("PGC rank %d runtime failed: %s", self.rank, exc)
            self.mailbox.abort(exc)
            if self.is_leader:
                room = control_numel(self.world_size) - CONTROL_FIELDS - 1  # words after the length word
                text = text_payload(f"{type(exc).__name__}: {exc}", room, torch.int64)
                version = self.leader.version if self.leader is not None else -1
                self._send_all(
                    Channel.CTRL,
                    control(self.world_size, Kind.ABORT, version, data=torch.cat([torch.tensor([text.numel()]), text])),
                    self.peers,
                )
            self._say_agg_bye()

    def _say_agg_bye(self, leaving: bool = False) -> None:
        """BYE on this rank's aggregate streams (``leaving``: it leaves early, so its shards are lost)."""
        bye = torch.zeros(message_numel(self.layout.shard_numel, self.down_dtype), dtype=self.down_dtype)
        write_header(bye, Header(Kind.BYE, -1, self.rank, valid=int(leaving)))
        self._send_all(Channel.AGG, bye, self.peers)

    def _serve(self) -> None:
        pending: dict[int, dict[int, dict[int, tuple[Tensor, bool]]]] = {}  # version -> shard -> rank -> buf
        decided: dict[int, list[tuple[int, int, int]]] = {}  # version -> (decode key, rank, code version)
        done_below = -1  # every version < done_below is aggregated here (or never will be)
        leader = self.leader
        rejoins: list[int] = []  # leader: ranks waiting to rejoin (one per open version)
        last_beat = 0.0
        missing: set[int] = set()  # leader: ranks reported missing (no heartbeat or stream broken)

        def recycle(buf: Tensor, local: bool) -> None:
            if not local:
                self._code_pool.put(buf)

        while True:
            # Drain everything that is already here before deciding: codes that arrived together are admitted
            # together (no bias toward whichever receiver thread the scheduler woke first).
            try:
                batch = [self._inbox.get(timeout=0.05)]
            except queue.Empty:
                batch = []
            while True:
                try:
                    batch.append(self._inbox.get_nowait())
                except queue.Empty:
                    break
            now = time.monotonic()
            if self.frozen_failover and self.is_leader and now - self._service_tick > self.heartbeat_window:
                self._doubt_since = now  # this process stopped for a window: the others may have replaced it
            self._service_tick = now
            for item in batch:
                tag = item[0]
                leader = self.leader  # a successor becomes the leader between two items
                if tag == "code":
                    _, header, buf, arrived, local = item
                    if leader is not None and header.shard == 0:
                        leader.on_code(header, arrived)
                    if header.version < self._keep_from and not self._owed(header.version, header.shard):
                        recycle(buf, local)  # late: no aggregate will use it
                    else:
                        slot = pending.setdefault(header.version, {}).setdefault(header.shard, {})
                        if header.sender in slot:
                            recycle(*slot[header.sender])
                        slot[header.sender] = (buf, local)
                elif tag == "decide":
                    decided[item[1]] = item[2]
                elif tag == "beat" and leader is not None:
                    leader.on_beat(item[1], item[2], item[3])
                elif tag == "reject" and leader is not None:
                    log.warning("PGC: rank %d's code for version %d is not finite: not used", item[1], item[2])
                    leader.on_reject(item[1], item[2], item[3])
                elif tag == "rejoin" and leader is not None:
                    leader.on_beat(item[1], item[2], item[3])
                    failed = item[4] - 1  # a donor whose stream broke while it sent this rank the state
                    if failed >= 0 and failed != self.rank:
                        self._on_dead(leader, failed, f"its state transfer to rank {item[1]} broke")
                    if item[1] not in rejoins:
                        rejoins.append(item[1])
                elif tag in ("detach", "attach"):
                    _, version, rank, donor = item
                    self._set_gap(rank, version, detach=tag == "detach")
                    if tag == "attach" and rank == self.rank:
                        self._attach_info = (version, donor)
                        self._attached.set()
                elif tag == "bye" and leader is not None:
                    leader.on_bye(item[1], item[2])
                    if item[3]:
                        shards = self.owners.shards_of(item[1], LATEST)
                        log.warning(
                            "PGC: rank %d left at version %d (SIGTERM on that rank); training goes on with "
                            "%d of %d ranks%s",
                            item[1],
                            leader.version,
                            len(leader.alive(now)),
                            self.world_size,
                            f" (its shard(s) {shards} move to live ranks)" if shards else "",
                        )
                        if shards:
                            leader.drop_open(item[1])  # its code's own shard left with it
                            self._lose(item[1], shards, now)
                elif tag == "succeed":
                    _, dead, successor, frozen = item
                    if successor == self.leader_rank == self.rank and self.leader is None:
                        self._take_over(dead, now, frozen)
                    elif successor == self.leader_rank != self.rank:
                        self._spawn(self._receive_control, successor, name=f"pgc-ctrl-recv-{successor}")
                elif tag == "depose" and leader is not None:
                    self._step_down(item[1], now)
                elif tag == "dead" and self.failover and item[1] == self.leader_rank:
                    self._leader_gone(item[1], item[2])
                elif tag == "dead" and leader is not None:
                    self._on_dead(leader, item[1], item[2])
                elif tag == "lost" and leader is not None:
                    _, reporter, seen, owner, shard = item
                    self._lost.setdefault((owner, shard), {})[reporter] = seen
                elif tag == "reassign" and leader is not None:
                    _, shard, owner, from_version = item
                    if from_version < leader.version:
                        raise CoordinatorError(
                            f"cannot reassign shard {shard} from version {from_version}: "
                            f"versions before {leader.version} are closed"
                        )
                    if shard == 0:
                        raise CoordinatorError("shard 0 belongs to the leader (its arrivals announce the codes)")
                    self._send_all(
                        Channel.CTRL, control(self.world_size, Kind.ASSIGN, from_version, shard, owner), self.peers
                    )
                    self._apply_assign(shard, owner, from_version)
                elif tag == "stop":
                    _, final, stats = item
                    if final is not None:
                        self._read_final_stats(stats)
                    self._say_agg_bye()
                    return

            if self.leader is None and self.frozen_failover:
                self._watch_leader(now)
            if leader is not None:
                leader.on_beat(self.rank, self.progress, now)
                rec = leader.try_close(now)
                if rec is not None:
                    for r in leader.detach(rec.version):
                        log.warning(
                            "PGC: rank %d is more than %d versions behind at version %d: detached (it "
                            "rejoins by state transfer)",
                            r,
                            leader.max_lag,
                            rec.version,
                        )
                        self._send_all(Channel.CTRL, control(self.world_size, Kind.DETACH, rec.version, r), self.peers)
                        self._set_gap(r, rec.version, detach=True)
                    owners = self.owners.owners(rec.version) - {self.rank}
                    a, b, words = decide_words(rec.version, rec.plan())
                    message = control(self.world_size, Kind.DECIDE, rec.version, a, b, data=words)
                    self._send_all(Channel.CTRL, message, sorted(owners))
                    decided[rec.version] = rec.plan()
                # A successor attaches nobody before every rank reported and it reopened the right version (it
                # starts from what reached it, which may be a version behind).
                settling = self._recovery is not None and self._recovery.failover
                while rejoins and not settling:
                    self._attach(leader, rejoins.pop(0))
                if self._stopping.is_set():  # the leader's training is over: versions >= its own never close
                    for v in [v for v in self._notes if v >= leader.version]:
                        for rank in [r for r, d in self._notes[v] if d == self.rank]:
                            self._final_requests.put((rank, v))
                        self._notes[v] = [(r, d) for r, d in self._notes[v] if d != self.rank]
                now_missing = set(leader.missing(now))
                for r in sorted(now_missing - missing):
                    log.warning(
                        "PGC: rank %d is missing (no heartbeat for %.1f s, or its process is gone) at version %d",
                        r,
                        self.heartbeat_window,
                        leader.version,
                    )
                for r in sorted(missing - now_missing - leader.byes):
                    log.warning("PGC: rank %d is alive again at version %d", r, leader.version)
                missing = now_missing
                if now - last_beat >= self.heartbeat_interval:
                    last_beat = now
                    self.alive = len(leader.alive(now))
                    self._send_all(
                        Channel.CTRL, control(self.world_size, Kind.BEAT, leader.version, self.alive), self.peers
                    )
                leader.check(now)
                self._check_owners(leader, now)
                if self._recovery is not None:
                    self._recover(leader, self._recovery, now, decided)
            done_below = self._aggregate_ready(pending, decided, done_below, recycle)

            if leader is not None and self._stopping.is_set():
                if all(p in leader.byes or leader.gone(p, now) for p in self.peers):
                    missing = [p for p in self.peers if p not in leader.byes]
                    if missing:
                        log.warning(
                            "PGC: ranks %s did not finish (process gone, or no heartbeat for %.1f s)",
                            missing,
                            self.heartbeat_window + self.timeout,
                        )
                    stats = torch.tensor(leader.stats_words(), dtype=torch.float64).view(torch.int64)
                    self._send_all(
                        Channel.CTRL, control(self.world_size, Kind.STOP, leader.version, data=stats), self.peers
                    )
                    self._say_agg_bye()
                    return

    def _on_dead(self, leader: Leader, rank: int, why: str) -> None:
        """Leader: ``rank``'s code stream broke (its process is gone). Up to ``s`` dead ranks are survived; the
        shards a dead rank owned move to live ranks (:meth:`_recover`). Under bounded staleness none of its codes
        enters an aggregate again (one may not have reached every owner)."""
        if rank in leader.byes or rank in leader.dead:
            return
        leader.on_dead(rank)
        leader.forget(rank, leader.version - self.kept_versions)
        shards = self.owners.shards_of(rank, LATEST)
        now = time.monotonic()
        if shards:
            self._lose(rank, shards, now)
        alive = len(leader.alive(now))
        log.warning(
            "PGC: rank %d died at version %d (%s); training goes on without it%s: %d of %d ranks alive, "
            "scheme '%s' needs %d",
            rank,
            leader.version,
            why,
            f" (its shard(s) {shards} move to live ranks)" if shards else "",
            alive,
            self.world_size,
            self.scheme.name,
            self.scheme.wait_for,
        )

    def _check_owners(self, leader: Leader, now: float) -> None:
        """Leader: a shard owner that missed its heartbeats for a window (frozen: its streams stay up) holds up every
        rank. Its shards move as a dead owner's do, after every rank fenced it off (:meth:`_fence`); it is detached,
        so if it resumes it rejoins by state transfer."""
        if now - self._owners_checked > 3 * self.heartbeat_interval:
            self._owners_grace = now + self.heartbeat_window  # this loop did not run for a while (busy process):
            # the owners' heartbeats may still be in the sockets, so give them a window from now
        self._owners_checked = now
        if now < self._owners_grace:
            return
        for r in sorted(self.owners.owners(LATEST) - {self.rank}):
            if r in leader.dead or r in leader.byes or self._fenced.get(r) == LATEST or leader.is_alive(r, now):
                continue
            shards = self.owners.shards_of(r, LATEST)
            log.warning(
                "PGC: rank %d owns shards %s and sent no heartbeat for %.1f s (frozen) at version %d: its "
                "shards move to live ranks; it is detached and rejoins by state transfer if it resumes",
                r,
                shards,
                self.heartbeat_window,
                leader.version,
            )
            leader.drop_open(r)
            if r not in leader.detached:  # (a rank detached for lagging keeps its span)
                start = leader.progress[r]
                leader.detached[r] = start
                self._send_all(Channel.CTRL, control(self.world_size, Kind.DETACH, start, r), self.peers)
                self._set_gap(r, start, detach=True)
            self._send_all(
                Channel.CTRL, control(self.world_size, Kind.QUERY, leader.version, r), [p for p in self.peers if p != r]
            )
            self._fence(r)
            self._lose(r, shards, now)

    def _lose(self, owner: int, shards: list[int], now: float) -> None:
        """Leader: ``owner``'s ``shards`` are to move (:meth:`_recover`); the reports about them get a window. Under
        bounded staleness none of its codes enters an aggregate again (its own shard of each died with it)."""
        if self.leader is not None:
            self.leader.forget(owner, self.leader.version - self.kept_versions)
        if self._recovery is None:
            self._recovery = _Recovery(since=now)
        self._recovery.lost.extend(k for k in ((owner, j) for j in shards) if k not in self._recovery.lost)
        self._recovery.since = now

    def _recover(self, leader: Leader, rec: "_Recovery", now: float, decided: dict) -> None:
        """Leader: move the shards of dead owners to live ranks, once every live attached rank said which of their
        versions it got (or a heartbeat window passed).

        Let ``A`` be the last version some live rank got every lost shard of. A rank that got less is detached
        (it cannot complete a version others applied, so it rejoins by state transfer). The shards are reassigned
        from ``A + 1``: ranks re-send their kept codes to the new owners. If ``A + 1`` is closed (nobody could
        complete it, as the owner died before publishing it), it is decided again for the shards not published
        yet, with the live ranks whose codes for it arrived (:meth:`_rebuild`).

        Raises:
            CoordinatorError: the reports do not add up, no live rank can own a shard, or the version to decode
                again cannot get enough live codes within ``timeout``.
        """
        if rec.rebuild is None:
            gone = leader.dead | leader.byes | self._broken
            expected = [r for r in range(self.world_size) if r not in gone and r not in leader.detached]
            got_all = [r for r in expected if all(r in self._lost.get(key, {}) for key in rec.lost)]
            if len(got_all) < len(expected) and now - rec.since < self.heartbeat_window:
                return
            unknown = -1 if rec.failover else leader.start_version - 1  # a rank that did not report: detach it from
            # as early as it may lack (detaching a rank that is further on costs it a state transfer, nothing more)
            last = {r: min(self._lost.get(key, {}).get(r, unknown) for key in rec.lost) for r in expected}
            version = leader.version
            top = max(last.values(), default=version - 1)  # A
            if rec.failover:  # a successor: the dead leader's last decisions are unknown, A + 1 is decided afresh
                version = top + 1
                leader.reopen(version, now)
            elif not version - 2 <= top <= version - 1:
                raise CoordinatorError(
                    f"dead shard owner(s) {rec.dead()}: the live ranks got their shards up to "
                    f"version {top}, but version {version} is open (expected {version - 1} or "
                    f"{version - 2}); {last}"
                )
            behind = [r for r in expected if last[r] < top]
            for r in behind:
                start = last[r] + 1 if rec.failover else max(last[r] + 1, leader.start_version)
                log.warning(
                    "PGC: rank %d did not get the shards %s of version %d from lost owner(s) %s (others did): "
                    "detached, it rejoins by state transfer",
                    r,
                    rec.shards(),
                    start,
                    rec.dead(),
                )
                leader.detached[r] = start
                self._send_all(Channel.CTRL, control(self.world_size, Kind.DETACH, start, r), self.peers)
                self._set_gap(r, start, detach=True)
            owners = [r for r in expected if r not in behind and leader.is_alive(r, now)]
            if not owners:
                raise CoordinatorError(f"shards {rec.shards()} of lost owner(s) {rec.dead()}: no live rank to own them")
            counts = {r: len(self.owners.shards_of(r, LATEST)) for r in owners}
            moved = []
            for j in rec.shards():
                if j == 0:  # its arrivals announce the codes: it goes with the control plane
                    moved.append((0, self.rank))
                    continue
                owner = min(owners, key=lambda r: (counts[r], r == self.rank, r))
                counts[owner] += 1
                moved.append((j, owner))
            log.warning(
                "PGC: shards of lost owner(s) %s move from version %d on: %s",
                rec.dead(),
                top + 1,
                ", ".join(f"shard {j} to rank {o}" for j, o in moved),
            )
            for j, owner in moved:
                self._send_all(Channel.CTRL, control(self.world_size, Kind.ASSIGN, top + 1, j, owner), self.peers)
                self._apply_assign(j, owner, top + 1)
            if top + 1 == version:  # every closed version reached some live rank whole
                self._recovery = None
                return
            rec.rebuild = top + 1
        self._rebuild(leader, rec, now, decided)

    def _rebuild(self, leader: Leader, rec: "_Recovery", now: float, decided: dict) -> None:
        """Leader: decide version ``rec.rebuild`` again, without the dead ranks, for the shards nobody published:
        the live ranks whose codes for it arrived (admitted, then late, in arrival order) once they decode. Every
        owner publishes only the shards it has not published (the new owners: the lost ones), so each rank's
        aggregate is whole, identical on every rank and, for exact schemes, the same gradient up to rounding."""
        version = rec.rebuild
        assert version is not None
        if self.scheme.reuses_codes:  # bounded staleness: the same entries, the lost ranks' replaced by live codes
            self._replan(leader, rec, now, decided, leader.dead | self._broken)  # (a detached rank re-sends its own)
            return
        record = leader.record(version)
        gone = leader.dead | self._broken | set(leader.detached)
        arrived = [] if record is None else record.admitted + sorted(record.late, key=record.late.__getitem__)
        order = [r for r in arrived if r not in gone]
        if order and self.scheme.admits(order):
            log.warning(
                "PGC: version %d (closed with ranks %s) is decoded again for shards %s from ranks %s",
                version,
                [] if record is None else record.admitted,
                rec.shards(),
                order,
            )
            self._decide_again(version, [(k, k, version) for k in order], decided)
            return
        could = set(order) | {r for r in leader.alive(now) if r not in gone}
        if could and self.scheme.admits(sorted(could)):
            rec.short_since = None
            return
        if self._short_too_long(rec, now):
            raise CoordinatorError(
                f"version {version} was closed with lost owner(s) {rec.dead()}, which owned shards {rec.shards()}, and "
                f"cannot be decoded again: live codes for it came from ranks {order}, live ranks that may still "
                f"send one: {sorted(could - set(order))}; scheme '{self.scheme.name}' needs {self.scheme.wait_for}"
            )

    def _replan(self, leader: Leader, rec: "_Recovery", now: float, decided: dict, gone: set[int]) -> None:
        """Leader, bounded staleness: decide version ``rec.rebuild`` again for the shards nobody published, with the
        entries it closed with; an entry of a lost rank (whose own shard of the code died with it) is replaced by the
        newest live code of that partition within the window (:meth:`BoundedLeader.replan`). Every rank applies the
        same aggregate; the lost shards' entries may differ from the other shards' for this one version."""
        version = rec.rebuild
        assert version is not None
        if not isinstance(leader, BoundedLeader):
            raise CoordinatorError(
                f"scheme '{self.scheme.name}' reuses codes across versions and needs a BoundedLeader, "
                f"got {type(leader).__name__}"
            )
        plan = leader.replan(version, gone, self.kept_versions)
        if plan is not None:
            log.warning(
                "PGC: version %d is decoded again for shards %s of lost owner(s) %s with entries %s",
                version,
                rec.shards(),
                rec.dead(),
                plan,
            )
            self._decide_again(version, plan, decided)
            return
        if self._short_too_long(rec, now):
            raise CoordinatorError(
                f"version {version} was closed with lost owner(s) {rec.dead()}, which owned shards {rec.shards()}, and "
                f"cannot be decoded again: some partition has no live code younger than the window c="
                f"{self.scheme.window}. Raise `replication` or `staleness`"
            )

    def _decide_again(self, version: int, plan: list[tuple[int, int, int]], decided: dict) -> None:
        """Leader: send every other owner the new plan of ``version`` (each publishes only the shards it has not)."""
        a, b, words = decide_words(version, plan)
        message = control(self.world_size, Kind.DECIDE, version, a, b, data=words)
        self._send_all(Channel.CTRL, message, sorted(self.owners.owners(version) - {self.rank}))
        decided[version] = plan
        self._recovery = None

    def _short_too_long(self, rec: "_Recovery", now: float) -> bool:
        """Leader: whether the version to decode again has lacked the codes it needs for over ``timeout``."""
        if rec.short_since is None:
            rec.short_since = now
        return now - rec.short_since > self.timeout

    def _members(self) -> set[int]:
        """Leader: the ranks a collective waits for (not finished, not dead, not silent past window + timeout)."""
        leader, now = self.leader, time.monotonic()
        if leader is None:  # a successor taking over: its control plane is being built
            return {r for r in range(self.world_size) if r not in self._broken and r not in self._finished}
        return {
            r
            for r in range(self.world_size)
            if r not in leader.byes and r not in self._broken and not leader.gone(r, now)
        }

    def failure(self) -> Optional[BaseException]:
        """The error that ended this runtime (its own, or the leader's ABORT), or None (any time, any thread)."""
        return self.error if self.error is not None else self.mailbox.failure()

    def _attach(self, leader: Leader, rank: int) -> None:
        """Leader: ``rank`` gets aggregates again from the open version on; a donor sends it the state."""
        finished = self._stopping.is_set()
        u, donor = leader.on_rejoin(rank, self.rank, finished)
        self._send_all(Channel.CTRL, control(self.world_size, Kind.ATTACH, u, rank, donor), self.peers)
        self._set_gap(rank, u, detach=False)
        if rank == self.rank:
            self._attach_info = (u, donor)
            self._attached.set()
        if finished and donor == self.rank:
            self._final_requests.put((rank, u))
        else:
            self._note_attach(u, rank, donor)
            self._notes.setdefault(u, []).append((rank, donor))  # their count travels in shard 0 of u's aggregate

    def _read_final_stats(self, words: Tensor) -> None:
        values = words[: STAT_FIELDS * self.world_size].view(torch.float64).tolist()
        self.final_stats = []
        for r in range(self.world_size):
            row = dict(zip(STAT_NAMES, values[STAT_FIELDS * r : STAT_FIELDS * (r + 1)]))
            self.final_stats.append({"rank": r, **{k: v if k == "mean_lag_s" else int(v) for k, v in row.items()}})

    def _aggregate_ready(
        self,
        pending: dict,
        decided: dict[int, list[tuple[int, int, int]]],
        done_below: int,
        recycle: Callable[[Tensor, bool], None],
    ) -> int:
        """Decode and publish every decided version whose admitted codes all arrived, oldest first.

        Codes older than every code the last aggregate used are dropped; unless ``scheme.reuses_codes`` (bounded
        staleness: an entry serves later versions too), that is every code of the aggregated versions.
        """
        while decided:
            version = min(decided)
            plan = decided[version]
            served = self._served.setdefault(version, set())
            shards = [j for j in self.owners.shards_of(self.rank, version) if j not in served]
            used = [(key, k, v) for key, k, v in plan if k >= 0]  # (bounded: rank -1 marks a partition left out)
            if any(k not in pending.get(v, {}).get(j, {}) for j in shards for _, k, v in used):
                break  # an admitted code's shard is still on its way
            ordered = sorted(plan)  # summed in decode-key order, not arrival order: the same set gives the same bits
            for j in shards:
                codes = [(key, pending[v][j][k][0]) for key, k, v in ordered if k >= 0]
                self._publish_shard(version, j, codes, ordered)
                served.add(j)
            del decided[version]
            done_below = max(done_below, version + 1)
            # (bounded staleness: the oldest entry in use, and no later than the codes ranks keep for re-sends)
            reused = (
                min([v for _, _, v in plan] + [version + 1 - self.kept_versions])
                if self.scheme.reuses_codes
                else done_below
            )
            self._keep_from = max(self._keep_from, reused)
            self._served_floor = max(self._served_floor, done_below - SERVED_KEPT)
            for v in [v for v in self._served if v < self._served_floor]:
                del self._served[v]
            for v in [v for v in pending if v < self._keep_from]:
                for j in [j for j in pending[v] if not self._owed(v, j)]:
                    for buf, local in pending[v].pop(j).values():
                        recycle(buf, local)
                if not pending[v]:
                    del pending[v]
        return done_below

    def _owed(self, version: int, shard: int) -> bool:
        """Service thread: whether this rank may still publish ``shard`` of ``version`` (a version below the one
        its codes are kept from): it owns the shard there and has not published it (a dead owner's shard moved
        here), or it does not own it yet (a rank that applied the ASSIGN first re-sent its code here)."""
        if version < self._served_floor or shard in self._served.get(version, ()):
            return False
        if self.owners.owner(shard, version) == self.rank:
            return True
        return version >= self._keep_from - FOREIGN_SLACK

    def _table(self, version: int, plan: list[tuple[int, int, int]]) -> tuple[int, ...]:
        """What an aggregate's header carries of the table: the age of every partition's entry (``plan`` in
        partition order) under ``choice="oldest"`` (workers pick their next partition from it), else nothing. A
        partition left out of the aggregate gets age ``c``: older than any entry in use, so its holders pick it."""
        if getattr(self.scheme, "choice", None) != "oldest":
            return ()
        return tuple(version - v if k >= 0 else self.scheme.window for _, k, v in plan)

    def _publish_shard(
        self, version: int, shard: int, codes: list[tuple[int, Tensor]], plan: list[tuple[int, int, int]]
    ) -> None:
        """Decode shard ``shard`` of ``version`` from the admitted codes (decode key, code; in key order) and
        the leader's ``plan`` they came from, in the same order; send it."""
        layout, hn = self.layout, self._hn_up
        ce, pe = layout.coded_end(shard), layout.plain_end(shard)
        message = self._agg_pool.get()
        payload = message[self._hn_down :]
        if ce > 0:
            coded = {k: buf[hn : hn + ce] for k, buf in codes}
            if self.up_dtype == self.down_dtype:
                self.scheme.decode(coded, out=payload[:ce])
            else:  # Tandon codes: decode in float64, then round once
                if self._scratch is None:
                    self._scratch = torch.empty(layout.shard_numel, dtype=self.up_dtype)
                payload[:ce].copy_(self.scheme.decode(coded, out=self._scratch[:ce]))
        if pe > ce:  # buffers: the plain mean over the admitted ranks
            tail = payload[ce:pe]
            tail.zero_()
            for _, buf in codes:
                tail.add_(buf[hn + ce : hn + pe].to(self.down_dtype), alpha=1.0 / len(codes))
        payload[pe:].zero_()
        notes = len(self._notes.pop(version, ())) if shard == 0 and self.is_leader else 0
        table = self._table(version, plan) if shard == 0 else ()
        write_header(message, Header(Kind.AGGREGATE, version, self.rank, shard, valid=notes, table=table))
        if self._receives(self.rank, version):
            self.mailbox.put_shard(version, shard, payload, notes or None, table or None)
            self._shard_seen[shard] = max(self._shard_seen[shard], version)
        # The first peer served gets its aggregate first and starts its next step first: rotate the order with
        # the version, or the lowest ranks would be admitted systematically more often (a bias under pgc_cr).
        peers = [p for p in _rotated(self.peers, version) if self._receives(p, version) and p not in self._finished]
        self._send_all(Channel.AGG, message, peers, done=lambda: self._agg_pool.put(message))


@dataclass
class _Recovery:
    """Leader: dead shard owners whose shards are being moved (:meth:`PGCRuntime._recover`)."""

    since: float  # when the last of them was found dead (the reports about it get a heartbeat window)
    lost: list[tuple[int, int]] = field(default_factory=list)  # (dead owner, shard)
    rebuild: Optional[int] = None  # the closed version nobody completed, decided again once enough codes are here
    short_since: Optional[float] = None  # since when that version cannot get enough live codes
    failover: bool = False  # the dead owner was the leader: this rank took over, its first open version is A + 1

    def shards(self) -> list[int]:
        return [j for _, j in self.lost]

    def dead(self) -> list[int]:
        return sorted({owner for owner, _ in self.lost})


def _rotated(items: list[int], by: int) -> list[int]:
    """``items`` rotated left by ``by`` (mod its length): a send order that is fair over versions."""
    if not items:
        return items
    k = by % len(items)
    return items[k:] + items[:k]
