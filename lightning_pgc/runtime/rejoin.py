"""State transfer on the collective runtime: a detached rank asks to rejoin, a donor sends it the training state
(with the results of its last collectives) over a two-rank group of their own
(:mod:`~lightning_pgc.runtime.transfer`). A mixin of :class:`~lightning_pgc.runtime.plane.CollectiveRuntime`: what it
uses of that class is :class:`RejoinHost`.

The store carries only the request (``rejoin``), the leader's ``attach`` (version, donor, the transfer's name) and
the pair's rendezvous: a few dozen bytes each, whatever the size of the model or of a metric's state.

Both sides run the transfer on their training threads. Neither comm thread takes part, so every member's
all-reduces go on meanwhile (the donor's and the recipient's too), and no Lightning collective waits for it: the
donor sends from :meth:`~lightning_pgc.runtime.plane.CollectiveRuntime.wait` or while it waits for a collective,
the recipient receives before it runs any step of the version it rejoins at.
"""

from __future__ import annotations

import logging
from abc import ABC, abstractmethod
import threading
import time
from datetime import timedelta
from typing import Any, Callable, Optional

import torch
import torch.distributed as dist

from lightning_pgc.runtime.aggregates import PGCTimeoutError
from lightning_pgc.runtime.collectives import Contribution
from lightning_pgc.runtime.control import Channel, live_store
from lightning_pgc.runtime.transfer import Pair, TransferFailed, Unsendable, flatten, receive, send

log = logging.getLogger(__name__)

#: Times a rank asks again after a transfer failed (its donor died or froze) before it gives up.
TRANSFER_ATTEMPTS = 3

#: A callable that builds the state tree (``boundary=True``: from a step boundary); see
#: :meth:`~lightning_pgc.strategy.rejoin.StateTransfer.state_tree`.
StateFn = Callable[..., Any]


def transfer_key(prefix: str, recipient: int, transfer: str) -> str:
    """The namespace of one transfer's rendezvous in the store."""
    return f"{prefix}/state/{recipient}/{transfer}"


class RejoinHost(ABC):
    """What state transfer uses of the runtime it is mixed into (:class:`~lightning_pgc.runtime.plane.CollectiveRuntime`
    sets all of it in its constructor; the comm thread records the leader's ``attach`` messages and the collectives'
    results)."""

    rank: int
    device: torch.device
    prefix: str
    heartbeat_interval: float
    group_timeout: timedelta
    peer_timeout: float
    transfers: list[dict[str, object]]
    _ctl: Channel
    _xfer_store: Optional[dist.Store]
    _rejoining: Optional[int]
    _attached: threading.Event
    _attach_info: Optional[tuple[int, int, str]]
    _attach_cond: threading.Condition
    _attachments: dict[int, list[tuple[int, int, str]]]  # version -> (recipient, donor, transfer)
    _coll_cond: threading.Condition
    _coll_history: dict[int, dict[int, Contribution]]
    _coll_replay: dict[int, dict[int, Contribution]]

    @abstractmethod
    def _leader_box(self) -> str: ...

    @abstractmethod
    def _check_leader(self, doing: str) -> None: ...

    @abstractmethod
    def fail(self, exc: BaseException) -> None: ...


