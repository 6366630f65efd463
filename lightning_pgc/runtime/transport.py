"""Transports: how messages move between ranks.

The runtime needs only two point-to-point calls on six independent channels (codes, aggregate shards,
control, heartbeats, state transfer, collectives), so a transport is a small protocol with two implementations:
gloo on six dedicated process groups
(real runs) and in-process queues (unit tests of the protocol without processes). Receives are blocking and
made from one dedicated thread per (channel, peer); sends are asynchronous and return a handle whose ``wait``
returns once the message left (the buffer must stay alive and unchanged until then).
"""

from __future__ import annotations

import queue
from datetime import timedelta
from enum import IntEnum
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class Channel(IntEnum):
    """Independent ordered streams between every pair of ranks."""

    CODE = 0  # worker -> shard owner (and the leader sees shard 0 of every code)
    AGG = 1  # shard owner -> every rank
    CTRL = 2  # leader -> every rank
    BEAT = 3  # every rank -> leader: heartbeats and small requests
    STATE = 4  # donor -> a rank that rejoins: the training state (state transfer)
    COLL = 5  # every rank <-> leader: Lightning's collectives among the live ranks (runtime/collectives.py)


class Handle(Protocol):
    def wait(self) -> None:
        """Block until the message left this rank (its buffer may then be reused)."""


class Transport(Protocol):
    """Ordered point-to-point streams per (channel, sender, receiver)."""

    rank: int
    world_size: int

    def isend(self, channel: Channel, peer: int, message: Tensor) -> Handle:
        """Start sending ``message`` to ``peer``; keep it unchanged until the handle's ``wait`` returned."""

    def recv(self, channel: Channel, peer: int, buf: Tensor) -> None:
        """Fill ``buf`` with the next message of ``peer`` on ``channel`` (blocks; raises if the peer is gone)."""

    def close(self) -> None:
        """Release the transport's resources once every stream said BYE."""


class GlooTransport:
    """Point-to-point gloo streams on dedicated groups (one per channel), never on Lightning's default group.

    One group per channel, so each gloo pair of a group carries at most one receiving thread per direction.
    Gloo cannot poll a receive and a timed-out wait closes every pair of the group, so receives block without a
    deadline (the group timeout is very long) and liveness is enforced by the runtime's heartbeats instead.

    Raises:
        RuntimeError: ``torch.distributed`` is not initialized.
    """

    def __init__(self, group_timeout: timedelta = timedelta(days=7)) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GlooTransport needs an initialized torch.distributed default group")
        self.rank = dist.get_rank()
        self.world_size = dist.get_world_size()
        # Collective calls: every rank creates the groups in the same order.
        self.groups = {ch: dist.new_group(backend="gloo", timeout=group_timeout) for ch in Channel}

    def isend(self, channel: Channel, peer: int, message: Tensor) -> Handle:
        return dist.isend(message, dst=peer, group=self.groups[channel])

    def recv(self, channel: Channel, peer: int, buf: Tensor) -> None:
        dist.recv(buf, src=peer, group=self.groups[channel])

    def close(self) -> None:
        """Destroy the groups and drop them: their connections close once nothing holds them."""
        groups, self.groups = self.groups, {}
        for group in groups.values():
            try:
                dist.destroy_process_group(group)
            except Exception:  # already destroyed with the default group
                pass


class _Done:
    def wait(self) -> None:
        return None


class QueueHub:
    """In-process stand-in for a cluster: one queue per (channel, sender, receiver). For protocol tests."""

    def __init__(self, world_size: int) -> None:
        self.world_size = world_size
        self.queues = {
            (ch, s, d): queue.Queue() for ch in Channel for s in range(world_size) for d in range(world_size) if s != d
        }

    def endpoint(self, rank: int) -> QueueTransport:
        return QueueTransport(self, rank)


class QueueTransport:
    """The :class:`Transport` of one rank of a :class:`QueueHub` (messages are copied, as on a wire)."""

    def __init__(self, hub: QueueHub, rank: int) -> None:
        self.hub = hub
        self.rank = rank
        self.world_size = hub.world_size

    def isend(self, channel: Channel, peer: int, message: Tensor) -> Handle:
        self.hub.queues[(channel, self.rank, peer)].put(message.clone())
        return _Done()

    def recv(self, channel: Channel, peer: int, buf: Tensor) -> None:
        got = self.hub.queues[(channel, peer, self.rank)].get()
        if isinstance(got, BaseException):
            raise got
        if got.numel() != buf.numel() or got.dtype != buf.dtype:
            raise RuntimeError(f"message of {got.numel()} {got.dtype} into a buffer of {buf.numel()} {buf.dtype}")
        buf.copy_(got)

    def close(self) -> None:
        pass


def payload_dtype_for(params_dtype: torch.dtype) -> torch.dtype:
    """The aggregate's dtype: float64 for double-precision models, float32 otherwise."""
    return torch.float64 if params_dtype == torch.float64 else torch.float32
