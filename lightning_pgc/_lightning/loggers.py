"""The rank-zero seat: ``rank_zero_only`` and the loggers' runs, moved to the rank that takes over when the PGC
leader (rank 0) dies.

Checked against lightning 2.6.6 (see the ``lightning`` pin in pyproject.toml); each helper names the private
attribute it uses.
"""

from __future__ import annotations

import csv
import os
import warnings
from typing import Any, Callable, Optional

from lightning.fabric.loggers.csv_logs import CSVLogger as _FabricCSVLogger  # 2.6.6: CSVLogger's base
from lightning.fabric.utilities.rank_zero import rank_zero_only
from lightning.pytorch.loggers import WandbLogger  # (Lightning's class: it imports wandb only when it logs)


__all__ = ["continue_loggers", "guard_loggers", "logger_ids", "make_rank_zero", "pin_loggers", "unguard_loggers"]

# When the PGC leader (rank 0) dies and another rank takes over (``lightning_pgc.strategy.leadership``), Lightning's
# rank-zero work moves with it: ``rank_zero_only`` (2.6.6: a module-level ``rank_zero_only.rank`` that strategies
# set to the global rank at setup, read at every call) and the loggers' runs.


def make_rank_zero(zero: bool = True, world_size: int = 1) -> None:
    """This process does the rank-zero work from now on (``zero``): ``rank_zero_only`` functions (loggers,
    rank-zero messages) run here; or no longer (a leader that was replaced): it then counts as a rank above all
    others (2.6.6: loggers' experiments are dummies on ranks above 0)."""
    # lightning_utilities types ``rank_zero_only`` as a plain (overloaded) function; Lightning sets and reads the
    # ``rank`` attribute it carries the same way
    rank_zero_only.rank = 0 if zero else world_size  # type: ignore[attr-defined]


def logger_ids(loggers: list[Any]) -> list[Optional[str]]:
    """Rank 0: what names each logger's run (2.6.6: ``version``, the W&B run id for ``WandbLogger``)."""
    out: list[Optional[str]] = []
    for lg in loggers:
        try:
            version = lg.version
        except Exception:  # a logger whose version needs its experiment, not reachable here
            version = None
        out.append(None if version is None else str(version))
    return out


def pin_loggers(loggers: list[Any], ids: list[Optional[str]]) -> None:
    """Every other rank: use rank 0's runs, so that a successor writes into them (2.6.6: ``CSVLogger`` and
    ``TensorBoardLogger`` keep their version in ``_version``; ``WandbLogger`` passes ``_wandb_init`` to
    ``wandb.init`` when its experiment is created)."""
    for lg, ident in zip(loggers, ids):
        if ident is None:
            continue
        if isinstance(lg, WandbLogger):
            if not isinstance(getattr(lg, "_wandb_init", None), dict):
                raise RuntimeError(
                    "WandbLogger._wandb_init is gone (lightning_pgc was checked against Lightning "
                    "2.6.6); update lightning_pgc/_lightning/loggers.py, or pass "
                    "PGCStrategy(liveness={'failover': False})"
                )
            lg._id = ident
            lg._wandb_init.update(id=ident, resume="allow")
        elif hasattr(lg, "_version"):
            lg._version = int(ident) if ident.isdigit() else ident


_LOGGER_WRITES = ("log_metrics", "log_hyperparams", "log_graph", "save", "finalize", "after_save_checkpoint")


def guard_loggers(loggers: list[Any], before: Callable[[], None]) -> None:
    """Call ``before`` ahead of every write of these loggers (2.6.6: ``Logger`` writes through these methods, each
    ``rank_zero_only``, which reads ``rank_zero_only.rank`` at call time; the guard is an instance attribute, so
    it runs first). Idempotent."""
    for lg in loggers:
        for name in _LOGGER_WRITES:
            method = getattr(lg, name, None)
            if method is None or getattr(method, "_pgc_guarded", False):
                continue

            def guarded(*args: Any, _method: Callable = method, **kwargs: Any) -> Any:
                before()
                return _method(*args, **kwargs)

            guarded._pgc_guarded = True  # type: ignore[attr-defined]
            setattr(lg, name, guarded)


def unguard_loggers(loggers: list[Any]) -> None:
    """Undo :func:`guard_loggers` (the guards hold the strategy; a logger outlives the fit)."""
    for lg in loggers:
        for name in _LOGGER_WRITES:
            if getattr(vars(lg).get(name), "_pgc_guarded", False):
                delattr(lg, name)


def continue_loggers(loggers: list[Any]) -> None:
    """A successor, now rank zero: open rank 0's runs and append to them (2.6.6: creating the CSV writer deletes
    an existing ``metrics.csv``, so it is kept aside meanwhile and its columns are carried over)."""
    for lg in loggers:
        if not isinstance(lg, _FabricCSVLogger):
            continue
        path = os.path.join(lg.log_dir, "metrics.csv")
        kept = path + ".pgc" if os.path.isfile(path) else None
        if kept is not None:
            os.replace(path, kept)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # "logs directory exists and is not empty": it is rank 0's, continued
            writer = lg.experiment
        if kept is not None:
            os.replace(kept, path)
            with open(path, newline="") as fh:
                writer.metrics_keys = sorted(next(csv.reader(fh), []))