class Rejoins(RejoinHost):
    """The worker API of state transfer (mixed into :class:`~lightning_pgc.runtime.plane.CollectiveRuntime`, which
    sets the state below in its constructor)."""

    _donated: dict[int, set[str]]  # version -> transfers sent

    def rejoin(self, version: int, into: Optional[StateFn] = None) -> tuple[int, Any]:
        """Ask to rejoin at ``version``; block until a donor sent the training state. Returns ``(u, state)``, the
        state at the start of version ``u``. ``into`` gives this rank's own state tree: tensors of the same path,
        shape and dtype are received in place (no copy).

        A transfer that fails (the donor died or froze) is asked for again, up to :data:`TRANSFER_ATTEMPTS` times.

        Raises:
            PGCTimeoutError: the leader named no donor within ``peer_timeout`` (no live rank could send the state).
            RuntimeError: every attempt failed, or the leader failed.
            StateRefused: the donor's state holds something else than plain data (its reason).
            StateMismatch: the donor's state does not fit this rank's (the path named).
        """
        for attempt in range(1, TRANSFER_ATTEMPTS + 1):
            self._attached.clear()
            self._rejoining = version
            self._ctl.push(self._leader_box(), ("rejoin", self.rank, version))
            self._wait_for_donor(version)
            assert self._attach_info is not None
            u, donor, transfer = self._attach_info
            self._rejoining = None
            started = time.monotonic()
            try:
                with Pair(
                    live_store(self._xfer_store), transfer_key(self.prefix, self.rank, transfer), 1, self.group_timeout
                ) as pair:
                    connected = time.monotonic()  # (the donor came: its training thread reached version u)
                    got = receive(pair, u, {"training": into()} if into is not None else None, self.device)
            except TransferFailed as exc:
                log.warning(
                    "PGC rank %d: the state transfer from rank %d failed (%s); asking again (attempt %d of %d)",
                    self.rank,
                    donor,
                    exc,
                    attempt,
                    TRANSFER_ATTEMPTS,
                )
                continue
            with self._coll_cond:
                self._coll_replay = got["collectives"]
            done = time.monotonic()
            self.transfers.append(
                {
                    "side": "recipient",
                    "version": u,
                    "peer": donor,
                    "bytes": got["bytes"],
                    "wait_s": connected - started,
                    "data_s": done - connected,
                }
            )
            log.warning(
                "PGC rank %d: rejoined at version %d with the state of rank %d (%.1f MB in %.2f s), asked at version %d",
                self.rank,
                u,
                donor,
                got["bytes"] / 1e6,
                done - connected,
                version,
            )
            return u, got["training"]
        raise RuntimeError(
            f"PGC rank {self.rank}: {TRANSFER_ATTEMPTS} state transfers failed while rejoining at version {version}"
        )

    def _wait_for_donor(self, version: int) -> None:
        deadline = time.monotonic() + self.peer_timeout
        while not self._attached.wait(self.heartbeat_interval):
            self._check_leader(f"rejoining at version {version}")
            if time.monotonic() > deadline:
                self._rejoining = None
                exc = PGCTimeoutError(
                    f"PGC rank {self.rank}: no donor for its rejoin at version {version} within "
                    f"{self.peer_timeout:g} s: no live rank could send it the training state (every other one is "
                    "detached, rejoining, finished or gone)"
                )
                self.fail(exc)
                raise exc

    def serve_rejoins(self, version: int, state_fn: StateFn) -> None:
        """Send the state (``state_fn()``, the state at the start of ``version``) to every rank that rejoins at
        ``version`` through this rank and did not get it yet; forget the rejoins of earlier versions."""
        self._donate(version, state_fn)
        with self._attach_cond:
            for v in [v for v in self._attachments if v <= version]:
                del self._attachments[v]
            for v in [v for v in self._donated if v <= version]:
                del self._donated[v]

    def _recipients(self, version: int) -> list[tuple[int, str]]:
        with self._attach_cond:
            sent = self._donated.get(version, set())
            return [
                (r, transfer)
                for r, d, transfer in self._attachments.get(version, ())
                if d == self.rank and r != self.rank and transfer not in sent
            ]

    def _donate(self, version: int, state_fn: StateFn) -> None:
        recipients = self._recipients(version)
        if not recipients:
            return
        state = state_fn()
        for rank, transfer in recipients:
            self.send_state(rank, version, state, transfer)
            with self._attach_cond:
                self._donated.setdefault(version, set()).add(transfer)

    def send_state(self, rank: int, version: int, state: Any, transfer: str) -> None:
        """Send ``state`` to ``rank``, which rejoins at ``version`` (transfer ``transfer``), with the results of the
        last collectives this rank ran (the steps ``rank`` skips call them too). A recipient that dies or freezes
        is logged and left to the leader (it asks again, or is dropped): the donor goes on."""
        with self._coll_cond:
            history = dict(self._coll_history)
        started = time.monotonic()
        try:
            store = live_store(self._xfer_store)
            with Pair(store, transfer_key(self.prefix, rank, transfer), 0, self.group_timeout) as pair:
                connected = time.monotonic()
                sent = send(pair, version, {"training": state, "collectives": history, "bytes": _bytes(state)})
        except TransferFailed as exc:
            log.warning("PGC rank %d: the state transfer to rank %d failed (%s); it asks again", self.rank, rank, exc)
            return
        except Unsendable as exc:  # (the recipient was told why: it fails naming it)
            log.error("PGC rank %d: cannot send its state to rank %d: %s", self.rank, rank, exc)
            return
        done = time.monotonic()
        self.transfers.append(
            {
                "side": "donor",
                "version": version,
                "peer": rank,
                "bytes": sent,
                "connect_s": connected - started,
                "data_s": done - connected,
            }
        )
        log.info(
            "PGC rank %d: sent the state of version %d to rank %d (%.1f MB in %.2f s)",
            self.rank,
            version,
            rank,
            sent / 1e6,
            done - connected,
        )


def _bytes(state: Any) -> int:
    """The bytes of the tensors in ``state``."""
    _, tensors = flatten(state)
    return sum(t.numel() * t.element_size() for t in tensors)
