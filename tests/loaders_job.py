"""One fit per strategy on 2 CPU ranks whose training loaders are the cases of :data:`CASES`, built in the
``train_dataloader`` hook (so Lightning records their arguments, as for most users' loaders).

``python -m tests.loaders_job OUT STRATEGY...`` (``ddp`` or a registered PGC name; ranks forked, so Lightning is
imported once for all). The hook returns one loader per case (a dict: Lightning combines them), and every call of
``training_step`` records what it received for each case: the batch's types, field names, dtypes and shapes
(:func:`describe`). After the fit each rank writes ``OUT/STRATEGY/rank{k}.json``: those descriptions, the
arguments of each case's training loader as the fit ran it (:func:`loader_args`), and how many ``training_step``
calls each step made.
"""

from __future__ import annotations

import dataclasses
import json
import sys
from collections import namedtuple
from pathlib import Path
from typing import Any, Callable, Mapping

import lightning.pytorch as pl
import torch
from lightning.pytorch.strategies import DDPStrategy
from torch.utils.data import DataLoader, Dataset, default_collate

import lightning_pgc
from lightning_pgc.strategy import REGISTERED

SAMPLES, BATCH, STEPS = 32, 4, 2

Sample = namedtuple("Sample", "x y")


@dataclasses.dataclass
class Batch:
    """A custom ``collate_fn``'s batch."""

    x: torch.Tensor
    y: torch.Tensor


class SamplesByKind(Dataset):
    """Sample ``i``: ``x`` (3 floats), ``y`` (an int64 label) and its name, in the form ``kind`` asks for."""

    def __init__(self, kind: str = "tuple") -> None:
        self.kind = kind

    def __len__(self) -> int:
        return SAMPLES

    def __getitem__(self, i: int) -> Any:
        x, y = torch.full((3,), float(i)), torch.tensor(i % 2)
        if self.kind == "namedtuple":
            return Sample(x, y)
        if self.kind == "strings":
            return {"x": x, "name": f"sample{i}", "y": y}
        return x, y


