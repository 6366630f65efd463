"""The coordinator: a background service on one rank that closes each model version as soon as it can.

It gathers the workers' codes for the open version, decodes once ``scheme.wait_for`` of them arrived (the
fastest ones), and publishes the aggregate to every worker. Codes for a version that is already closed are
counted as late and dropped. It never waits for a straggler unless a live rank would fall more than
``max_lag`` versions behind (that bounds the aggregates a slow rank must buffer), and it fails with an error
naming the missing ranks when it cannot close a version within ``timeout`` seconds.
"""

from __future__ import annotations

import logging
import queue
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from typing import Any, Callable, Optional

import torch
from torch import Tensor

from lightning_pgc.runtime.messages import Header, Kind, message_numel, pack, text_payload, unpack
from lightning_pgc.runtime.transport import Transport

log = logging.getLogger(__name__)

_DEAD = "dead"  # inbox marker: a receiver thread lost its peer


class CoordinatorError(RuntimeError):
    """The coordinator could not close a version: too many ranks missing, or a protocol violation."""


@dataclass
class StepRecord:
    """What the coordinator saw for one version (read by the diagnostics callback)."""

    version: int
    admitted: list[int]
    weights: dict[int, float]
    arrivals: dict[int, float]  # seconds from the version's opening to each code's arrival
    valid: dict[int, int]  # cache entries each admitted code was built from
    ages: dict[int, tuple[int, ...]]  # ages of those entries, per admitted rank
    opened_at: float
    closed_at: float
    late: dict[int, float] = field(default_factory=dict)  # codes that arrived after the close

    @property
    def wait_s(self) -> float:
        """Seconds the version stayed open."""
        return self.closed_at - self.opened_at


