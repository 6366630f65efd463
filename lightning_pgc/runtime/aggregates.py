"""The buffers a rank holds: its codes, and the decoded aggregates waiting for its training thread, by version, in
buffers that are reused."""

from __future__ import annotations

import threading
import time
from typing import Callable, Optional

import torch
from torch import Tensor


#: A CUDA event: recorded on one stream, waited on by another (the runtime's events are ``None`` off CUDA).
Event = torch.cuda.Event


class PGCTimeoutError(RuntimeError):
    """No aggregate arrived in time: the leader stopped beating (or a bounded wait in a test ran out)."""


def payload_dtype_for(params_dtype: torch.dtype) -> torch.dtype:
    """The aggregate's dtype: float64 for double-precision models, float32 otherwise."""
    return torch.float64 if params_dtype == torch.float64 else torch.float32


class Code:
    """One rank's code for one version: a flat buffer on the model's device (encode into :attr:`rows`)."""

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.flat = torch.zeros(numel, dtype=dtype, device=device)
        self.rows = self.flat.view(1, -1)  # (the codes' encode writes one row)
        self.version = -1
        self.event: Optional[Event] = None  # CUDA: recorded when it was submitted (the comm stream waits on it)
        self.read: Optional[Event] = None  # CUDA: recorded after the comm stream last read it

    def write(self, start: int, flat: Tensor) -> None:
        """Copy ``flat`` into the code at offset ``start`` (e.g. the averaged buffers)."""
        self.flat[start : start + flat.numel()].copy_(flat)


class Aggregates:
    """What the comm thread produced and the training thread has not applied yet (at most ``max_lag`` versions:
    the leader detaches a rank before it would hold more).

    Buffers come from a pool (:meth:`buffer`, :meth:`release`), so a rank allocates at most as many as it holds at
    once. On CUDA each entry carries the event recorded after its all-reduce (the training stream waits on it), and
    each released buffer the event recorded after its last use (the comm stream waits on it before reuse).
    """

    def __init__(self, numel: int, dtype: torch.dtype, device: torch.device) -> None:
        self.numel, self.dtype, self.device = numel, dtype, device
        self._items: dict[int, tuple[Tensor, Optional[Event], tuple[int, ...]]] = {}
        self._free: list[tuple[Tensor, Optional[Event]]] = []
        self._cond = threading.Condition()
        self._abort: Optional[BaseException] = None
        self.high_water = 0
        self.allocated = 0

    def buffer(self, wait_event: Callable[[Event], None] = lambda e: None) -> Tensor:
        """A free buffer (a new one if none is free); ``wait_event`` is applied to the event of its last use."""
        with self._cond:
            if self._free:
                buf, event = self._free.pop()
                if event is not None:
                    wait_event(event)
                return buf
            self.allocated += 1
        return torch.empty(self.numel, dtype=self.dtype, device=self.device)

    def put(self, version: int, buf: Tensor, event: Optional[Event] = None, table: tuple[int, ...] = ()) -> None:
        with self._cond:
            old = self._items.pop(version, None)
            if old is not None:
                self._free.append((old[0], None))
            self._items[version] = (buf, event, table)
            self.high_water = max(self.high_water, len(self._items))
            self._cond.notify_all()

    def discard_from(self, version: int) -> None:
        """Forget every aggregate of ``version`` and later (a configuration decides them again)."""
        with self._cond:
            for v in [v for v in self._items if v >= version]:
                self._free.append((self._items.pop(v)[0], None))

    def abort(self, reason: str | BaseException) -> None:
        with self._cond:
            self._abort = reason if isinstance(reason, BaseException) else RuntimeError(reason)
            self._cond.notify_all()

    def failure(self) -> Optional[BaseException]:
        with self._cond:
            return self._abort

    def has(self, version: int) -> bool:
        with self._cond:
            return version in self._items

    def take(self, version: int, timeout: float) -> tuple[Tensor, Optional[Event], tuple[int, ...]]:
        """Remove and return ``(buffer, event, table)`` of ``version``, waiting up to ``timeout`` seconds; older
        entries go back to the pool.

        Raises:
            PGCTimeoutError: nothing arrived in time.
            RuntimeError: the runtime was aborted (the leader's error).
        """
        deadline = time.monotonic() + timeout
        with self._cond:
            while version not in self._items:
                if self._abort is not None:
                    raise self._abort
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PGCTimeoutError(f"no aggregate for version {version} within {timeout:g} s")
                self._cond.wait(min(left, 0.5))
            for stale in [v for v in self._items if v < version]:
                self._free.append((self._items.pop(stale)[0], None))
            return self._items.pop(version)

    def release(self, buf: Tensor, event: Optional[Event] = None) -> None:
        with self._cond:
            self._free.append((buf, event))

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)