class TaggedLoader(DataLoader):
    """A DataLoader subclass with an argument of its own that it keeps out of its attributes' names: only the
    arguments Lightning records let it be re-created."""

    def __init__(self, dataset: Dataset, tag: str, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self._tag = tag


def pairs_to_dict(samples: list[Any]) -> dict[str, torch.Tensor]:
    """A custom ``collate_fn``: a dict of the stacked inputs and targets."""
    x, y = default_collate(samples)
    return {"inputs": x, "targets": y}


def pairs_to_dataclass(samples: list[Any]) -> Batch:
    """A custom ``collate_fn`` whose batch is a dataclass."""
    return Batch(*default_collate(samples))


#: case -> the loader the hook builds for it
CASES: dict[str, Callable[[], DataLoader]] = {
    "subclass": lambda: TaggedLoader(SamplesByKind(), "kept", batch_size=BATCH, shuffle=True),
    "generator": lambda: DataLoader(
        SamplesByKind(), batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(7)
    ),
    "persistent_workers": lambda: DataLoader(SamplesByKind(), batch_size=BATCH, num_workers=1, persistent_workers=True),
    "prefetch_factor": lambda: DataLoader(SamplesByKind(), BATCH, num_workers=1, prefetch_factor=3, in_order=False),
    "collate_fn": lambda: DataLoader(SamplesByKind(), batch_size=BATCH, collate_fn=pairs_to_dict),
    "namedtuple": lambda: DataLoader(SamplesByKind("namedtuple"), batch_size=BATCH),
    "dataclass": lambda: DataLoader(SamplesByKind(), batch_size=BATCH, collate_fn=pairs_to_dataclass),
    "strings": lambda: DataLoader(SamplesByKind("strings"), batch_size=BATCH),
}


def describe(value: Any) -> Any:
    """A batch's structure: types, field names, tensors' dtype and shape, lists' length and item types."""
    kind = type(value).__qualname__
    if isinstance(value, torch.Tensor):
        return {"type": kind, "dtype": str(value.dtype), "shape": list(value.shape)}
    if dataclasses.is_dataclass(value) and not isinstance(value, type):
        return {"type": kind, "fields": {f.name: describe(getattr(value, f.name)) for f in dataclasses.fields(value)}}
    if isinstance(value, tuple) and hasattr(value, "_fields"):
        return {"type": kind, "fields": {name: describe(getattr(value, name)) for name in value._fields}}
    if isinstance(value, Mapping):
        return {"type": kind, "fields": {str(k): describe(v) for k, v in value.items()}}
    if isinstance(value, (list, tuple)):
        items = {json.dumps(describe(v), sort_keys=True) for v in value}
        return {"type": kind, "len": len(value), "items": sorted(items)}
    return {"type": kind}


def loader_args(loader: DataLoader) -> dict[str, Any]:
    """The training loader's class and the arguments it runs with (the sampling ones apart)."""
    generator = loader.generator
    return {
        "class": type(loader).__qualname__,
        "tag": getattr(loader, "_tag", None),
        "num_workers": loader.num_workers,
        "collate_fn": getattr(loader.collate_fn, "__qualname__", repr(loader.collate_fn)),
        "pin_memory": loader.pin_memory,
        "timeout": loader.timeout,
        "worker_init_fn": None if loader.worker_init_fn is None else repr(loader.worker_init_fn),
        "multiprocessing_context": repr(loader.multiprocessing_context),
        "generator_seed": None if generator is None else generator.initial_seed(),
        "prefetch_factor": loader.prefetch_factor,
        "persistent_workers": loader.persistent_workers,
        "pin_memory_device": loader.pin_memory_device,
        "in_order": loader.in_order,
    }


class Recorder(pl.LightningModule):
    """A linear model on every case's ``x``; records each ``training_step`` call's batch."""

    def __init__(self, out: Path) -> None:
        super().__init__()
        self.out = out
        self.layer = torch.nn.Linear(3, 1)
        self.batches: dict[str, set[str]] = {case: set() for case in CASES}
        self.calls: dict[int, int] = {}

    def train_dataloader(self) -> dict[str, DataLoader]:
        return {case: build() for case, build in CASES.items()}

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.calls[self.global_step] = self.calls.get(self.global_step, 0) + 1
        for case, value in batch.items():
            self.batches[case].add(json.dumps(describe(value), sort_keys=True))
        x = batch["generator"][0]
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)

    def on_train_end(self) -> None:
        loaders = self.trainer.train_dataloader
        assert isinstance(loaders, dict)
        row = {
            "batches": {case: sorted(found) for case, found in self.batches.items()},
            "loaders": {case: loader_args(loader) for case, loader in loaders.items()},
            "batch_samplers": sorted({type(loader.batch_sampler).__qualname__ for loader in loaders.values()}),
            "calls": list(self.calls.values()),
        }
        (self.out / f"rank{self.global_rank}.json").write_text(json.dumps(row, indent=1, sort_keys=True))


def strategy(name: str) -> pl.strategies.Strategy:
    if name == "ddp":
        return DDPStrategy(start_method="fork")
    # no diagnostics: its probes call training_step on a whole loaded batch, off the record
    return lightning_pgc.PGCStrategy(**REGISTERED[name].kwargs, start_method="fork", diagnostics={"enabled": False})


def main(out: Path, names: list[str]) -> None:
    for name in names:
        pl.seed_everything(0, verbose=False)
        (out / name).mkdir(parents=True, exist_ok=True)
        trainer = pl.Trainer(
            accelerator="cpu",
            devices=2,
            strategy=strategy(name),
            max_steps=STEPS,
            logger=False,
            enable_checkpointing=False,
            enable_progress_bar=False,
            enable_model_summary=False,
            num_sanity_val_steps=0,
            default_root_dir=str(out),
        )
        trainer.fit(Recorder(out / name))


if __name__ == "__main__":
    main(Path(sys.argv[1]), sys.argv[2:])
