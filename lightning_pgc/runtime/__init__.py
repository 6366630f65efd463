"""Runtime of the pgc strategy: the coded aggregate as one all-reduce per version, under a small leader.

Each aggregate is one all-reduce of every rank's share of the decode on a dedicated gloo or NCCL group, with a comm
thread per rank and a control plane through a store. What the leader decides (which codes close each version, who
is alive) is :mod:`lightning_pgc.decisions`, with no I/O; each rank's share of a decode is
:mod:`lightning_pgc.codes.shares`, pure math.

- :mod:`~lightning_pgc.runtime.plane`: :class:`~lightning_pgc.runtime.plane.CollectiveRuntime`, every rank's runtime;
- :mod:`~lightning_pgc.runtime.comm`: its comm thread (the all-reduces and Lightning's collectives, in order);
- :mod:`~lightning_pgc.runtime.coordinator`: the leader's thread (admission, liveness, reconfiguration);
- :mod:`~lightning_pgc.runtime.succession`: leader failover;
- :mod:`~lightning_pgc.runtime.group`, :mod:`~lightning_pgc.runtime.control`,
  :mod:`~lightning_pgc.runtime.aggregates`, :mod:`~lightning_pgc.runtime.collectives`: the data group, the store's
  queues, the aggregates a rank holds, Lightning's collectives among the live ranks.
"""

from lightning_pgc.runtime.aggregates import PGCTimeoutError
from lightning_pgc.runtime.plane import CollectiveRuntime, PGCDetached

__all__ = ["CollectiveRuntime", "PGCDetached", "PGCTimeoutError"]
