"""The control plane of the collective runtime: small messages through queues of a c10d ``Store``.

Every rank has one inbox (a queue of the store); the leader of each term has a box of its own. Workers send the leader their
announcements (a code is ready), heartbeats, rejects, rejoin requests and reports; the leader sends every rank its
decisions (the plan of each version), heartbeats, configurations of the data group and the end. So the control
channels are a star around the leader, each message is a few dozen bytes sized by its content (a plan lists at
most ``n`` entries), and no rank keeps a connection or a thread per peer: each thread of a rank holds one store
connection of its own (``Store.clone``). A rank opens all of them when its runtime starts, before the ranks meet:
the connecting side names the server by a reverse DNS lookup, which takes seconds where the resolver drops
queries, so no connection is opened while liveness is being judged.

Every message has a fixed schema and travels as compact JSON (:mod:`~lightning_pgc.runtime.wire`), never pickled:
the store is not authenticated, so whatever a rank reads from it is checked, and a message that fails the check is
dropped and logged, never acted on.

The store must outlive any single rank: the launching process hosts it under ``fork``/``spawn`` (and under
``popen``, where rank 0 is the launching process), the elastic agent under ``torchrun``.
"""

from __future__ import annotations

import itertools
import os
import socket
import uuid
from datetime import timedelta
from typing import Any, Optional

import torch.distributed as dist
from torch.distributed.distributed_c10d import _get_default_store

from lightning_pgc.runtime.wire import INBOX, LEADER_BOX, DropLog, Schema, WireError, decode, encode, rank

#: Environment variable naming the store the launching process hosts (``host:port``), inherited by the ranks.
STORE_ENV = "PGC_STORE_ADDR"


_HOSTED: list[dist.TCPStore] = []  # the server this process hosts (kept alive with the process)


def serve_store() -> dist.TCPStore:
    """A store server on the loopback interface (IPv4; keep it referenced while it serves).

    The listener is IPv4 (the server's own would be dual-stack): the server names every peer it accepts, and a peer
    seen as an IPv4-mapped IPv6 address is not in /etc/hosts, so each accept would wait on a reverse DNS lookup
    (seconds where the resolver drops queries) while the server's single loop serves nobody.
    """
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    listener.bind(("127.0.0.1", 0))
    port = listener.getsockname()[1]
    return dist.TCPStore(
        "127.0.0.1", port, is_master=True, wait_for_workers=False, use_libuv=True, master_listen_fd=listener.detach()
    )


def host_store() -> Optional[dist.TCPStore]:
    """In the launching process: start a store for the control plane (unless one is already named in the
    environment) and name it in the environment, so that ranks started from here find it. Returns the server (keep
    it referenced while the ranks run), or None if the environment already named one."""
    if os.environ.get(STORE_ENV):
        return None
    server = serve_store()
    os.environ[STORE_ENV] = f"127.0.0.1:{server.port}"
    _HOSTED.append(server)
    return server


def open_store(timeout: timedelta) -> dist.Store:
    """The store of the control plane: the one the launching process named (:func:`host_store`), else the default
    group's (torchrun's agent store, or the store of rank 0 under a bare launch)."""
    addr = os.environ.get(STORE_ENV)
    if addr:
        host, port = addr.rsplit(":", 1)
        return dist.TCPStore(host, int(port), is_master=False, timeout=timeout, wait_for_workers=False, use_libuv=True)
    return _get_default_store()


_RUNS = itertools.count()  # runtime starts in this process: every rank starts them in the same order


def run_prefix(rank: int) -> str:
    """A namespace for one runtime start, the same on every rank and new for every start (rank 0 draws it and
    passes it through the default group's store)."""
    store = _get_default_store()
    key = f"pgc/run/{next(_RUNS)}"
    if rank == 0:
        store.set(key, uuid.uuid4().hex)
    return "pgc/" + store.get(key).decode()


def live_store(store: Optional[dist.Store]) -> dist.Store:
    """``store``, a connection of a runtime, or a clear error once that runtime stopped and closed its connections."""
    if store is None:
        raise RuntimeError("PGC: the runtime stopped and closed its connections to the store")
    return store


#: A worker's announcement that its code for a version is ready: ``("code", rank, version, ages, skipped, partition,
#: busy_s)`` (the leader reads it as a :class:`~lightning_pgc.decisions.header.Header`); a rank keeps the last ones to
#: send them again to a new leader.
Announcement = tuple[str, int, int, tuple[int, ...], int, int, float]

#: A worker's goodbye at the end of its training: ``("bye", rank, skipped, leaving)`` (``leaving``: it stops alone, on
#: SIGTERM, and the others go on without it).
Bye = tuple[str, int, int, bool]


#: How long a blocking pop may wait in the store. Pops are woken by messages (every rank's own heartbeat thread ticks
#: its inboxes), never by this timeout: a store wait that times out while a message arrives can leave the
#: connection waiting for an answer that never comes (seen with pops of tens of milliseconds, and after SIGSTOP).
#: So the bound is long (torch's default process-group timeout): it expires only when no message at all came for
#: that long, the ticks included, i.e. the store is frozen or unreachable, and the pop then raises
#: :class:`ControlTimeout` (the connection is not used again).
POP_BOUND = timedelta(minutes=30)


class ControlTimeout(RuntimeError):
    """A pop of the control plane got no message within its bound (:data:`POP_BOUND`)."""


