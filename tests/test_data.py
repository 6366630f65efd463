import dataclasses
import math
from collections import namedtuple

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler, TensorDataset

from lightning_pgc.codes import BoundedScheme
from lightning_pgc.sampling import (
    PartitionBatchSampler,
    PartitionStreams,
    select_partition,
    split_batch,
    split_partitions,
)


class FakeScheme:
    """Worker k evaluates partitions (k, k+1) at the warm-up step and k+step afterwards (mod n)."""

    def __init__(self, n: int, warmup_evals: int = 2):
        self.n = n
        self.warmup_evals = warmup_evals
        self.calls = []

    def evaluations(self, worker: int, step: int, start: int = 0) -> tuple[int, ...]:
        self.calls.append((worker, step, start))
        if step == start:
            return tuple((worker + j) % self.n for j in range(self.warmup_evals))
        return ((worker + step) % self.n,)


@pytest.mark.parametrize("num_samples,n", [(10, 1), (100, 4), (101, 4), (1797, 7), (5, 5)])
def test_partitions_disjoint_cover_near_equal(num_samples, n):
    parts = split_partitions(num_samples, n, seed=0)
    assert len(parts) == n
    everything = np.concatenate(parts)
    assert sorted(everything.tolist()) == list(range(num_samples))
    sizes = [len(p) for p in parts]
    assert max(sizes) - min(sizes) <= 1


def test_partitions_deterministic_per_seed():
    a = split_partitions(1000, 5, seed=3)
    b = split_partitions(1000, 5, seed=3)
    c = split_partitions(1000, 5, seed=4)
    assert all(np.array_equal(x, y) for x, y in zip(a, b))
    assert not all(np.array_equal(x, y) for x, y in zip(a, c))


def test_partitions_validate():
    with pytest.raises(ValueError):
        split_partitions(3, 4, seed=0)
    with pytest.raises(ValueError):
        split_partitions(10, 0, seed=0)


@pytest.mark.parametrize("batch_size", [1, 4, 7, 25, 60])
def test_stream_gives_every_member_once_per_pass(batch_size):
    streams = PartitionStreams(100, 4, seed=1)
    size = len(streams.partitions[2])  # 25
    passes = 3
    steps = math.ceil(passes * size / batch_size)
    stream = [x for t in range(steps) for x in streams.batch(2, t, batch_size)]
    assert all(len(streams.batch(2, t, batch_size)) == batch_size for t in range(steps))
    members = sorted(streams.partitions[2].tolist())
    for p in range(passes):
        assert sorted(stream[p * size : (p + 1) * size]) == members
    # consecutive passes are different permutations
    assert stream[:size] != stream[size : 2 * size]


def test_stream_partition_smaller_than_batch():
    streams = PartitionStreams(9, 3, seed=0)  # partitions of 3
    batch = streams.batch(1, 5, 8)
    assert len(batch) == 8 and set(batch) <= set(streams.partitions[1].tolist())


def test_same_partition_and_step_same_batch():
    # Every holder builds its own streams object (a different process in practice).
    holders = [PartitionStreams(1000, 5, seed=7) for _ in range(3)]
    for i in range(5):
        for t in (0, 1, 17, 1000):
            batches = [h.batch(i, t, 16) for h in holders]
            assert batches[0] == batches[1] == batches[2]
    # order of queries (and cache state) does not matter
    fresh = PartitionStreams(1000, 5, seed=7)
    assert fresh.batch(3, 1000, 16) == holders[0].batch(3, 1000, 16)
    assert PartitionStreams(1000, 5, seed=8).batch(3, 0, 16) != holders[0].batch(3, 0, 16)


def test_batches_stay_inside_partition():
    streams = PartitionStreams(200, 4, seed=0)
    for i in range(4):
        members = set(streams.partitions[i].tolist())
        for t in range(10):
            assert set(streams.batch(i, t, 8)) <= members


def test_sampler_chunks_and_base_step():
    scheme = FakeScheme(n=4)
    base = {"step": 10}
    sampler = PartitionBatchSampler(
        100, scheme, rank=1, batch_size=5, seed=0, base_step=lambda: base["step"], warmup_step=lambda: 10
    )
    assert len(sampler) == math.ceil(25 / 5)
    it = iter(sampler)
    base["step"] = 999  # read lazily at the first next(), and only once
    first = next(it)
    rest = list(it)
    streams = PartitionStreams(100, 4, seed=0)
    assert first == streams.batch((1 + 999) % 4, 999, 5)  # step 999 is past warm-up: one partition
    batches = [first] + rest
    assert len(batches) == len(sampler)
    steps = [999 + pos for pos in range(len(sampler))]
    assert [c[1] for c in scheme.calls] == steps
    assert all(c[0] == 1 and c[2] == 10 for c in scheme.calls)
    for t, batch in zip(steps, batches):
        evals = scheme.evaluations(1, t, start=10)
        assert batch == [x for i in evals for x in streams.batch(i, t, 5)]


