"""Transports: how messages move between the workers and the coordinator.

The coordinator only needs four blocking point-to-point calls, so the transport is a small protocol with two
implementations: gloo on two dedicated process groups (real runs) and in-process queues (unit tests of the
protocol without processes). Each call is made from one dedicated thread per peer and direction.
"""

from __future__ import annotations

import queue
from datetime import timedelta
from typing import Protocol

import torch
import torch.distributed as dist
from torch import Tensor


class Transport(Protocol):
    """Blocking point-to-point streams between every worker and the coordinator."""

    def recv_from(self, peer: int, buf: Tensor) -> None:
        """Coordinator side: fill ``buf`` with the next message of worker ``peer``."""

    def send_to(self, peer: int, message: Tensor) -> None:
        """Coordinator side: send ``message`` to worker ``peer``."""

    def send_up(self, message: Tensor) -> None:
        """Worker side: send ``message`` to the coordinator."""

    def recv_down(self, buf: Tensor) -> None:
        """Worker side: fill ``buf`` with the next message of the coordinator."""

    def close(self) -> None:
        """Release the transport's resources once every stream has said BYE."""


class GlooTransport:
    """Point-to-point gloo streams on two dedicated groups, never on Lightning's default group.

    ``up`` carries codes (workers -> coordinator) and ``down`` carries aggregates, so each gloo pair is used by
    at most one thread per direction. Gloo cannot poll a receive, and a timed-out wait closes every pair of the
    group, so receives block without a deadline (the group timeout is set very long) and liveness is enforced by
    the coordinator's own clock instead.
    """

    def __init__(self, coordinator: int = 0, group_timeout: timedelta = timedelta(days=7)) -> None:
        if not dist.is_initialized():
            raise RuntimeError("GlooTransport needs an initialized torch.distributed default group")
        self.coordinator = coordinator
        # Collective calls: every rank creates both groups in the same order.
        self.up = dist.new_group(backend="gloo", timeout=group_timeout)
        self.down = dist.new_group(backend="gloo", timeout=group_timeout)

    def recv_from(self, peer: int, buf: Tensor) -> None:
        dist.recv(buf, src=peer, group=self.up)

    def send_to(self, peer: int, message: Tensor) -> None:
        dist.send(message, dst=peer, group=self.down)

    def send_up(self, message: Tensor) -> None:
        dist.send(message, dst=self.coordinator, group=self.up)

    def recv_down(self, buf: Tensor) -> None:
        dist.recv(buf, src=self.coordinator, group=self.down)

    def close(self) -> None:
        for group in (self.up, self.down):
            try:
                dist.destroy_process_group(group)
            except Exception:  # already destroyed with the default group
                pass


class QueueHub:
    """In-process stand-in for a cluster: one queue per (direction, worker). For protocol tests."""

    def __init__(self, world_size: int) -> None:
        self.up = {r: queue.Queue() for r in range(world_size)}
        self.down = {r: queue.Queue() for r in range(world_size)}

    def endpoint(self, rank: int) -> QueueTransport:
        return QueueTransport(self, rank)


class QueueTransport:
    """The :class:`Transport` of one rank of a :class:`QueueHub` (messages are copied, as on a wire)."""

    def __init__(self, hub: QueueHub, rank: int) -> None:
        self.hub = hub
        self.rank = rank

    def recv_from(self, peer: int, buf: Tensor) -> None:
        buf.copy_(self.hub.up[peer].get())

    def send_to(self, peer: int, message: Tensor) -> None:
        self.hub.down[peer].put(message.clone())

    def send_up(self, message: Tensor) -> None:
        self.hub.up[self.rank].put(message.clone())

    def recv_down(self, buf: Tensor) -> None:
        buf.copy_(self.hub.down[self.rank].get())

    def close(self) -> None:
        pass


def payload_dtype_for(params_dtype: torch.dtype) -> torch.dtype:
    """The downlink dtype: float64 for double-precision models, float32 otherwise."""
    return torch.float64 if params_dtype == torch.float64 else torch.float32
