"""Every private Lightning API lightning_pgc uses, in one package, each with the version it was checked against.

When Lightning changes one of these, this package is the only place to fix: ``shims`` (the training loop's
closure, SIGTERM broadcast and notifier, weight broadcast, SyncBatchNorm flag), ``launchers`` (launchers that
survive dead ranks), ``loggers`` (the rank-zero seat and the loggers' runs) and ``data`` (the training DataLoader
re-created as under ``ddp``). Checked against lightning 2.6.6 and 2.5.0, the ends of the ``lightning`` range in
pyproject.toml (``make test-compat`` runs the lower end).
"""

from lightning_pgc._lightning.data import leave_training_loaders, with_batch_sampler
from lightning_pgc._lightning.launchers import (
    Preflight,
    SurvivingMultiprocessingLauncher,
    SurvivingSubprocessLauncher,
    launches_in_rank_zero,
    mark_launching_rank,
    surviving_launcher,
    wrap_launcher,
)
from lightning_pgc._lightning.loggers import (
    continue_loggers,
    guard_loggers,
    logger_ids,
    make_rank_zero,
    pin_loggers,
    unguard_loggers,
)
from lightning_pgc._lightning.shims import (
    closure_loss,
    default_pg_timeout,
    has_layer_sync,
    mark_sigterm,
    replace_sigterm_broadcast,
    replace_sigterm_notifier,
    set_closure_loss,
    sync_module_states,
)

__all__ = [
    "Preflight",
    "SurvivingMultiprocessingLauncher",
    "SurvivingSubprocessLauncher",
    "closure_loss",
    "continue_loggers",
    "default_pg_timeout",
    "guard_loggers",
    "has_layer_sync",
    "launches_in_rank_zero",
    "leave_training_loaders",
    "logger_ids",
    "make_rank_zero",
    "mark_launching_rank",
    "mark_sigterm",
    "pin_loggers",
    "replace_sigterm_broadcast",
    "replace_sigterm_notifier",
    "set_closure_loss",
    "surviving_launcher",
    "sync_module_states",
    "unguard_loggers",
    "with_batch_sampler",
    "wrap_launcher",
]
