"""Runtime of the pgc strategy: a small per-rank manager, the coordinator service and pluggable transports."""

from lightning_pgc.runtime.coordinator import Coordinator, CoordinatorError, StepRecord
from lightning_pgc.runtime.transport import GlooTransport, QueueHub, QueueTransport, Transport
from lightning_pgc.runtime.worker import Mailbox, PGCRuntime, PGCTimeoutError

__all__ = [
    "Coordinator",
    "CoordinatorError",
    "GlooTransport",
    "Mailbox",
    "PGCRuntime",
    "PGCTimeoutError",
    "QueueHub",
    "QueueTransport",
    "StepRecord",
    "Transport",
]
