"""State transfer on the collective runtime: a detached rank asks to rejoin, a donor sends it the training state
(with the results of its last collectives) through the store. A mixin of
:class:`~lightning_pgc.runtime.plane.CollectiveRuntime` (it uses that class's state)."""

from __future__ import annotations

import logging
import pickle
import struct
from typing import Callable

import torch
from torch import Tensor

log = logging.getLogger(__name__)


class Rejoins:
    """The worker API of state transfer (mixed into :class:`~lightning_pgc.runtime.plane.CollectiveRuntime`)."""

    def rejoin(self, version: int) -> tuple[int, Tensor]:
        """Ask to rejoin at ``version``; block until a donor sent the training state. Returns ``(u, state)``."""
        self._attached.clear()
        self._rejoining = version
        self._ctl.push(self._leader_box(), ("rejoin", self.rank, version))
        while not self._attached.wait(self.heartbeat_interval):
            self._check_leader(f"rejoining at version {version}")
        assert self._attach_info is not None
        u, donor = self._attach_info
        self._rejoining = None
        while True:
            try:
                blob = self._ctl.pop_blob(f"state/{self.rank}", self.heartbeat_interval)
            except TimeoutError:
                self._check_leader(f"waiting for the training state of version {u}")
                continue
            sent_for, history_bytes = struct.unpack("<qq", blob[:16])
            if sent_for == u:
                break
        start = 16 + history_bytes
        with self._coll_cond:
            self._coll_replay = pickle.loads(blob[16:start])
        state = (
            torch.frombuffer(bytearray(blob[start:]), dtype=torch.uint8)
            if len(blob) > start
            else torch.zeros(0, dtype=torch.uint8)
        )
        log.warning(
            "PGC rank %d: rejoined at version %d with the state of rank %d (%.1f MB), asked at version %d",
            self.rank,
            u,
            donor,
            state.numel() / 1e6,
            version,
        )
        return u, state

    def donation(self, version: int) -> list[int]:
        """The ranks this rank must send its training state to before applying ``version`` (after :meth:`wait`)."""
        with self._attach_cond:
            recipients = self._recipients(version)
            for v in [v for v in self._attachments if v <= version]:
                del self._attachments[v]
            for v in [v for v in self._donated if v <= version]:
                del self._donated[v]
        return recipients

    def _recipients(self, version: int) -> list[int]:
        with self._attach_cond:
            sent = self._donated.get(version, set())
            return [
                r for r, d in self._attachments.get(version, ()) if d == self.rank and r != self.rank and r not in sent
            ]

    def _donate(self, version: int, state_fn: Callable[[], Tensor]) -> None:
        recipients = self._recipients(version)
        if not recipients:
            return
        state = state_fn()
        for rank in recipients:
            self.send_state(rank, version, state)
            with self._attach_cond:
                self._donated.setdefault(version, set()).add(rank)

    def send_state(self, rank: int, version: int, state: Tensor) -> None:
        """Send ``state`` (uint8) to ``rank``, which rejoins at ``version`` (through the store), with the results of
        the last collectives this rank ran (the steps ``rank`` skips call them too)."""
        with self._coll_cond:
            history = pickle.dumps(dict(self._coll_history), protocol=pickle.HIGHEST_PROTOCOL)
        header = struct.pack("<qq", version, len(history))
        self._ctl.put_blob(f"state/{rank}", header + history + state.cpu().numpy().tobytes())