def test_sampler_varying_evaluation_counts():
    scheme = FakeScheme(n=4, warmup_evals=2)
    sampler = PartitionBatchSampler(100, scheme, rank=3, batch_size=5, seed=2, base_step=lambda: 0)
    batches = list(sampler)
    streams = PartitionStreams(100, 4, seed=2)
    assert [len(b) for b in batches] == [10, 5, 5, 5, 5]
    assert batches[0] == streams.batch(3, 0, 5) + streams.batch(0, 0, 5)
    assert batches[1] == streams.batch((3 + 1) % 4, 1, 5)
    # the next epoch continues the stream from its new base step
    sampler.base_step = lambda: len(batches)
    sampler.set_epoch(1)
    assert sampler.epoch == 1
    nxt = list(sampler)
    assert nxt[0] == streams.batch((3 + 5) % 4, 5, 5)


def test_sampler_holders_agree():
    # ranks 0 and 1 both hold partition 1; when they evaluate it at the same step they get the same batch
    class Both:
        n = 4

        def evaluations(self, worker, step, start=0):
            return (1,)

    a = list(PartitionBatchSampler(400, Both(), rank=0, batch_size=8, seed=5))
    b = list(PartitionBatchSampler(400, Both(), rank=1, batch_size=8, seed=5))
    assert a == b


def test_sampler_validates():
    with pytest.raises(ValueError):
        PartitionBatchSampler(100, FakeScheme(4), rank=4, batch_size=5)
    with pytest.raises(ValueError):
        PartitionBatchSampler(100, FakeScheme(4), rank=0, batch_size=0)


@pytest.mark.parametrize("num_samples,n,batch_size", [(100, 4, 5), (101, 4, 5), (1797, 7, 32), (10, 3, 64), (64, 8, 1)])
def test_len_matches_distributed_sampler(num_samples, n, batch_size):
    dataset = TensorDataset(torch.arange(num_samples))
    ddp_batches = {
        math.ceil(len(DistributedSampler(dataset, num_replicas=n, rank=r, shuffle=True)) / batch_size) for r in range(n)
    }
    assert len(ddp_batches) == 1
    lengths = {len(PartitionBatchSampler(num_samples, FakeScheme(n), rank=r, batch_size=batch_size)) for r in range(n)}
    assert lengths == ddp_batches


def test_dataloader_collates_and_split_batch_recovers_chunks():
    num_samples, batch_size = 120, 4
    x = torch.arange(num_samples, dtype=torch.float32).unsqueeze(1).repeat(1, 3)
    y = torch.arange(num_samples)
    scheme = FakeScheme(n=4, warmup_evals=3)
    sampler = PartitionBatchSampler(num_samples, scheme, rank=2, batch_size=batch_size, seed=9)
    loader = DataLoader(TensorDataset(x, y), batch_sampler=sampler)
    streams = PartitionStreams(num_samples, 4, seed=9)
    batches = list(loader)
    assert len(batches) == len(sampler) == len(loader)
    for t, (bx, by) in enumerate(batches):
        evals = scheme.evaluations(2, t)
        assert bx.shape == (len(evals) * batch_size, 3)
        chunks = split_batch([bx, by], len(evals))
        assert len(chunks) == len(evals)
        for i, (cx, cy) in zip(evals, chunks):
            expected = torch.tensor(streams.batch(i, t, batch_size))
            assert torch.equal(cy, expected)
            assert torch.equal(cx, x[expected])


