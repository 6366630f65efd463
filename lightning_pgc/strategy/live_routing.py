"""LiveRouting: where Lightning's collectives, torchmetrics' syncs and SIGTERM go while the PGC runtime runs.

During fit the default process group needs every rank, so one dead rank would fail or hang validation and
checkpoints; :class:`LiveRouting` sends them among the live ranks instead (:mod:`lightning_pgc.runtime.collectives`).
"""

from __future__ import annotations

from typing import Any, Callable, Optional, Protocol

from lightning.pytorch.utilities.exceptions import SIGTERMException
from torch import Tensor
from torchmetrics import Metric  # (a dependency of Lightning's)
from torchmetrics.utilities.distributed import gather_all_tensors

import lightning.pytorch as pl
from lightning_pgc._lightning import mark_sigterm
from lightning_pgc.runtime.plane import CollectiveRuntime
from lightning_pgc.strategy.options import LivenessOptions

#: :meth:`LiveRouting.target` on a rank that is leaving (SIGTERM): collectives run on this rank alone.
ALONE = object()


class LiveRoutingHost(Protocol):
    """What :class:`LiveRouting` uses of its strategy (:class:`~lightning_pgc.PGCStrategy`)."""

    @property
    def runtime(self) -> Optional[CollectiveRuntime]: ...

    @property
    def lightning_module(self) -> Optional[pl.LightningModule]: ...

    @property
    def liveness(self) -> LivenessOptions: ...

    def rejoin_before_collective(self, version: int) -> None: ...


class LiveRouting:
    """The live-rank glue of one :class:`~lightning_pgc.PGCStrategy`: collective routing, torchmetrics syncs, the
    SIGTERM handler and the launcher's grace period.

    Call order: :meth:`route_metric_syncs` once the runtime started, :meth:`restore_metric_syncs` when it stops;
    :meth:`target` before each collective.
    """

    def __init__(self, strategy: LiveRoutingHost) -> None:
        self.strategy = strategy
        self.metric_syncs: list[tuple[Any, Any]] = []

    def target(self) -> Any:
        """Where Lightning's collectives go now: None (the default group: outside fit, every rank alive), the
        runtime's live-rank collectives (during fit), or ``ALONE`` on a rank that got SIGTERM and is leaving, or
        whose runtime failed (it runs them by itself: the others do not join them, and only rank 0 writes
        checkpoints, so e.g. ``ModelCheckpoint(save_on_exception=True)`` still saves rank 0's state)."""
        st = self.strategy
        if st.runtime is None:
            return None
        trainer = st.lightning_module.trainer if st.lightning_module is not None else None
        if (trainer is not None and trainer.received_sigterm) or st.runtime.failure() is not None:
            return ALONE
        if trainer is not None:
            st.rejoin_before_collective(trainer.global_step)
        return st.runtime.collectives

    def route_metric_syncs(self) -> None:
        """Make the module's torchmetrics metrics synchronize among the live ranks during fit: their default
        ``gather_all_tensors`` runs on the default group (every rank), so a dead rank would fail validation.
        ``Metric.dist_sync_fn`` is torchmetrics' public hook for it (checked with torchmetrics 1.9.0)."""
        module = self.strategy.lightning_module
        assert module is not None
        modules = module.modules()
        self.metric_syncs = [(m, m.dist_sync_fn) for m in modules if isinstance(m, Metric)]
        for metric, _ in self.metric_syncs:
            metric.dist_sync_fn = self.gather_metric_state

    def restore_metric_syncs(self) -> None:
        """Give every routed metric its own ``dist_sync_fn`` back."""
        for metric, fn in self.metric_syncs:
            metric.dist_sync_fn = fn
        self.metric_syncs = []

    def gather_metric_state(self, tensor: Tensor, group: Optional[Any] = None) -> list[Tensor]:
        """torchmetrics' ``dist_sync_fn``: the state ``tensor`` of every live rank, in rank order."""
        live = self.target()
        if live is None or group is not None:
            return gather_all_tensors(tensor, group=group)
        if live is ALONE:
            return [tensor]
        got = live.gather.gather("all_gather", tensor.detach().to("cpu"))
        return [got[r].to(tensor.device) for r in sorted(got)]

    @staticmethod
    def sigterm_notifier(trainer: "pl.Trainer") -> Callable[[Any, Any], None]:
        """Lightning's SIGTERM handler without its default-group broadcast: this rank leaves at its next batch, or
        at once if it is waiting on the others (its BYE tells the leader, and the others go on as with a dead rank);
        a launching process forwards the signal to the ranks it started (under ``popen``, rank 0's SIGTERM stops the
        whole job, as under ``ddp``)."""

        def notify(signum: Any, frame: Any) -> None:
            if not trainer.received_sigterm and trainer.strategy.launcher is not None:
                trainer.strategy.launcher.kill(signum)
            mark_sigterm(trainer)
            runtime = getattr(trainer.strategy, "runtime", None)
            if runtime is not None:  # a rank waiting on the others (an aggregate, the leader's STOP) stops waiting
                runtime.interrupt()

        return notify

    @staticmethod
    def local_sigterm_check(trainer: "pl.Trainer") -> Callable[[], None]:
        """Lightning broadcasts a SIGTERM flag from rank 0 before *every* training batch; that collective makes each
        rank wait for the slowest one and would defeat straggler tolerance. Under PGC a SIGTERM is handled on the
        rank that received it: it leaves at its next batch, and the others go on as with a dead rank."""

        def check() -> None:
            if getattr(trainer, "received_sigterm", False):
                raise SIGTERMException()

        return check

    def reap_grace_s(self) -> float:
        """Seconds the launching process gives the other ranks to exit after rank 0 returned: a worker notices a
        gone leader after a heartbeat window, then tears down."""
        live = self.strategy.liveness
        return 30.0 + 2 * (live.heartbeat_interval * live.heartbeat_misses + live.timeout)
