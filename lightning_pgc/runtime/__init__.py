"""Runtime of the pgc strategy: two data planes under one small leader.

The collective data plane (``PGCStrategy(data_plane="collective")``): each aggregate is one all-reduce of every
rank's share of the decode on a dedicated gloo or NCCL group, with a comm thread per rank and a control plane
through a store:

- :mod:`~lightning_pgc.runtime.plane`: :class:`~lightning_pgc.runtime.plane.CollectiveRuntime`, every rank's runtime;
- :mod:`~lightning_pgc.runtime.coordinator`: the leader's thread (admission, liveness, reconfiguration);
- :mod:`~lightning_pgc.runtime.weights`: each rank's share of a decode (pure math);
- :mod:`~lightning_pgc.runtime.group`, :mod:`~lightning_pgc.runtime.control`,
  :mod:`~lightning_pgc.runtime.aggregates`: the data group, the store's queues, the aggregates a rank holds.

The sharded data plane (the default):

- :mod:`~lightning_pgc.runtime.shards`: how the flat payload is cut and who owns each shard;
- :mod:`~lightning_pgc.runtime.leader`: the control plane (which codes close each version, who is alive);
- :mod:`~lightning_pgc.runtime.worker`: :class:`PGCRuntime`, every rank's manager (worker API + shard owner);
- :mod:`~lightning_pgc.runtime.transport`: gloo and in-process streams.
"""

from lightning_pgc.runtime.leader import CoordinatorError, DivergedError, Leader, StepRecord
from lightning_pgc.runtime.mailbox import Mailbox, PGCTimeoutError
from lightning_pgc.runtime.shards import OwnerMap, ShardLayout, choose_num_shards
from lightning_pgc.runtime.transport import Channel, GlooTransport, QueueHub, QueueTransport, Transport
from lightning_pgc.runtime.worker import CodeMessage, PGCDetached, PGCRuntime

__all__ = [
    "Channel",
    "CodeMessage",
    "CoordinatorError",
    "DivergedError",
    "GlooTransport",
    "Leader",
    "Mailbox",
    "OwnerMap",
    "PGCDetached",
    "PGCRuntime",
    "PGCTimeoutError",
    "QueueHub",
    "QueueTransport",
    "ShardLayout",
    "StepRecord",
    "Transport",
    "choose_num_shards",
]
