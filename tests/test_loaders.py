"""The training DataLoader under PGC is re-created as under ``ddp``: its class and every argument, with the partition
batch sampler in place of the ``DistributedSampler``, and ``training_step`` receives batches of the same types,
fields, dtypes and shapes. One real fit per strategy on 2 CPU ranks covers every case of
``tests/loaders_job.py``; the loaders that cannot be re-created around a batch sampler are refused, never
replaced by a plain ``DataLoader`` (checked without ranks)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, TensorDataset

from lightning_pgc.codes import make_scheme
from lightning_pgc.strategy.loaders import partition_loader
from lightning_pgc.strategy.preflight import PGCUnsupportedError
from lightning_pgc.sampling import PartitionBatchSampler
from tests.loaders_job import BATCH, CASES, STEPS

ROOT = Path(__file__).resolve().parents[1]
STRATEGIES = ("ddp", "pgc")

#: case -> what its loader must run with under every strategy (besides matching ddp's)
EXPECTED_ARGS: dict[str, dict[str, Any]] = {
    "subclass": {"class": "TaggedLoader", "tag": "kept"},
    "generator": {"generator_seed": 7},
    "persistent_workers": {"num_workers": 1, "persistent_workers": True},
    "prefetch_factor": {"num_workers": 1, "prefetch_factor": 3, "in_order": False},
    "collate_fn": {"collate_fn": "pairs_to_dict"},
}
#: case -> the type ``training_step`` receives and its fields (beside matching ddp's)
EXPECTED_BATCH: dict[str, tuple[str, list[str]]] = {
    "collate_fn": ("dict", ["inputs", "targets"]),
    "namedtuple": ("Sample", ["x", "y"]),
    "dataclass": ("Batch", ["x", "y"]),
    "strings": ("dict", ["name", "x", "y"]),
}


@pytest.fixture(scope="module")
def runs(tmp_path_factory: pytest.TempPathFactory) -> dict[str, list[dict[str, Any]]]:
    """Each strategy's fit (one script, ranks forked): every rank's record."""
    out = tmp_path_factory.mktemp("loaders")
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")])}
    env.update(OMP_NUM_THREADS="1", PYTHONWARNINGS="ignore")
    for key in ("LOCAL_RANK", "NODE_RANK", "WORLD_SIZE", "GLOBAL_RANK", "RANK", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(key, None)
    command = [sys.executable, "-m", "tests.loaders_job", str(out), *STRATEGIES]
    proc = subprocess.run(command, cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, (proc.stdout + proc.stderr)[-8000:]
    return {name: [json.loads((out / name / f"rank{k}.json").read_text()) for k in range(2)] for name in STRATEGIES}


def test_every_case_reaches_training_step_as_under_ddp(runs: dict[str, list[dict[str, Any]]]) -> None:
    """Every rank's loaders match ddp's; so does every batch of every PGC rank that ran ``training_step`` (a rank
    may skip a step whose aggregate the other already published, as PGC lets a straggler)."""
    ddp, pgc = runs["ddp"], runs["pgc"]
    assert [r["batch_samplers"] for r in ddp] == [["BatchSampler"]] * 2  # ddp's sampler: DistributedSampler
    assert [r["batch_samplers"] for r in pgc] == [["PartitionBatchSampler"]] * 2
    assert [len(r["calls"]) for r in ddp] == [STEPS] * 2
    computed = [r for r in pgc if r["calls"]]
    assert max(c for r in computed for c in r["calls"]) > 1  # a step split its batch into partition chunks
    reference = ddp[0]
    for case in CASES:
        for rank in ddp + pgc:
            assert rank["loaders"][case] == reference["loaders"][case], case
        for rank in ddp + computed:
            assert rank["batches"][case] == reference["batches"][case], case
        found = [json.loads(text) for text in reference["batches"][case]]
        assert len(found) == 1, (case, found)  # one structure at every call
        for name, value in EXPECTED_ARGS.get(case, {}).items():
            assert reference["loaders"][case][name] == value, (case, name)
        if case in EXPECTED_BATCH:
            kind, fields = EXPECTED_BATCH[case]
            assert (found[0]["type"], sorted(found[0]["fields"])) == (kind, fields), case
    strings = json.loads(reference["batches"]["strings"][0])["fields"]["name"]
    assert strings == {"type": "list", "len": BATCH, "items": ['{"type": "str"}']}
    dataclass = json.loads(reference["batches"]["dataclass"][0])["fields"]["x"]
    assert dataclass == {"type": "Tensor", "dtype": "torch.float32", "shape": [BATCH, 3]}


# ------------------------------------------------------------------------------------------ without ranks
def _sampler(num_samples: int = 16, batch_size: int = 2) -> PartitionBatchSampler:
    return PartitionBatchSampler(num_samples, make_scheme("pgc_cr", 2, 1), rank=0, batch_size=batch_size)


def _data() -> TensorDataset:
    return TensorDataset(torch.arange(16.0).unsqueeze(1))


class Stored(DataLoader):
    """A subclass that keeps its own argument as an attribute: re-created from its attributes."""

    def __init__(self, dataset: Any, tag: str, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.tag = tag


class DropsBatchSampler(DataLoader):
    """A subclass that passes only its own batch size on: a batch sampler given to it is lost."""

    def __init__(self, dataset: Any, batch_size: int = 2, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=batch_size)


class OwnBatchSize(DataLoader):
    """A subclass whose own argument becomes DataLoader's ``batch_size``, beside ``**kwargs``."""

    def __init__(self, dataset: Any, size: int, **kwargs: Any) -> None:
        super().__init__(dataset, batch_size=size, **kwargs)
        self.size = size


class Closed(DataLoader):
    """A subclass without ``**kwargs`` nor ``batch_sampler``."""

    def __init__(self, dataset: Any, batch_size: int) -> None:
        super().__init__(dataset, batch_size=batch_size)


def test_a_loader_built_outside_a_hook_is_recreated_from_its_attributes() -> None:
    """As ``ddp`` re-creates a loader passed to ``fit``: its class and attributes, the batch sampler drawing."""
    generator = torch.Generator().manual_seed(3)
    loader = Stored(_data(), "t", batch_size=2, shuffle=True, generator=generator, num_workers=1, prefetch_factor=4)
    sampler = _sampler()
    rebuilt = partition_loader(loader, sampler)
    assert type(rebuilt) is Stored and rebuilt.tag == "t" and rebuilt.generator is generator
    assert (rebuilt.num_workers, rebuilt.prefetch_factor, rebuilt.batch_sampler) == (1, 4, sampler)
    rebuilt.num_workers = 0  # (no worker process in this test)
    first = next(iter(rebuilt))[0]
    assert first.squeeze(1).tolist() == [float(i) for i in next(iter(sampler))]


@pytest.mark.parametrize(
    ("loader", "match"),
    [
        (DropsBatchSampler(_data()), "draws its batches from a BatchSampler instead"),
        (OwnBatchSize(_data(), 2), "could not be re-created so .*batch_size"),
        (Closed(_data(), 2), "could not be re-created so .*doesn't expose all its attributes"),
    ],
    ids=["drops-batch_sampler", "own-batch_size", "no-kwargs"],
)
def test_a_loader_that_cannot_be_recreated_around_the_batch_sampler_is_refused(loader: DataLoader, match: str) -> None:
    with pytest.raises(PGCUnsupportedError, match=match):
        partition_loader(loader, _sampler())
