"""The per-rank side of the runtime: a mailbox of published aggregates and the small manager every rank runs.

:class:`PGCRuntime` is what the strategy talks to: ``submit`` a code, ``published`` to learn whether the
aggregate of a version is already out (the rank fell behind and may skip computing), ``wait`` for an
aggregate, ``stop`` at the end of fit. On the coordinator's rank it also owns the :class:`Coordinator`.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Optional

import torch
from torch import Tensor

from lightning_pgc.runtime.coordinator import Coordinator
from lightning_pgc.runtime.messages import Header, Kind, message_numel, pack, payload_text, unpack
from lightning_pgc.runtime.transport import Transport

log = logging.getLogger(__name__)


class PGCTimeoutError(RuntimeError):
    """No aggregate arrived within the liveness timeout."""


class Mailbox:
    """Aggregates published by the coordinator, by version; holds only versions not yet applied."""

    def __init__(self) -> None:
        self._items: dict[int, Tensor] = {}
        self._cond = threading.Condition()
        self._abort: Optional[BaseException] = None
        self.high_water = 0  # most aggregates held at once (bounded by the coordinator's max_lag)

    def put(self, version: int, aggregate: Tensor) -> None:
        with self._cond:
            self._items[version] = aggregate
            self.high_water = max(self.high_water, len(self._items))
            self._cond.notify_all()

    def abort(self, reason: str | BaseException) -> None:
        """Make every current and future ``take`` raise ``reason``."""
        with self._cond:
            self._abort = reason if isinstance(reason, BaseException) else RuntimeError(reason)
            self._cond.notify_all()

    def has(self, version: int) -> bool:
        with self._cond:
            return version in self._items

    def take(self, version: int, timeout: float) -> Tensor:
        """Remove and return the aggregate of ``version``, waiting up to ``timeout`` seconds for it."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while version not in self._items:
                if self._abort is not None:
                    raise self._abort
                left = deadline - time.monotonic()
                if left <= 0:
                    raise PGCTimeoutError(
                        f"no aggregate for version {version} within {timeout:g} s: the coordinator or too many "
                        "ranks are unresponsive (raise the strategy's `timeout` if steps are legitimately slow)"
                    )
                self._cond.wait(min(left, 0.5))
            for stale in [v for v in self._items if v < version]:
                del self._items[stale]
            return self._items.pop(version)

    def __len__(self) -> int:
        with self._cond:
            return len(self._items)


class PGCRuntime:
    """Every rank is a worker; the coordinator rank also runs the :class:`Coordinator` threads."""

    def __init__(
        self,
        scheme: Any,
        transport: Transport,
        rank: int,
        world_size: int,
        payload_numel: int,
        down_dtype: torch.dtype,
        start_version: int,
        timeout: float,
        max_lag: int,
        coordinator_rank: int = 0,
        plain_numel: int = 0,
    ) -> None:
        self.scheme = scheme
        self.transport = transport
        self.rank = rank
        self.world_size = world_size
        self.payload_numel = payload_numel
        self.up_dtype: torch.dtype = scheme.payload_dtype
        self.down_dtype = down_dtype
        self.timeout = timeout
        self.mailbox = Mailbox()
        self.coordinator: Optional[Coordinator] = None
        self._receiver: Optional[threading.Thread] = None
        self._stopped = False
        if rank == coordinator_rank:
            self.coordinator = Coordinator(
                scheme,
                transport,
                world_size=world_size,
                rank=rank,
                payload_numel=payload_numel,
                plain_numel=plain_numel,
                up_dtype=self.up_dtype,
                down_dtype=down_dtype,
                start_version=start_version,
                deliver=self.mailbox.put,
                on_error=self.mailbox.abort,
                timeout=timeout,
                max_lag=max_lag,
            )

    @property
    def is_coordinator(self) -> bool:
        return self.coordinator is not None

    def start(self) -> None:
        if self.coordinator is not None:
            self.coordinator.start()
        else:
            self._receiver = threading.Thread(target=self._receive, name="pgc-worker-recv", daemon=True)
            self._receiver.start()

    def _receive(self) -> None:
        numel = message_numel(self.payload_numel, self.down_dtype)
        while True:
            buf = torch.empty(numel, dtype=self.down_dtype)
            try:
                self.transport.recv_down(buf)
            except Exception as exc:
                self.mailbox.abort(f"lost the connection to the PGC coordinator: {exc!r}")
                return
            header, payload = unpack(buf)
            if header.kind == Kind.AGGREGATE:
                self.mailbox.put(header.version, payload)
            elif header.kind == Kind.ABORT:
                self.mailbox.abort(f"the PGC coordinator failed: {payload_text(payload)}")
                return
            elif header.kind == Kind.BYE:
                return

    # ----------------------------------------------------------------------------------------------- worker
    def published(self, version: int) -> bool:
        """Whether the aggregate of ``version`` is already out (this rank fell behind)."""
        return self.mailbox.has(version)

    def submit(self, version: int, code: Tensor, ages: tuple[int, ...]) -> None:
        """Send this rank's code for ``version`` (built from cache entries of these ages) to the coordinator."""
        if self.coordinator is not None:
            self.coordinator.submit_local(version, code.to(self.up_dtype), tuple(ages))
        else:
            header = Header(Kind.CODE, version, self.rank, len(ages), max(ages, default=0), tuple(ages))
            self.transport.send_up(pack(header, code, self.payload_numel, self.up_dtype))

    def wait(self, version: int) -> Tensor:
        """The aggregate of ``version``; blocks up to the liveness timeout plus a grace period, so that the
        coordinator, whose clock starts at the first code, reports missing ranks before a worker gives up."""
        return self.mailbox.take(version, self.timeout + max(1.0, 0.5 * self.timeout))

    def buffer_stats(self) -> dict[str, int]:
        """High-water marks of the message buffers this rank held (for the memory benchmark)."""
        stats = {"mailbox_high_water": self.mailbox.high_water}
        if self.coordinator is not None:
            stats.update(self.coordinator.buffer_stats())
        return stats

    def stop(self) -> None:
        """Say BYE, let the coordinator drain, join every thread, release the transport."""
        if self._stopped:
            return
        self._stopped = True
        if self.coordinator is not None:
            self.coordinator.stop(self.timeout)
        else:
            try:
                self.transport.send_up(pack(Header(Kind.BYE, -1, self.rank), None, self.payload_numel, self.up_dtype))
            except Exception as exc:
                log.warning("PGC: could not say BYE to the coordinator: %r", exc)
            if self._receiver is not None:
                self._receiver.join(self.timeout)
                if self._receiver.is_alive():
                    log.warning("PGC: rank %d's receiver did not finish", self.rank)
        self.transport.close()
