"""Aggregates arriving shard by shard, assembled per version into preallocated flat buffers."""

from __future__ import annotations

import threading
import time
from typing import Optional

import torch
from torch import Tensor


class PGCTimeoutError(RuntimeError):
    """No aggregate arrived in time: the leader stopped beating (or a bounded wait in a test ran out)."""


class Mailbox:
    """Aggregates published by the shard owners, by version; holds only versions not yet applied.

    A version is complete when all ``num_shards`` shards arrived; a shard that arrives again replaces the first
    copy (a dead owner's shard of a version nobody completed is decoded again by its new owner). Buffers come from
    a pool and go back to it through :meth:`release`, so a rank allocates at most as many as it holds at once
    (bounded by ``max_lag``).
    """

    def __init__(self, num_shards: int, shard_numel: int, dtype: torch.dtype, pin_memory: bool = False) -> None:
        self.num_shards = num_shards
        self.shard_numel = shard_numel
        self.dtype = dtype
        self.pin_memory = pin_memory
        self._items: dict[int, list] = {}  # version -> [buffer, set of the shards received]
        self._notes: dict[int, int] = {}  # version -> how many ranks rejoin at it (each needs the state)
        self._tables: dict[int, tuple[int, ...]] = {}  # version -> table ages it closed with (bounded, "oldest")
        self._free: list[Tensor] = []
        self._cond = threading.Condition()
        self._abort: Optional[BaseException] = None
        self.high_water = 0  # most versions held at once (bounded by the leader's max_lag)
        self.allocated = 0  # buffers ever allocated

    def _buffer(self) -> Tensor:
        if self._free:
            return self._free.pop()
        self.allocated += 1
        return torch.zeros(self.num_shards * self.shard_numel, dtype=self.dtype, pin_memory=self.pin_memory)

    def put_shard(
        self,
        version: int,
        shard: int,
        payload: Tensor,
        note: Optional[int] = None,
        table: Optional[tuple[int, ...]] = None,
    ) -> None:
        """Copy ``payload`` into shard ``shard`` of version ``version``'s buffer (one copy, 1/num_shards of it).

        ``note``: how many ranks rejoin at this version (each needs the training state from its donor); it arrives
        with the aggregate, so a donor knows before it applies this version how many attachments to wait for. ``table``: the ages
        of the table entries the version closed with (bounded staleness, :meth:`pop_table`).
        """
        with self._cond:
            if note is not None:
                self._notes[version] = note
            if table is not None:
                self._tables[version] = table
            entry = self._items.get(version)
            if entry is None:
                entry = self._items[version] = [self._buffer(), set()]
                self.high_water = max(self.high_water, len(self._items))
        start = shard * self.shard_numel
        entry[0][start : start + self.shard_numel].copy_(payload)  # outside the lock: owners write in parallel
        with self._cond:
            entry[1].add(shard)
            if len(entry[1]) == self.num_shards:
                self._cond.notify_all()

    def abort(self, reason: str | BaseException) -> None:
        """Make every current and future ``take`` raise ``reason``."""
        with self._cond:
            self._abort = reason if isinstance(reason, BaseException) else RuntimeError(reason)
            self._cond.notify_all()

    def failure(self) -> Optional[BaseException]:
        """What :meth:`abort` was given, or None."""
        with self._cond:
            return self._abort

    def _complete(self, version: int) -> bool:
        entry = self._items.get(version)
        return entry is not None and len(entry[1]) == self.num_shards

    def has(self, version: int) -> bool:
        """Whether the aggregate of ``version`` is complete."""
        with self._cond:
            return self._complete(version)

    def take(self, version: int, timeout: float) -> Tensor:
        """Remove and return the (padded, flat) aggregate of ``version``, waiting up to ``timeout`` seconds.

        Raises:
            PGCTimeoutError: nothing complete arrived in time.
            RuntimeError: the runtime was aborted (the leader's error).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while not self._complete(version):
                if self._abort is not None:
                    raise self._abort
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PGCTimeoutError(f"no aggregate for version {version} within {timeout:g} s")
                self._cond.wait(min(left, 0.5))
            for stale in [v for v in self._items if v < version]:
                self._free.append(self._items.pop(stale)[0])
            for stale in [v for v in self._notes if v < version]:
                del self._notes[stale]
            for stale in [v for v in self._tables if v < version]:
                del self._tables[stale]
            return self._items.pop(version)[0]

    def pop_note(self, version: int) -> Optional[int]:
        """How many ranks rejoin at ``version``, as its aggregate said, if any (once)."""
        with self._cond:
            return self._notes.pop(version, None)

    def pop_table(self, version: int) -> Optional[tuple[int, ...]]:
        """The table ages that came with ``version``'s aggregate, if any (once)."""
        with self._cond:
            return self._tables.pop(version, None)

    def release(self, buffer: Tensor) -> None:
        """Give a buffer returned by :meth:`take` back once nothing references it any more."""
        with self._cond:
            self._free.append(buffer)

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