class Channel:
    """One thread's end of the control plane: push to any rank's inbox, pop from one's own.

    Messages are checked against their box's schema (:mod:`~lightning_pgc.runtime.wire`) when they are read; one that
    fails is dropped and logged (:attr:`drops`), and reading goes on with the next.

    Args:
        store: the store (this channel clones it: one connection per thread).
        prefix: the namespace of this run (unique per runtime start).
        world_size: the run's ranks (a rank named in a message must be one of them).
        bound: how long a pop waits for a message before it raises :class:`ControlTimeout`.
    """

    def __init__(self, store: dist.Store, prefix: str, world_size: int, bound: timedelta = POP_BOUND) -> None:
        connection = store.clone()
        connection.set_timeout(bound)
        self.bound = bound
        self._connection: Optional[dist.Store] = connection
        self.prefix = prefix
        self.world_size = world_size
        self.bytes_sent = 0
        self.bytes_received = 0
        self.drops = DropLog(f"control plane of {prefix}")

    @property
    def store(self) -> dist.Store:
        """This channel's connection to the store."""
        return live_store(self._connection)

    def close(self) -> None:
        """Drop this channel's connection (the runtime stopped: nothing pushes or pops on it any more)."""
        self._connection = None

    @property
    def closed(self) -> bool:
        """Whether :meth:`close` was called."""
        return self._connection is None

    def _key(self, box: str) -> str:
        return f"{self.prefix}/{box}"

    def push(self, box: str, message: Any) -> None:
        self.push_all([box], message)

    def push_all(self, boxes: list[str], message: Any) -> None:
        """Send ``message`` to every box of ``boxes`` (all of one kind: inboxes, or leader boxes)."""
        if not boxes:
            return
        schema, framed = _schema(boxes[0])
        data = encode(schema, message, framed)
        for box in boxes:
            self.store.queue_push(self._key(box), data)
        self.bytes_sent += len(data) * len(boxes)

    def pop(self, box: str) -> Any:
        """The next well-formed message of ``box``, waiting for it (the caller makes sure one comes: a tick, say).

        Raises:
            ControlTimeout: none came within the channel's bound.
        """
        while True:
            data = self._pop_within_bound(box)
            message = self._read(box, data)
            if message is not None:
                return message

    def _pop_within_bound(self, box: str) -> bytes:
        try:
            return self.store.queue_pop(self._key(box))
        except dist.DistStoreError as exc:
            if "timeout" not in str(exc).lower():
                raise
            raise ControlTimeout(
                f"PGC: no message in the control box {box!r} for {self.bound.total_seconds():g} s, not even this "
                "rank's own heartbeat ticks: the store is frozen or unreachable, or this rank's heartbeat thread died"
            ) from exc

    def drain(self, box: str) -> list[Any]:
        """Every well-formed message already in ``box`` (none waited for)."""
        out = []
        for data in self._take_all(box):
            message = self._read(box, data)
            if message is not None:
                out.append(message)
        return out

    def _take_all(self, box: str) -> list[bytes]:
        """Pop what ``box`` holds now (raw, unread)."""
        out = []
        for _ in range(self.store.queue_len(self._key(box))):
            try:
                out.append(self.store.queue_pop(self._key(box), False))
            except dist.QueueEmptyError:
                break
        return out

    def prune(self, box: str, keep: frozenset[str]) -> int:
        """Remove from ``box`` (an inbox) every message whose kind is not in ``keep`` (the others go back, in their
        order); returns how many were removed. For the inbox of a rank no thread reads now (it died, or froze)."""
        kept, removed = [], 0
        for data in self._take_all(box):
            message = self._read(box, data)
            if message is not None and message[1][0] in keep:
                kept.append(data)
            else:
                removed += 1
        for data in kept:
            self.store.queue_push(self._key(box), data)
        return removed

    def forget(self, key: str) -> None:
        """Delete ``key`` from the store (a key of this run that nothing reads any more)."""
        self.store.delete_key(self._key(key))

    def _read(self, box: str, data: bytes) -> Optional[tuple[Any, ...]]:
        """The message ``data`` carries, or None (dropped and logged: it does not fit ``box``'s schema)."""
        self.bytes_received += len(data)
        schema, framed = _schema(box)
        try:
            return decode(schema, data, self.world_size, framed)
        except WireError as exc:
            self.drops.drop(box, exc)
            return None

    def claim(self, key: str, rank: int) -> Optional[int]:
        """Set ``key`` to ``rank`` unless it is set already (atomically, in the store); returns the rank it holds, or
        None if it holds something else than a rank (dropped and logged)."""
        return self._rank_of(key, self.store.compare_set(self._key(key), "", str(rank)))

    def read(self, key: str) -> Optional[int]:
        """The rank ``key`` holds, or None if it is not set (not waited for) or holds something else."""
        if not self.store.check([self._key(key)]):
            return None
        return self._rank_of(key, self.store.get(self._key(key)))

    def _rank_of(self, key: str, data: bytes) -> Optional[int]:
        try:
            return rank(int(data.decode("ascii")), self.world_size)
        except ValueError as exc:  # (WireError and UnicodeDecodeError are ValueErrors)
            self.drops.drop(key, WireError(f"it holds {data!r:.40}, not a rank ({exc})", "lead"))
            return None


def inbox(rank: int) -> str:
    """A rank's inbox: decisions, heartbeats and configurations from the leader, each as ``(term, message)``
    (``term`` -1: from the rank itself)."""
    return f"to/{rank}"


def leader_box(term: int) -> str:
    """The inbox of the leader of ``term`` (announcements, heartbeats, rejects, rejoins, reports, collective
    requests). A new term has a new box, so a deposed leader that resumes reads none of its successor's mail."""
    return f"leader/{term}"


def _schema(box: str) -> tuple[Schema, bool]:
    """The schema of ``box``'s messages, and whether they are framed with the sender's term (inboxes)."""
    return (INBOX, True) if box.startswith("to/") else (LEADER_BOX, False)


def term_key(term: int) -> str:
    """The store key naming the leader of ``term`` (term 0: rank 0, unnamed); the first rank to set it leads."""
    return f"lead/{term}"
