"""The data group of the collective runtime: torch's own process group among the current members, rebuilt per
configuration.

A configuration is a numbered set of member ranks. Its group is a fresh ``ProcessGroupNCCL`` (CUDA tensors, by
default) or ``ProcessGroupGloo`` (CPU tensors; CUDA tensors too when asked: several ranks sharing one GPU, which NCCL
does not allow) over ``PrefixStore("<run>/data/<number>", store)``: the pattern that rebuilds a group without the
ranks that died or froze, with no collective over the old group (a dead member would hang it).

:meth:`DataGroup.all_gather_objects` pickles, as ``torch.distributed.all_gather_object`` does under ``ddp``: it
carries Lightning's collectives, and a broadcast carries whatever object its caller passes (a checkpoint path, a
user's own object), which no fixed schema covers. Its bytes travel over the group's own connections among the
members, never through the store (whose messages are plain data: :mod:`~lightning_pgc.runtime.wire`).
"""

from __future__ import annotations

import pickle
import time
from datetime import timedelta
from typing import Any, Literal, Optional

import torch
import torch.distributed as dist
from torch import Tensor

from lightning_pgc.runtime.transfer import KeyLedger

#: Seconds between two looks at a collective that has not finished on the device yet (the first look; each next one
#: waits twice as long, up to :data:`POLL_MAX_S`).
POLL_MIN_S = 1e-4
POLL_MAX_S = 2e-3


class CollectiveTimeout(RuntimeError):
    """A collective of the data group did not finish on the device within the group's timeout (a member died or
    froze inside it): the caller leaves the group, which is reconfigured without the lost members."""


#: The data group's backends: ``nccl`` (CUDA tensors only) and ``gloo`` (CPU or CUDA tensors).
DataBackend = Literal["nccl", "gloo"]
DATA_BACKENDS: tuple[str, ...] = ("nccl", "gloo")


def data_backend_for(device: torch.device, backend: Optional[str] = None) -> str:
    """The data group's backend for tensors on ``device``: ``backend`` if given, else ``nccl`` on CUDA and ``gloo``
    elsewhere.

    Raises:
        ValueError: an unknown backend, or ``nccl`` for tensors that are not on a CUDA device.
    """
    if backend is None:
        return "nccl" if device.type == "cuda" else "gloo"
    if backend not in DATA_BACKENDS:
        raise ValueError(f"data_backend must be one of {', '.join(DATA_BACKENDS)} or None, got {backend!r}")
    if backend == "nccl" and device.type != "cuda":
        raise ValueError(f"data_backend='nccl' needs CUDA tensors; the data plane's device is {device}")
    return backend


