"""Lightning's private training-loop hooks that PGCStrategy replaces or reads: the closure's result, the
per-batch SIGTERM broadcast and the SIGTERM notifier, the weight broadcast at wrap time, SyncBatchNorm's flag.

Checked against lightning 2.6.6 and 2.5.0, the ends of the ``lightning`` range in pyproject.toml (``make
test-compat`` runs the lower end); each helper names the private attribute it uses and raises a clear error if the
attribute moved.
"""

from __future__ import annotations

from typing import Any, Callable, Optional

import lightning
import torch
from lightning.fabric.plugins.collectives.torch_collective import default_pg_timeout  # 2.6.6: module constant
from lightning.pytorch.loops.optimization.automatic import ClosureResult  # 2.6.6: automatic optimization output
from lightning.pytorch.overrides.distributed import _sync_module_states  # 2.6.6: broadcast rank 0's weights

import lightning.pytorch as pl
from packaging.version import Version

__all__ = [
    "closure_loss",
    "default_pg_timeout",
    "has_layer_sync",
    "mark_sigterm",
    "replace_sigterm_broadcast",
    "replace_sigterm_notifier",
    "set_closure_loss",
    "sync_module_states",
]

#: The first Lightning release that broadcasts the SIGTERM flag from rank 0 before every training batch.
_SIGTERM_BROADCAST_SINCE = Version("2.5.2")


def sync_module_states(module: torch.nn.Module) -> None:
    """Broadcast rank 0's parameters and buffers (``lightning.pytorch.overrides.distributed._sync_module_states``,
    2.6.6), as DDP does at wrap time."""
    _sync_module_states(module)


def set_closure_loss(closure: Callable[[], Any], loss: torch.Tensor, skipped: bool) -> None:
    """Make the automatic-optimization closure report ``loss`` (2.6.6: ``Closure._result`` is a ``ClosureResult``
    that the loop reads after ``optimizer.step``); a rank that skipped the training step gets a fresh result."""
    if not hasattr(closure, "_result"):
        return
    if skipped or closure._result is None:
        closure._result = ClosureResult(None)
    closure._result.loss = loss


def closure_loss(closure: Callable[[], Any]) -> Optional[torch.Tensor]:
    """The loss the training step returned through the closure (2.6.6: ``Closure._result.loss``)."""
    result = getattr(closure, "_result", None)
    return None if result is None else result.loss


def replace_sigterm_broadcast(trainer: "pl.Trainer", check: Callable[[], None]) -> None:
    """Replace the per-batch SIGTERM broadcast of the training epoch loop with ``check``.

    Lightning 2.6.6 calls ``fit_loop.epoch_loop._broadcast_sigterm_tensor()`` before every training batch; it is
    a collective on the default group that makes each rank wait for the slowest one. Releases before 2.5.2 have no
    such broadcast (each rank checks its own flag after each batch): there is nothing to replace.

    Raises:
        RuntimeError: the attribute is gone (a Lightning version this module was not checked against).
    """
    epoch_loop = trainer.fit_loop.epoch_loop
    if not hasattr(epoch_loop, "_broadcast_sigterm_tensor"):
        if Version(lightning.__version__) < _SIGTERM_BROADCAST_SINCE:
            return
        raise RuntimeError(
            "lightning_pgc: this Lightning version has no `_broadcast_sigterm_tensor` on the training epoch loop "
            "(checked against 2.6.6); update lightning_pgc/_lightning/shims.py"
        )
    epoch_loop._broadcast_sigterm_tensor = check  # type: ignore[method-assign]


def has_layer_sync(strategy: Any) -> bool:
    """Whether ``Trainer(sync_batchnorm=True)`` asked the strategy to convert BatchNorm to SyncBatchNorm (2.6.6:
    ``ParallelStrategy._layer_sync``, set by the accelerator connector before launch, applied in ``DDPStrategy.setup``)."""
    return getattr(strategy, "_layer_sync", None) is not None


def replace_sigterm_notifier(trainer: "pl.Trainer", notifier: Callable[[Any, Any], None]) -> None:
    """Replace Lightning's SIGTERM notifier, which broadcasts on the default group from inside the signal handler
    (2.6.6: ``trainer._signal_connector._sigterm_notifier_fn``, read when ``register_signal_handlers`` runs in
    ``Trainer._run``, after ``strategy.setup``). A SIGTERM on one rank would otherwise block that rank in a
    broadcast nobody else joins.

    Raises:
        RuntimeError: the attribute is gone (a Lightning version this module was not checked against).
    """
    connector = getattr(trainer, "_signal_connector", None)
    if connector is None or not hasattr(connector, "_sigterm_notifier_fn"):
        raise RuntimeError(
            "lightning_pgc: this Lightning version has no `_signal_connector._sigterm_notifier_fn` "
            "(checked against 2.6.6); update lightning_pgc/_lightning/shims.py"
        )
    connector._sigterm_notifier_fn = notifier


def mark_sigterm(trainer: "pl.Trainer") -> None:
    """Set ``trainer.received_sigterm`` (2.6.6: a read-only property over ``_signal_connector.received_sigterm``)."""
    trainer._signal_connector.received_sigterm = True
