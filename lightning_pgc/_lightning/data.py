"""Lightning's DataLoader re-creation (the one that puts ``ddp``'s ``DistributedSampler`` in), run with PGC's batch
sampler instead, and the training loaders handed to the strategy as they were built.

Lightning records the arguments of every DataLoader a ``*_dataloader`` hook builds and re-creates the loader from
them (``lightning.pytorch.utilities.data._update_dataloader``); a loader built elsewhere is re-created from its
attributes. :func:`with_batch_sampler` runs the same machinery; :func:`leave_training_loaders` hands the training
loaders to the strategy as they were built, so that they still carry those recorded arguments.

Checked against lightning 2.6.6 (see the ``lightning`` pin in pyproject.toml); each private name used is named
with that version where it is used.
"""

from __future__ import annotations

from typing import Any, Iterable

from lightning.fabric.utilities.data import _reinstantiate_wrapped_cls  # 2.6.6: build, replay recorded setattrs
from lightning.pytorch.trainer.states import RunningStage
from lightning.pytorch.utilities.data import _get_dataloader_init_args_and_kwargs  # 2.6.6: a loader's init args
from torch.utils.data import DataLoader

import lightning.pytorch as pl

__all__ = ["leave_training_loaders", "with_batch_sampler"]

#: what a DataLoader with a ``batch_sampler`` must be given for the arguments that exclude it
_BATCH_SAMPLER_ARGS: dict[str, Any] = {"sampler": None, "shuffle": False, "batch_size": 1, "drop_last": False}


def with_batch_sampler(loader: DataLoader, batch_sampler: Iterable[list[int]]) -> DataLoader:
    """``loader`` re-created with ``batch_sampler``: its class, with the arguments Lightning recorded when a
    ``*_dataloader`` hook built it (else its attributes), as ``ddp`` re-creates it around its ``DistributedSampler``
    (``_get_dataloader_init_args_and_kwargs`` and ``_reinstantiate_wrapped_cls``, 2.6.6; attributes set on the
    loader after it was built are set again). ``sampler``, ``shuffle``, ``batch_size`` and ``drop_last`` take the
    values a DataLoader with a batch sampler needs, in place of the recorded ones (positional ones included).

    Raises:
        lightning.fabric.utilities.exceptions.MisconfigurationException, TypeError: Lightning's errors when the class
            cannot be re-created from what was recorded (a required argument that is neither recorded nor an
            attribute, an argument the class does not accept, two arguments that reach the same DataLoader one).
    """
    args, kwargs = _get_dataloader_init_args_and_kwargs(loader, batch_sampler, mode=RunningStage.TRAINING)
    args, kwargs = tuple(args), dict(kwargs)  # (the recorded kwargs are the loader's own dict)
    names: tuple[str, ...] = getattr(loader, "__pl_saved_arg_names", ())  # 2.6.6: the positional arguments' names
    for name, value in {**_BATCH_SAMPLER_ARGS, "batch_sampler": batch_sampler}.items():
        if name in names:
            kwargs.pop(name, None)
            position = names.index(name)
            args = (*args[:position], value, *args[position + 1 :])
        else:
            kwargs[name] = value
    return _reinstantiate_wrapped_cls(loader, *args, **kwargs)


def leave_training_loaders(trainer: "pl.Trainer") -> None:
    """Hand the training DataLoaders to ``strategy.process_dataloader`` as they were built: without the
    ``DistributedSampler`` Lightning would put in first, whose re-created loader no longer carries the arguments
    recorded when a hook built it. Other stages are prepared as before.

    Lightning 2.6.6 calls ``trainer._data_connector._prepare_dataloader(dataloader, shuffle, mode)`` just before
    ``strategy.process_dataloader`` (``_process_dataloader`` in ``trainer/connectors/data_connector.py``).

    Raises:
        RuntimeError: the method is gone (a Lightning version this module was not checked against).
    """
    connector = trainer._data_connector
    prepare = getattr(type(connector), "_prepare_dataloader", None)
    if prepare is None:
        raise RuntimeError(
            "lightning_pgc: this Lightning version has no `_DataConnector._prepare_dataloader` (checked against "
            "2.6.6); update lightning_pgc/_lightning/data.py"
        )

    def prepare_but_training(dataloader: object, shuffle: bool, mode: RunningStage) -> object:
        if mode == RunningStage.TRAINING:
            return dataloader
        return prepare(connector, dataloader, shuffle=shuffle, mode=mode)

    connector._prepare_dataloader = prepare_but_training  # type: ignore[method-assign]
