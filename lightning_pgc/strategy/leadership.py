"""Leadership: which rank does Lightning's rank-zero work when the PGC leader (rank 0) dies and another takes over.

The runtime's leader failover (:mod:`~lightning_pgc.runtime.succession`, ``failover=True``) moves the control plane
to a live member of the data group (the lowest, normally). Lightning ties more to rank 0: it writes checkpoints
(``is_global_zero``), its loggers are the only ones that write (``rank_zero_only``), Lightning broadcasts from it
(``src=0``), and the fork/spawn launcher takes the fit's results from it. :class:`Leadership` moves all of that
to the successor, so that the job goes on writing the same checkpoints and the same runs.
"""

from __future__ import annotations

import logging
from typing import Any, Optional, Protocol

import lightning.pytorch as pl
from lightning_pgc._lightning import (
    continue_loggers,
    guard_loggers,
    launches_in_rank_zero,
    logger_ids,
    make_rank_zero,
    pin_loggers,
    unguard_loggers,
)
from lightning_pgc.codes import Scheme
from lightning_pgc.runtime.plane import CollectiveRuntime
from lightning_pgc.strategy.options import LivenessOptions

log = logging.getLogger(__name__)


class LeadershipHost(Protocol):
    """What :class:`Leadership` uses of its strategy (:class:`~lightning_pgc.PGCStrategy`)."""

    @property
    def global_rank(self) -> int: ...

    @property
    def world_size(self) -> int: ...

    @property
    def liveness(self) -> LivenessOptions: ...

    @property
    def scheme(self) -> Optional[Scheme]: ...

    @property
    def runtime(self) -> Optional[CollectiveRuntime]: ...

    @property
    def lightning_module(self) -> Optional[pl.LightningModule]: ...

    def broadcast(self, obj: Any, src: int = 0) -> Any: ...


class Leadership:
    """The rank-zero seat of one :class:`~lightning_pgc.PGCStrategy`.

    Call order: :meth:`enabled` when the runtime is built; :meth:`pin_loggers` on every rank once the runtime runs
    (every rank alive); :meth:`follow` on the training thread after every exchange, before every collective and
    checkpoint, and when the runtime stops; :meth:`release_loggers` after that; :attr:`rank` at any time.
    """

    def __init__(self, strategy: LeadershipHost) -> None:
        self.strategy = strategy
        self.rank = 0  # the rank doing Lightning's rank-zero work

    def enabled(self) -> bool:
        """Whether the runtime fails over when the leader dies: not turned off (``liveness.failover=False``), and rank 0
        is not the launching process (``start_method="popen"`` without a cluster launcher: the job's own process would
        be the dead one)."""
        st = self.strategy
        scheme = st.scheme
        return st.liveness.failover is not False and scheme is not None and not launches_in_rank_zero(st)

    def pin_loggers(self, trainer: "pl.Trainer") -> None:
        """Every rank learns rank 0's logger runs, so that a successor continues them instead of starting new ones
        (one broadcast among the live ranks, at the start of fit). Every logger write first settles the seat (see
        :meth:`follow`): a leader that resumes from a freeze must not write into the run its successor continues."""
        st = self.strategy
        if not self.enabled() or not trainer.loggers:
            return
        ids = st.broadcast(logger_ids(trainer.loggers) if st.global_rank == 0 else None, src=0)
        if st.global_rank != 0:
            pin_loggers(trainer.loggers, ids)
        guard_loggers(trainer.loggers, self.follow)

    def release_loggers(self, trainer: "pl.Trainer") -> None:
        """At the end of fit: the loggers write unguarded again (see :meth:`pin_loggers`)."""
        unguard_loggers(trainer.loggers)

    def follow(self) -> None:
        """Move the rank-zero seat to where the runtime's leader is now, taking it if that is this rank. A leader
        whose process stopped for a heartbeat window first waits to learn whether it was replaced
        (:meth:`~lightning_pgc.runtime.plane.CollectiveRuntime.settle_seat`)."""
        st = self.strategy
        runtime = st.runtime
        if runtime is not None and runtime.seat_in_doubt():
            runtime.settle_seat()
        if runtime is None or runtime.leader_rank == self.rank or st.lightning_module is None:
            return
        trainer = st.lightning_module.trainer
        dead, self.rank = self.rank, runtime.leader_rank
        if dead == st.global_rank:  # this rank froze and was replaced: it gives the seat up
            make_rank_zero(False, st.world_size)
            log.warning(
                "PGC rank %d: rank %d took over as leader while this rank was frozen; it writes the "
                "checkpoints and the loggers' runs from step %d on",
                dead,
                self.rank,
                trainer.global_step,
            )
            return
        if self.rank != st.global_rank:
            return
        make_rank_zero()
        continue_loggers(trainer.loggers)
        log.warning(
            "PGC rank %d: rank %d (the leader) died or froze; this rank leads from step %d on: it writes the "
            "checkpoints and the loggers' runs from now on",
            self.rank,
            dead,
            trainer.global_step,
        )

    def source(self, src: int) -> int:
        """The rank a broadcast from ``src`` comes from: Lightning broadcasts from rank 0, whose seat may have moved."""
        self.follow()
        return self.rank if src == 0 else src