def test_oldest_choice_loader_yields_every_held_batch_and_the_chosen_one_is_the_streams_batch():
    """Bounded staleness with choice="oldest": the loader (which prefetches) yields the mini-batches of all r held
    partitions per step; whichever partition the rank then computes, its chunk is the stream's batch of that
    (partition, step), the same one a round-robin rank (or the other holder) gets for it."""
    num_samples, batch_size, n, r = 120, 4, 4, 3
    x = torch.arange(num_samples, dtype=torch.float32).unsqueeze(1)
    y = torch.arange(num_samples)
    oldest, rr = BoundedScheme(n, r, 2, choice="oldest"), BoundedScheme(n, r, 2)
    streams = PartitionStreams(num_samples, n, seed=3)
    for rank in range(n):
        held = oldest.partitions(rank)
        loader = DataLoader(
            TensorDataset(x, y),
            batch_sampler=PartitionBatchSampler(
                num_samples, oldest, rank=rank, batch_size=batch_size, seed=3, base_step=lambda: 7
            ),
        )
        rr_batches = list(
            PartitionBatchSampler(num_samples, rr, rank=rank, batch_size=batch_size, seed=3, base_step=lambda: 7)
        )
        for pos, (bx, by) in enumerate(loader):
            t = 7 + pos
            assert by.shape == (r * batch_size,)
            for p in held:
                cx, cy = select_partition([bx, by], held, p, size=r * batch_size)
                assert cy.tolist() == streams.batch(p, t, batch_size) and torch.equal(cx, x[cy])
            p_rr = rr.evaluated(rank, t)
            assert select_partition(by, held, p_rr).tolist() == rr_batches[pos]
    with pytest.raises(ValueError, match="partition 3 is not in this batch"):
        select_partition(torch.arange(8), (0, 1), 3)


def test_split_batch_nested():
    Pair = namedtuple("Pair", "a b")
    batch = {"x": torch.arange(12).view(6, 2), "meta": "tag", "pair": Pair(torch.arange(6), (torch.ones(6, 1), 3))}
    chunks = split_batch(batch, 3)
    assert len(chunks) == 3
    for c, chunk in enumerate(chunks):
        assert torch.equal(chunk["x"], torch.arange(12).view(6, 2)[2 * c : 2 * c + 2])
        assert chunk["meta"] == "tag"
        assert isinstance(chunk["pair"], Pair)
        assert torch.equal(chunk["pair"].a, torch.arange(2 * c, 2 * c + 2))
        assert chunk["pair"].b[0].shape == (2, 1) and chunk["pair"].b[1] == 3
    assert len(split_batch(torch.zeros(5), 1)) == 1


def test_split_batch_errors():
    with pytest.raises(ValueError, match="not|Cannot"):
        split_batch(torch.zeros(7, 2), 2)
    with pytest.raises(ValueError):
        split_batch((torch.zeros(6), torch.zeros(5)), 3)
    with pytest.raises(ValueError):
        split_batch(torch.zeros(4), 0)


def test_split_batch_slices_per_sample_lists_and_refuses_ragged_tensors():
    """A ``list[str]`` and a list of variable-length tensors are one entry per sample: each chunk gets its own
    samples' entries (not all strings, not each tensor cut along its own length)."""
    ids = torch.arange(4)
    batch = {
        "x": ids.float().unsqueeze(1),
        "names": [f"s{i}" for i in range(4)],
        "seqs": [torch.full((i + 1,), i) for i in range(4)],
        "pair": [ids, [f"p{i}" for i in range(4)]],
    }
    first, second = split_batch(batch, 2, size=4)
    assert first["names"] == ["s0", "s1"] and second["names"] == ["s2", "s3"]
    assert [s.tolist() for s in second["seqs"]] == [[2, 2, 2], [3, 3, 3, 3]]
    assert torch.equal(second["pair"][0], ids[2:]) and second["pair"][1] == ["p2", "p3"]
    assert torch.equal(first["x"], ids[:2].float().unsqueeze(1))
    # a tensor that is not per-sample is refused, not cut along its own first dimension
    with pytest.raises(ValueError, match="leading size 3"):
        split_batch({"x": torch.zeros(4, 1), "table": torch.zeros(3)}, 2)


def test_split_batch_splits_dataclass_batches_field_by_field():
    """A dataclass batch (a custom ``collate_fn``'s) is a container: every chunk is a copy of it, frozen ones too,
    with each field split (fields left out of ``__init__`` included) and its other leaves kept."""

    @dataclasses.dataclass(frozen=True)
    class Batch:
        x: torch.Tensor
        names: list
        tag: str = "t"
        ids: torch.Tensor = dataclasses.field(init=False, default_factory=lambda: torch.arange(4))

    first, second = split_batch(Batch(torch.arange(8).view(4, 2), ["a", "b", "c", "d"]), 2)
    assert type(first) is Batch and type(second) is Batch
    assert torch.equal(second.x, torch.tensor([[4, 5], [6, 7]])) and second.names == ["c", "d"]
    assert torch.equal(second.ids, torch.tensor([2, 3])) and second.tag == "t"
    assert select_partition(Batch(torch.zeros(4, 1), list("abcd")), (3, 5), 5).names == ["c", "d"]