class Coordinator:
    """Rank-local service: one receiver and one sender thread per peer, and the decoding loop."""

    def __init__(
        self,
        scheme: Any,
        transport: Transport,
        world_size: int,
        rank: int,
        payload_numel: int,
        plain_numel: int,
        up_dtype: torch.dtype,
        down_dtype: torch.dtype,
        start_version: int,
        deliver: Callable[[int, Tensor], None],
        on_error: Callable[[BaseException], None],
        timeout: float,
        max_lag: int,
        keep_records: int = 4096,
    ) -> None:
        self.scheme = scheme
        self.transport = transport
        self.world_size = world_size
        self.rank = rank
        self.payload_numel = payload_numel
        self.plain_numel = plain_numel  # trailing elements averaged over the received ranks, not decoded
        self.up_dtype = up_dtype
        self.down_dtype = down_dtype
        self.version = start_version
        self.deliver = deliver
        self.on_error = on_error
        self.timeout = timeout
        self.max_lag = max_lag
        self.peers = [r for r in range(world_size) if r != rank]
        self.records: deque[StepRecord] = deque(maxlen=keep_records)
        self._records_lock = threading.Lock()
        self.error: Optional[BaseException] = None
        self.late_codes = 0
        self.dead: set[int] = set()
        self._inbox: queue.Queue = queue.Queue()
        self._outboxes: dict[int, queue.Queue] = {p: queue.Queue() for p in self.peers}
        self._stopping = threading.Event()
        self._byes: set[int] = set()
        self._outbox_high_water = 0
        self._inbox_high_water = 0
        self._threads: list[threading.Thread] = []
        self._loop: Optional[threading.Thread] = None

    # ----------------------------------------------------------------------------------------------- lifecycle
    def start(self) -> None:
        for peer in self.peers:
            self._spawn(self._receive, peer, name=f"pgc-recv-{peer}")
            self._spawn(self._send, peer, name=f"pgc-send-{peer}")
        self._loop = threading.Thread(target=self._run, name="pgc-coordinator", daemon=True)
        self._loop.start()

    def _spawn(self, fn: Callable[[int], None], peer: int, name: str) -> None:
        t = threading.Thread(target=fn, args=(peer,), name=name, daemon=True)
        t.start()
        self._threads.append(t)

    def submit_local(self, version: int, code: Tensor, ages: tuple[int, ...]) -> None:
        """The co-located worker's code (no wire)."""
        header = Header(Kind.CODE, version, self.rank, len(ages), max(ages, default=0), tuple(ages))
        self._inbox.put((header, code, time.monotonic()))

    def record(self, version: int) -> Optional[StepRecord]:
        """The record of a closed version, if still kept."""
        with self._records_lock:
            for rec in reversed(self.records):
                if rec.version == version:
                    return rec
                if rec.version < version:
                    return None
        return None

    def buffer_stats(self) -> dict[str, int]:
        """High-water marks: queued aggregates per peer and codes waiting to be read."""
        return {"outbox_high_water": self._outbox_high_water, "inbox_high_water": self._inbox_high_water}

    def stop(self, timeout: float) -> None:
        """Serve until every live peer said BYE (or ``timeout``), then say BYE to all and join the threads."""
        self._stopping.set()
        if self._loop is not None:
            self._loop.join(timeout)
        for t in self._threads:
            t.join(min(timeout, 10.0))
        alive = [t.name for t in self._threads if t.is_alive()]
        if self._loop is not None and self._loop.is_alive():
            alive.append(self._loop.name)
        if alive:
            log.warning("PGC coordinator threads still running after stop: %s", alive)

    # ------------------------------------------------------------------------------------------------ threads
    def _receive(self, peer: int) -> None:
        numel = message_numel(self.payload_numel, self.up_dtype)
        while True:
            buf = torch.empty(numel, dtype=self.up_dtype)
            try:
                self.transport.recv_from(peer, buf)
            except Exception as exc:  # the peer's process is gone
                self._inbox.put((_DEAD, peer, repr(exc)))
                return
            header, payload = unpack(buf)
            self._inbox.put((header, payload, time.monotonic()))
            if header.kind == Kind.BYE:
                return

    def _send(self, peer: int) -> None:
        box = self._outboxes[peer]
        while True:
            message = box.get()
            try:
                self.transport.send_to(peer, message)
            except Exception as exc:
                self._inbox.put((_DEAD, peer, repr(exc)))
                return
            header, _ = unpack(message)
            if header.kind in (Kind.BYE, Kind.ABORT):
                return

    def _broadcast(self, header: Header, payload: Optional[Tensor]) -> None:
        message = pack(header, payload, self.payload_numel, self.down_dtype)
        for peer in self.peers:
            if peer not in self.dead:
                self._outboxes[peer].put(message)
                self._outbox_high_water = max(self._outbox_high_water, self._outboxes[peer].qsize())

    # --------------------------------------------------------------------------------------------- main loop
    def _run(self) -> None:
        try:
            self._serve()
        except BaseException as exc:  # surfaced to the local worker, and to the peers as ABORT
            self.error = exc
            log.error("PGC coordinator failed: %s", exc)
            self.on_error(exc)
            text = text_payload(f"{type(exc).__name__}: {exc}", self.payload_numel, self.down_dtype)
            self._broadcast(Header(Kind.ABORT, self.version, self.rank), text)

    def _serve(self) -> None:
        scheme = self.scheme
        pending: dict[int, Tensor] = {}
        arrivals: dict[int, float] = {}
        valid: dict[int, int] = {}
        ages: dict[int, tuple[int, ...]] = {}
        opened_at = time.monotonic()
        first_arrival: Optional[float] = None
        last_seen = {r: self.version - 1 for r in range(self.world_size)}
        last_heard = {r: opened_at for r in range(self.world_size)}
        byes = self._byes
        stop_deadline: Optional[float] = None

        while True:
            self._inbox_high_water = max(self._inbox_high_water, self._inbox.qsize())
            try:
                item = self._inbox.get(timeout=0.05)
            except queue.Empty:
                item = None
            now = time.monotonic()

            if item is not None and item[0] == _DEAD:
                _, peer, why = item
                if peer not in byes:
                    log.warning("PGC: lost rank %d (%s)", peer, why)
                    self.dead.add(peer)
            elif item is not None:
                header, payload, arrived = item
                sender = header.sender
                last_heard[sender] = arrived
                if header.kind == Kind.BYE:
                    byes.add(sender)
                elif header.kind == Kind.CODE:
                    last_seen[sender] = max(last_seen[sender], header.version)
                    if header.version == self.version:
                        pending[sender] = payload
                        arrivals[sender] = arrived - opened_at
                        valid[sender] = header.valid
                        ages[sender] = header.ages
                        if first_arrival is None:
                            first_arrival = arrived
                    elif header.version < self.version:
                        self.late_codes += 1
                        rec = self.record(header.version)
                        if rec is not None:
                            rec.late[sender] = arrived - rec.opened_at
                    else:
                        raise CoordinatorError(
                            f"rank {sender} sent a code for version {header.version} while version "
                            f"{self.version} is open; ranks are out of step (was the step counter changed?)"
                        )

            # Close the open version as soon as the codes in decode it (for FR: one rank per group, possibly
            # fewer than n-s) and no live rank lags too far behind.
            if pending and scheme.admits(list(pending)) and self._lag_ok(last_seen, last_heard, now):
                order = list(pending)
                weights = scheme.decoding_weights(order)
                aggregate = self._decode(pending, order, weights)
                closed_at = time.monotonic()
                with self._records_lock:
                    self.records.append(
                        StepRecord(
                            version=self.version,
                            admitted=order,
                            weights=weights,
                            arrivals=dict(arrivals),
                            valid=dict(valid),
                            ages=dict(ages),
                            opened_at=opened_at,
                            closed_at=closed_at,
                        )
                    )
                # Broadcast (which copies) before delivering locally: the local optimizer may edit it in place.
                self._broadcast(Header(Kind.AGGREGATE, self.version, self.rank), aggregate)
                self.deliver(self.version, aggregate)
                self.version += 1
                pending, arrivals, valid, ages = {}, {}, {}, {}
                opened_at, first_arrival = closed_at, None
                continue

            live_peers = set(self.peers) - self.dead
            if self._stopping.is_set():
                if stop_deadline is None:
                    stop_deadline = now + self.timeout
                if live_peers <= byes or now > stop_deadline:
                    missing = sorted(live_peers - byes)
                    if missing:
                        log.warning("PGC: ranks %s did not finish within %.0f s of rank %d", missing,
                                    self.timeout, self.rank)
                    self._broadcast(Header(Kind.BYE, self.version, self.rank), None)
                    return
                continue

            if first_arrival is not None and now - first_arrival > self.timeout:
                have = sorted(pending)
                if not scheme.admits(list(pending)):
                    missing = sorted(set(range(self.world_size)) - set(pending))
                    raise CoordinatorError(
                        f"Missing ranks: {missing}. Version {self.version}: only ranks {have} sent their code "
                        f"within {self.timeout:g} s; scheme '{scheme.name}' needs {scheme.wait_for} of "
                        f"{self.world_size} (tolerates {self.world_size - scheme.wait_for} missing)."
                    )

    def _decode(self, pending: dict[int, Tensor], order: list[int], weights: dict[int, float]) -> Tensor:
        """Decode the coded region in float64; average the plain tail (e.g. BatchNorm buffers) over ``order``."""
        coded = self.payload_numel - self.plain_numel
        aggregate = torch.zeros(self.payload_numel, dtype=torch.float64)
        for r, w in weights.items():
            if w != 0.0:
                aggregate[:coded].add_(pending[r][:coded].to(torch.float64), alpha=w)
        if self.plain_numel:
            for r in order:
                aggregate[coded:].add_(pending[r][coded:].to(torch.float64), alpha=1.0 / len(order))
        return aggregate.to(self.down_dtype)

    def _lag_ok(self, last_seen: dict[int, int], last_heard: dict[int, float], now: float) -> bool:
        """True unless a live, responsive rank would fall more than ``max_lag`` versions behind."""
        for r, seen in last_seen.items():
            if r in self.dead or r in self._byes or now - last_heard[r] > self.timeout:
                continue
            if self.version - seen > self.max_lag:
                return False
        return True
