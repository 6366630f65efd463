"""StateTransfer: how a rank that fell more than ``max_lag`` versions behind rejoins, from a donor's training state.

The runtime moves the state (:meth:`~lightning_pgc.runtime.CollectiveRuntime.rejoin`,
:meth:`~lightning_pgc.runtime.CollectiveRuntime.serve_rejoins`, over :mod:`~lightning_pgc.runtime.transfer`); this
helper names what the state is (:meth:`StateTransfer.state_tree`), loads it, and runs the idle steps before the rejoin
version.
"""

from __future__ import annotations

import random
from typing import Any, Callable, Optional, Protocol

import numpy as np
import torch
from torch import Tensor

import lightning.pytorch as pl
from lightning_pgc._lightning import set_closure_loss
from lightning_pgc.codes import StaleCache
from lightning_pgc.staleness import StalenessCorrection
from lightning_pgc.strategy.gradients import Gradients


STALLED_IDLE = 8  # idle steps without gaining on the open version after which a detached rank rejoins at once


class LastStep(Protocol):
    """What an idle step repeats of the last step this rank applied (:class:`~lightning_pgc.strategy.StepInfo`)."""

    @property
    def loss(self) -> float: ...


class StateTransferHost(Protocol):
    """What :class:`StateTransfer` uses of its strategy (:class:`~lightning_pgc.PGCStrategy`); an idle step counts
    as skipped (``skipped_steps``)."""

    skipped_steps: int

    @property
    def global_rank(self) -> int: ...

    @property
    def cache(self) -> Optional[StaleCache]: ...

    @property
    def gradients(self) -> Gradients: ...

    @property
    def last_step(self) -> Optional[LastStep]: ...

    @property
    def correction(self) -> StalenessCorrection: ...

    @property
    def lightning_module(self) -> Optional[pl.LightningModule]: ...


