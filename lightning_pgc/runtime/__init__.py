"""Runtime of the pgc strategy: a sharded data plane with a small leader, on pluggable transports.

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
