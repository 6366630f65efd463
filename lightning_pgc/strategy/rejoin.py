"""StateTransfer: how a rank that fell more than ``max_lag`` versions behind rejoins, from a donor's training state.

The runtime moves the bytes (:meth:`~lightning_pgc.runtime.CollectiveRuntime.rejoin`, ``send_state``); this helper turns
the module and optimizer state into those bytes and back, and runs the idle steps before the rejoin version.
"""

from __future__ import annotations

import io
from typing import TYPE_CHECKING, Any, Callable, Optional

import torch
from torch import Tensor

from lightning_pgc._lightning import set_closure_loss

if TYPE_CHECKING:
    from lightning_pgc.strategy.strategy import PGCStrategy


STALLED_IDLE = 8  # idle steps without gaining on the open version after which a detached rank rejoins at once


class StateTransfer:
    """Rejoin by state transfer for one :class:`~lightning_pgc.PGCStrategy`.

    Call order: while detached, :meth:`ahead` at each step (an :meth:`idle_step` while it returns True); then set
    :attr:`pending` from ``runtime.rejoin(version)``; then at each step :meth:`catch_up` (and :meth:`idle_step`
    while it returns True); :meth:`finish` when training ends. A donor calls :meth:`state_bytes`.
    """

    def __init__(self, strategy: "PGCStrategy") -> None:
        self.strategy = strategy
        self.pending: Optional[tuple[int, Tensor]] = None  # (version, state) received by state transfer, not loaded
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

    def state_bytes(self) -> Tensor:
        """This rank's training state (module state dict and every optimizer's) serialized for a state transfer."""
        module = self.strategy.lightning_module
        assert module is not None
        buf = io.BytesIO()
        torch.save(
            {"model": module.state_dict(), "optimizers": [opt.state_dict() for opt in module.trainer.optimizers]}, buf
        )
        return torch.frombuffer(bytearray(buf.getbuffer()), dtype=torch.uint8)

    def load_state(self, state: Tensor) -> None:
        """Load a state from :meth:`state_bytes` (another rank's, at the version this rank rejoins at)."""
        st = self.strategy
        if state.numel() == 0:
            raise RuntimeError(f"PGC rank {st.global_rank}: the donor sent no training state")
        loaded = torch.load(io.BytesIO(state.numpy().tobytes()), map_location=st.root_device, weights_only=True)
        module = st.lightning_module
        assert module is not None
        module.load_state_dict(loaded["model"])
        for opt, sd in zip(module.trainer.optimizers, loaded["optimizers"]):
            opt.load_state_dict(sd)
