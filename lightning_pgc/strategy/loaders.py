"""The training DataLoader under PGC: the user's loader re-created as ``ddp`` re-creates it (its class, every
argument it was built with), with the rank's partition batch sampler in place of the ``DistributedSampler``.

The re-creation is Lightning's own (:func:`lightning_pgc._lightning.with_batch_sampler`); a loader it cannot
re-create around a batch sampler is refused with what to change, never replaced by a plain ``DataLoader``.
"""

from __future__ import annotations

from typing import Iterable

from lightning.fabric.utilities.exceptions import MisconfigurationException
from torch.utils.data import DataLoader

from lightning_pgc._lightning import with_batch_sampler
from lightning_pgc.strategy.preflight import PGCUnsupportedError

__all__ = ["partition_loader"]

#: what the re-created loader is given, for the messages
_GIVEN = "`batch_sampler=` its partition sampler, `batch_size=1`, `shuffle=False`, `sampler=None`, `drop_last=False`"


def partition_loader(loader: DataLoader, batch_sampler: Iterable[list[int]]) -> DataLoader:
    """``loader`` re-created with ``batch_sampler``, as ``ddp`` re-creates it with its ``DistributedSampler``: the
    same class, every other argument as recorded when a ``*_dataloader`` hook built it (else its attributes), so
    ``collate_fn``, ``generator``, ``prefetch_factor``, ``persistent_workers``, ``in_order`` and the class's own
    arguments are kept, and batches are collated as under ``ddp``.

    Raises:
        PGCUnsupportedError: the class cannot be re-created with these arguments, or ignores ``batch_sampler``.
    """
    name = type(loader).__name__
    try:
        rebuilt = with_batch_sampler(loader, batch_sampler)
    except (MisconfigurationException, TypeError) as error:
        raise PGCUnsupportedError(
            f"PGCStrategy re-creates the training DataLoader as `ddp` does, with {_GIVEN}; `{name}` could not be "
            f"re-created so ({error}). Let its `__init__` accept these arguments and pass them on to `DataLoader` as "
            "they are (`**kwargs` does)"
        ) from error
    if rebuilt.batch_sampler is not batch_sampler:
        raise PGCUnsupportedError(
            f"PGCStrategy re-creates the training DataLoader as `ddp` does, with {_GIVEN}; `{name}`, re-created so, "
            f"draws its batches from a {type(rebuilt.batch_sampler).__name__} instead (its `__init__` drops or "
            "replaces `batch_sampler`). Let its `__init__` pass `batch_sampler` on to `DataLoader`"
        )
    return rebuilt
