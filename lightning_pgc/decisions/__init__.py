"""The leader's decisions, with no I/O: which codes close each version, who is alive, who is detached for lag and
who donates a rejoining rank's state (:class:`Leader`), and the coverage table of bounded staleness
(:class:`BoundedLeader`). The runtime's coordinator thread feeds them the control plane's messages; the emulator
feeds them simulated arrivals, so an emulated cluster decides exactly as a real one.

- :mod:`~lightning_pgc.decisions.header`: what the leader reads of a code's announcement;
- :mod:`~lightning_pgc.decisions.leader`: :class:`Leader` and its per-version :class:`StepRecord`;
- :mod:`~lightning_pgc.decisions.bounded`: :class:`BoundedLeader` and :class:`BoundedRecord`.
"""

from lightning_pgc.decisions.bounded import BoundedLeader, BoundedRecord
from lightning_pgc.decisions.header import Header
from lightning_pgc.decisions.leader import CoordinatorError, DivergedError, Leader, NoDonorYet, StepRecord

__all__ = [
    "BoundedLeader",
    "BoundedRecord",
    "CoordinatorError",
    "DivergedError",
    "Header",
    "Leader",
    "NoDonorYet",
    "StepRecord",
]