class DataGroup:
    """The process group of one configuration (``members``: global ranks, sorted; this rank is one of them).

    Args:
        store: a store connection of this rank's comm thread, for the group's rendezvous (the group keeps it; no
            other thread uses it); prefix: the run's namespace; number: the configuration's number.
        device: where the tensors live.
        timeout: how long a collective (or building the group) waits for a member before it raises: a collective
            that has not finished on the device by then raises :class:`CollectiveTimeout`. NCCL's own watchdog gets
            twice as long, so this deadline expires first and the group is aborted by its caller, not by the watchdog.
        backend: ``nccl`` or ``gloo``; default :func:`data_backend_for` ``device`` (``cuda``: NCCL, else gloo).
            Gloo takes CUDA tensors too (it stages them through host memory): the way for several ranks to share
            one GPU.
    """

    def __init__(
        self,
        store: dist.Store,
        prefix: str,
        number: int,
        members: list[int],
        rank: int,
        device: torch.device,
        timeout: timedelta,
        backend: Optional[str] = None,
    ) -> None:
        self.number = number
        self.members = list(members)
        self.rank = rank
        self.index = self.members.index(rank)
        self.size = len(self.members)
        self.device = device
        self.backend = data_backend_for(device, backend)
        self.timeout = timeout
        # gloo's wait() blocks the host until the collective finished (or raises); NCCL's only makes the current
        # stream wait for it, so its completion is polled (and its error read) before the result is used
        self.waits_on_host = self.backend == "gloo"
        store.set_timeout(timeout)
        self._ledger: Optional[KeyLedger] = KeyLedger(store)  # (the rendezvous keys, deleted when it closes)
        sub = dist.PrefixStore(f"{prefix}/data/{number}", self._ledger)
        self.pg: Any = None
        try:
            if self.backend == "nccl":
                options = dist.ProcessGroupNCCL.Options()
                options._timeout = 2 * timeout
                self.pg = dist.ProcessGroupNCCL(sub, self.index, self.size, options)
            else:
                self.pg = dist.ProcessGroupGloo(sub, self.index, self.size, timeout)
        except Exception:
            self._forget()
            raise

    def all_reduce(self, tensor: Tensor, what: str = "an all-reduce") -> None:
        """Sum ``tensor`` over the members, in place (every member gets the same bits). Returns once the sum is in
        ``tensor`` on the device, not only queued.

        Raises:
            CollectiveTimeout: it did not finish within the group's timeout (``what`` names it in the message).
            RuntimeError: it failed (a member died).
        """
        if self.size > 1:
            deadline = time.monotonic() + self.timeout.total_seconds()
            self._finish(self.pg.allreduce([tensor]), what, deadline)

    def _finish(self, work: Any, what: str, deadline: float) -> None:
        """Wait until ``work`` finished on the device, by ``deadline`` (monotonic seconds)."""
        work.wait()  # gloo: until it finished, or it raises; NCCL: the current stream waits, the host does not
        pause = POLL_MIN_S
        while not work.is_completed():
            if time.monotonic() >= deadline:
                raise CollectiveTimeout(
                    f"PGC rank {self.rank}: {what} on the data group of ranks {self.members} (configuration "
                    f"{self.number}) did not finish on the device within {self.timeout.total_seconds():g} s; a member "
                    "died or froze inside it"
                )
            time.sleep(pause)
            pause = min(2 * pause, POLL_MAX_S)
        if not self.waits_on_host:  # (NCCL: completed also counts a collective that failed)
            error = work.exception()
            if error is not None:
                raise RuntimeError(
                    f"PGC rank {self.rank}: {what} on the data group of ranks {self.members} failed: {error}"
                ) from error

    def all_gather_objects(self, obj: Any) -> dict[int, Any]:
        """``{global rank: obj}`` of every member (pickled; two all-gathers: the sizes, then the padded bytes)."""
        data = torch.frombuffer(bytearray(pickle.dumps(obj, protocol=pickle.HIGHEST_PROTOCOL)), dtype=torch.uint8)
        if self.size == 1:
            return {self.rank: obj}
        dev = self.device
        size = torch.tensor([data.numel()], dtype=torch.int64, device=dev)
        sizes = [torch.zeros_like(size) for _ in range(self.size)]
        deadline = time.monotonic() + self.timeout.total_seconds()
        self._finish(self.pg.allgather([sizes], [size]), "a collective's all-gather", deadline)
        longest = max(int(s.item()) for s in sizes)
        padded = torch.zeros(longest, dtype=torch.uint8, device=dev)
        padded[: data.numel()] = data.to(dev)
        got = [torch.empty_like(padded) for _ in range(self.size)]
        self._finish(self.pg.allgather([got], [padded]), "a collective's all-gather", deadline)
        return {
            r: pickle.loads(g[: int(s.item())].cpu().numpy().tobytes()) for r, g, s in zip(self.members, got, sizes)
        }

    def close(self) -> None:
        """Release the group's connections (every member does it; a dead member's are gone already) and delete its
        rendezvous keys from the store (a member that has not built the group by now never will: its configuration
        is over)."""
        pg, self.pg = self.pg, None
        if pg is None:
            return
        self._forget()
        if self.backend == "nccl":
            try:
                pg.abort()
            except Exception:  # a group broken by a dead member
                pass
        # gloo: dropping the last reference closes the connections, so a member still inside a collective of this
        # group (it was frozen) fails at once instead of after the timeout (``shutdown`` leaves them open)
        del pg

    def _forget(self) -> None:
        """Delete the rendezvous keys, and drop the group's store connection with them (a traceback that holds this
        group, a logged error's say, then holds no connection)."""
        ledger, self._ledger = self._ledger, None
        if ledger is not None:
            ledger.forget()


def open_group(
    store: dist.Store,
    prefix: str,
    number: int,
    members: list[int],
    rank: int,
    device: torch.device,
    timeout: timedelta,
    backend: Optional[str] = None,
) -> Optional[DataGroup]:
    """The group of configuration ``number`` if this rank is a member, else None."""
    if rank not in members:
        return None
    return DataGroup(store, prefix, number, members, rank, device, timeout, backend)
