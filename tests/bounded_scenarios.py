"""Scenario helpers for the bounded-staleness coordinator on in-process queues: payloads, runtimes, codes.
Shared by the bounded-staleness tests and the bounded-fault tests."""

from __future__ import annotations

from functools import partial

import torch

from lightning_pgc.runtime import PGCRuntime, QueueHub, ShardLayout
from lightning_pgc.runtime.bounded import BoundedLeader

D = 37  # payload elements (odd: shards are padded)


def payload(rank: int, version: int) -> torch.Tensor:
    return torch.arange(D, dtype=torch.float32) / 5 + 10 * version + rank


def make_runtimes(
    scheme,
    shards=2,
    widen_after=None,
    max_window=None,
    timeout=5.0,
    ranks=None,
    heartbeat=(0.2, 15),
    wrap=None,
    failover=False,
    frozen_failover=False,
    max_lag=1000,
):
    """Runtimes on in-process queues; ``ranks``: those started (the others never come up, as dead processes);
    ``wrap``: rank -> a transport wrapper (a fault injected through the transport)."""
    hub = QueueHub(scheme.n)
    layout = ShardLayout(D, D, shards)
    make_leader = partial(BoundedLeader, widen_after=widen_after, max_window=max_window)
    wrap = wrap or {}
    rts = [
        PGCRuntime(
            scheme,
            wrap.get(r, lambda t: t)(hub.endpoint(r)),
            rank=r,
            world_size=scheme.n,
            layout=layout,
            down_dtype=torch.float32,
            start_version=0,
            timeout=timeout,
            max_lag=max_lag,
            make_leader=make_leader,
            heartbeat_interval=heartbeat[0],
            heartbeat_misses=heartbeat[1],
            failover=failover,
            frozen_failover=frozen_failover,
        )
        for r in (range(scheme.n) if ranks is None else ranks)
    ]
    for rt in rts:
        rt.hub = hub
        rt.start()
    return rts


def submit(rt, version):
    msg = rt.new_code(version)
    msg.write(0, payload(rt.rank, version))
    rt.submit(version, msg, (0,))