class StateTransfer:
    """Rejoin by state transfer for one :class:`~lightning_pgc.PGCStrategy`.

    Call order: while detached, :meth:`ahead` at each step (an :meth:`idle_step` while it returns True); then set
    :attr:`pending` from ``runtime.rejoin(version)``; then at each step :meth:`catch_up` (and :meth:`idle_step`
    while it returns True); :meth:`finish` when training ends. A donor sends :meth:`state_tree`.
    """

    def __init__(self, strategy: StateTransferHost) -> None:
        self.strategy = strategy
        self.pending: Optional[tuple[int, Any]] = None  # (version, state) received by state transfer, not loaded
        self._gap: Optional[tuple[int, int]] = None  # (smallest gap to the open version, idle steps since then)

    def ahead(self, version: int, frontier: int) -> bool:
        """A detached rank at ``version``, the open version being ``frontier``: True while it should idle on
        before asking to rejoin. It rejoins near the open version, so it holds no aggregates while it idles
        (asking at once meant idling after the state came, holding aggregates, and being detached again past
        ``max_lag``: two state transfers per stall). False once within a version of it, or when the gap has not
        shrunk for ``STALLED_IDLE`` idle steps (idle steps no faster than the others' steps: rejoin now; the
        frontier moves in heartbeat-sized jumps, so one wider gap proves nothing)."""
        gap = frontier - version
        if gap <= 1:
            self._gap = None
            return False
        if self._gap is None or gap < self._gap[0]:
            self._gap = (gap, 0)
            return True
        self._gap = (self._gap[0], self._gap[1] + 1)
        if self._gap[1] >= STALLED_IDLE:
            self._gap = None
            return False
        return True

    def catch_up(self, version: int) -> bool:
        """With a state received by :meth:`CollectiveRuntime.rejoin` pending: True while ``version`` is before the one it
        belongs to (an idle step); at that version load it, empty the cache and return False (compute as usual)."""
        assert self.pending is not None and self.strategy.cache is not None
        if version < self.pending[0]:
            return True
        self.load_state(self.pending[1])  # the state at the start of this version: go on from here
        self.pending = None
        self.strategy.cache.clear()
        return False

    def idle_step(self, version: int, closure: Callable[[], Any]) -> Tensor:
        """A step before the version this rank rejoins at: nothing computed, nothing applied (no gradients, so the
        optimizer leaves every parameter alone); the state loaded at that version replaces these steps."""
        st = self.strategy
        st.gradients.zero_grad()
        st.skipped_steps += 1
        loss_t = torch.tensor(st.last_step.loss if st.last_step is not None else float("nan"))
        set_closure_loss(closure, loss_t, True)
        return loss_t

    def finish(self) -> None:
        """Training ended before the version this rank rejoins at: take the final state."""
        if self.pending is not None:
            self.load_state(self.pending[1])
            self.pending = None

    def state_tree(self, boundary: bool = False) -> dict[str, Any]:
        """This rank's training state, what a resumed rank needs to be the same replica: the module's state dict, every
        optimizer's and scheduler's, the callbacks' states (those a ``ddp`` checkpoint holds), the staleness
        correction's snapshots and the random number generators. Its tensors are this rank's own (no copy): the
        runtime sends them, or receives into them (:meth:`CollectiveRuntime.rejoin`).

        With ``boundary`` (a donor inside one of Lightning's collectives at the step boundary before the version the
        recipient rejoins at: a checkpoint or validation in progress) only the module, the optimizers and the
        staleness snapshots, which the boundary's hooks do not change: the schedulers', callbacks' and generators'
        states are half-way through that boundary there. The recipient runs the same boundary's hooks itself (its
        collectives replay the donor's results), so it keeps its own."""
        st = self.strategy
        module = st.lightning_module
        assert module is not None
        trainer = module.trainer
        whole = not boundary
        return {
            "model": module.state_dict(),
            "optimizers": [opt.state_dict() for opt in trainer.optimizers],
            "schedulers": [c.scheduler.state_dict() for c in trainer.lr_scheduler_configs] if whole else None,
            "callbacks": {cb.state_key: sd for cb in _callbacks(trainer) if (sd := cb.state_dict())} if whole else None,
            "staleness": st.correction.state_dict(),
            "rng": rng_states() if whole else None,
        }

    def load_state(self, state: Optional[dict[str, Any]]) -> None:
        """Load a state from :meth:`state_tree` (another rank's, at the version this rank rejoins at)."""
        st = self.strategy
        if not state:
            raise RuntimeError(f"PGC rank {st.global_rank}: the donor sent no training state")
        module = st.lightning_module
        assert module is not None
        trainer = module.trainer
        module.load_state_dict(state["model"])
        for opt, sd in zip(trainer.optimizers, state["optimizers"]):
            opt.load_state_dict(sd)
        st.correction.load_state_dict(state["staleness"])
        if state["schedulers"] is None:  # sent from a step boundary (see state_tree): this rank's own are in step
            return
        for config, sd in zip(trainer.lr_scheduler_configs, state["schedulers"]):
            config.scheduler.load_state_dict(sd)
        for cb in _callbacks(trainer):
            if cb.state_key in state["callbacks"]:
                cb.load_state_dict(state["callbacks"][cb.state_key])
        set_rng_states(state["rng"])


def _callbacks(trainer: Any) -> list[Any]:
    return list(getattr(trainer, "callbacks", ()))


def rng_states() -> dict[str, Any]:
    """Every random number generator's state (torch's, CUDA's where initialized, NumPy's and Python's)."""
    states: dict[str, Any] = {
        "torch": torch.get_rng_state(),
        "numpy": np.random.get_state(),
        "python": random.getstate(),
    }
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        states["cuda"] = torch.cuda.get_rng_state_all()
    return states


def set_rng_states(states: dict[str, Any]) -> None:
    """Restore the generators from :func:`rng_states`."""
    torch.set_rng_state(states["torch"].cpu())
    np.random.set_state(states["numpy"])
    random.setstate(states["python"])
    if "cuda" in states and torch.cuda.is_available():
        torch.cuda.set_rng_state_all([s.cpu() for s in states["cuda"]])
