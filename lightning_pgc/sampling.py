"""Partition sampling: which mini-batch each rank evaluates at each step.

The training set is split into ``n`` partitions by a seeded permutation. Each partition has an
infinite, deterministic stream of indices, so every holder of partition ``i`` that evaluates it at
step ``t`` draws the *same* mini-batch: the gradients of different copies of a partition agree, as
gradient coding requires. Pure ``torch.utils.data`` and numpy: no Lightning, no ``torch.distributed``. The strategy
draws its training batches from it, the diagnostics their probe batches and the emulator its mini-batch streams.
"""

from __future__ import annotations

import copy
import dataclasses
import math
from collections import OrderedDict
from collections.abc import Iterator, Mapping, Sequence
from typing import Any, Callable, Optional, Protocol, cast

import numpy as np
import torch
from torch.utils.data import Sampler

__all__ = ["PartitionBatchSampler", "PartitionStreams", "select_partition", "split_batch", "split_partitions"]


def _check_int(name: str, value: Any, minimum: int) -> int:
    if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < minimum:
        raise ValueError(f"{name} must be an integer >= {minimum}, got {value!r}")
    return int(value)


def split_partitions(num_samples: int, n: int, seed: int) -> list[np.ndarray]:
    """Split ``range(num_samples)`` into ``n`` near-equal, disjoint partitions after a seeded shuffle."""
    num_samples = _check_int("num_samples", num_samples, 1)
    n = _check_int("n", n, 1)
    seed = _check_int("seed", seed, 0)
    if num_samples < n:
        raise ValueError(f"Cannot split {num_samples} samples into {n} non-empty partitions")
    perm = np.random.default_rng(seed).permutation(num_samples).astype(np.int64)
    return np.array_split(perm, n)


class PartitionStreams:
    """Infinite deterministic index streams, one per partition.

    Stream ``i`` is the concatenation of permutations of partition ``i``'s members; permutation ``p`` is
    drawn from ``default_rng([seed, i, p])``, so any process can compute any position of any stream.
    Recently used permutations are cached, so :meth:`batch` costs O(batch_size).
    """

    def __init__(self, num_samples: int, n: int, seed: int, cache_size: int = 64) -> None:
        self.num_samples = num_samples
        self.n = n
        self.seed = seed
        self.partitions = split_partitions(num_samples, n, seed)
        self._cache: OrderedDict[tuple[int, int], np.ndarray] = OrderedDict()
        self._cache_size = max(_check_int("cache_size", cache_size, 1), 2 * n)

    def permutation(self, i: int, p: int) -> np.ndarray:
        """The ``p``-th pass over partition ``i``: a permutation of its members."""
        key = (i, p)
        perm = self._cache.get(key)
        if perm is None:
            members = self.partitions[i]
            perm = members[np.random.default_rng([self.seed, i, p]).permutation(len(members))]
            self._cache[key] = perm
            if len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        else:
            self._cache.move_to_end(key)
        return perm

    def batch(self, i: int, step: int, batch_size: int) -> list[int]:
        """Positions ``[step * batch_size, (step + 1) * batch_size)`` of stream ``i``."""
        if isinstance(i, bool) or not isinstance(i, (int, np.integer)) or not 0 <= i < self.n:
            raise ValueError(f"partition must be in [0, {self.n}), got {i!r}")
        step = _check_int("step", step, 0)
        batch_size = _check_int("batch_size", batch_size, 1)
        size = len(self.partitions[i])
        start, end = step * batch_size, (step + 1) * batch_size
        out: list[int] = []
        for p in range(start // size, (end - 1) // size + 1):
            lo = max(start - p * size, 0)
            hi = min(end - p * size, size)
            out.extend(self.permutation(int(i), p)[lo:hi].tolist())
        return out


class SchemeLike(Protocol):
    """What the sampler needs from a coding scheme: ``n`` and the partitions a worker evaluates per step (``sampled``,
    optional: the partitions whose mini-batches it loads, when the choice among them is made at step time)."""

    n: int

    def evaluations(self, worker: int, step: int, start: int = 0) -> tuple[int, ...]: ...


def _zero() -> int:
    return 0


class PartitionBatchSampler(Sampler[list[int]]):
    """Batch sampler of one rank: at step ``t`` it yields the mini-batches of the partitions it evaluates.

    A scheme with ``sampled`` (bounded staleness with ``choice="oldest"``) decides which held partition a rank
    evaluates only at step time, after the loader prefetched: the sampler then yields the mini-batches of every
    partition ``sampled`` names, each still the stream's batch of that (partition, step), and the strategy
    computes one of them.

    The yielded index list is the concatenation of ``batch_size`` indices per evaluated partition (in
    :meth:`evaluations` order), so the collated batch splits into equal chunks with :func:`split_batch`.
    The step of position ``pos`` in an epoch is ``base_step() + pos``; ``base_step`` and ``warmup_step``
    are read once, when iteration starts, so a strategy can align the stream with its optimizer step.
    ``len`` equals the batch count of ``DistributedSampler`` with the same ``n`` and ``batch_size``.

    Args:
        num_samples: size of the training set.
        scheme: object with ``n`` and ``evaluations(worker, step, start=0)``.
        rank: the worker this sampler serves.
        batch_size: samples per partition evaluation.
        seed: seed of the partition split and the streams (must be equal on every rank).
        base_step: returns the step of the first batch of the epoch (e.g. the trainer's global step).
        warmup_step: returns the step where warm-up started, passed to ``evaluations(start=...)``.
    """

    def __init__(
        self,
        num_samples: int,
        scheme: SchemeLike,
        rank: int,
        batch_size: int,
        seed: int = 0,
        base_step: Callable[[], int] = _zero,
        warmup_step: Callable[[], int] = _zero,
    ) -> None:
        n = _check_int("scheme.n", getattr(scheme, "n", None), 1)
        if isinstance(rank, bool) or not isinstance(rank, (int, np.integer)) or not 0 <= rank < n:
            raise ValueError(f"rank must be in [0, {n}), got {rank!r}")
        self.num_samples = num_samples
        self.scheme = scheme
        self.rank = int(rank)
        self.batch_size = _check_int("batch_size", batch_size, 1)
        self.seed = seed
        self.base_step = base_step
        self.warmup_step = warmup_step
        self.epoch = 0
        self.streams = PartitionStreams(num_samples, n, seed)

    def __len__(self) -> int:
        return math.ceil(math.ceil(self.num_samples / self.scheme.n) / self.batch_size)

    def __iter__(self) -> Iterator[list[int]]:
        t0 = int(self.base_step())
        warmup = int(self.warmup_step())
        for pos in range(len(self)):
            step = t0 + pos
            indices: list[int] = []
            for i in self._partitions(step, warmup):
                indices.extend(self.streams.batch(i, step, self.batch_size))
            yield indices

    def _partitions(self, step: int, warmup: int) -> tuple[int, ...]:
        sampled = getattr(self.scheme, "sampled", None)
        if sampled is not None:
            return sampled(self.rank, step, start=warmup)
        return self.scheme.evaluations(self.rank, step, start=warmup)

    def set_epoch(self, epoch: int) -> None:
        """Record the epoch (Lightning calls this); the streams are indexed by step, not epoch."""
        self.epoch = epoch


def select_partition(batch: Any, partitions: Sequence[int], chosen: int, size: Optional[int] = None) -> Any:
    """The mini-batch of partition ``chosen`` out of a collated ``batch`` that holds the mini-batches of
    ``partitions``, in that order, ``size`` samples in all (what :class:`PartitionBatchSampler` yields when the
    scheme ``sampled`` more partitions than the rank computes).

    Raises:
        ValueError: ``chosen`` is not among ``partitions``, or the batch does not split (see :func:`split_batch`).
    """
    if chosen not in partitions:
        raise ValueError(f"partition {chosen} is not in this batch (it holds partitions {list(partitions)})")
    return split_batch(batch, len(partitions), size=size)[list(partitions).index(chosen)]


def split_batch(batch: Any, chunks: int, size: Optional[int] = None) -> list[Any]:
    """Split a collated batch of ``size`` samples into ``chunks`` batches of ``size // chunks`` samples each.

    Tensors are split along dim 0, which must be ``size``. A list or tuple of length ``size`` none of whose
    elements spans the batch (a ``list[str]``, a list of per-sample dicts), or a list of tensors of different
    shapes (variable-length samples), is a per-sample list and is sliced; other tuples, lists, named tuples,
    mappings and dataclass instances are containers and are split recursively (a dataclass's chunks are copies
    of it with every field split); any other leaf (a string, a number, ``None``) is repeated in every chunk.
    ``size`` defaults to the leading size of the first tensor found.

    Raises:
        ValueError: ``size`` is not divisible by ``chunks``, or a tensor's leading size is not ``size``.
    """
    chunks = _check_int("chunks", chunks, 1)
    if size is None:
        size = _first_leading_size(batch)
        if size is None:
            raise ValueError("Cannot split a batch with no tensor in it without its size")
    size = _check_int("size", size, 1)
    if size % chunks:
        raise ValueError(f"Cannot split a batch of {size} samples into {chunks} equal chunks")
    return _split(batch, chunks, size)


def _split(batch: Any, chunks: int, size: int) -> list[Any]:
    step = size // chunks
    if isinstance(batch, torch.Tensor):
        if batch.dim() == 0 or batch.shape[0] != size:
            found = "a scalar" if batch.dim() == 0 else f"leading size {batch.shape[0]}"
            raise ValueError(
                f"Cannot split a tensor with {found} by partition: every tensor of a batch of {size} samples must "
                f"have leading size {size} (keep per-sample data of other sizes in a list)"
            )
        return list(batch.split(step))
    if isinstance(batch, Mapping):
        parts = {k: _split(v, chunks, size) for k, v in batch.items()}
        return [_rebuild_mapping(batch, {k: v[c] for k, v in parts.items()}) for c in range(chunks)]
    if _is_dataclass(batch):
        parts_d = {f.name: _split(getattr(batch, f.name), chunks, size) for f in dataclasses.fields(batch)}
        return [_rebuild_dataclass(batch, {k: v[c] for k, v in parts_d.items()}) for c in range(chunks)]
    if isinstance(batch, tuple) and hasattr(batch, "_fields"):  # named tuple
        parts_t = [_split(v, chunks, size) for v in batch]
        return [type(batch)(*(p[c] for p in parts_t)) for c in range(chunks)]
    if isinstance(batch, (tuple, list)):
        if len(batch) == size and (_ragged(batch) or not any(_spans(v, size) for v in batch)):  # one per sample
            return [type(batch)(batch[c * step : (c + 1) * step]) for c in range(chunks)]
        parts_l = [_split(v, chunks, size) for v in batch]
        return [type(batch)(p[c] for p in parts_l) for c in range(chunks)]
    return [batch for _ in range(chunks)]


def _spans(value: Any, size: int) -> bool:
    """Whether ``value`` holds data for the whole batch (so the sequence holding it is a container, not a sample)."""
    if isinstance(value, torch.Tensor):
        return value.dim() > 0 and value.shape[0] == size
    if isinstance(value, Mapping):
        return any(_spans(v, size) for v in value.values())
    if _is_dataclass(value):
        return any(_spans(getattr(value, f.name), size) for f in dataclasses.fields(value))
    if isinstance(value, (tuple, list)):
        return len(value) == size or any(_spans(v, size) for v in value)
    return False


def _ragged(values: Sequence[Any]) -> bool:
    """A sequence of tensors of different shapes: variable-length samples, never a container of batch tensors."""
    return all(isinstance(v, torch.Tensor) for v in values) and len({tuple(v.shape) for v in values}) > 1


def _first_leading_size(batch: Any) -> Optional[int]:
    if isinstance(batch, torch.Tensor):
        return int(batch.shape[0]) if batch.dim() > 0 else None
    if _is_dataclass(batch):
        values: Any = [getattr(batch, f.name) for f in dataclasses.fields(batch)]
    else:
        values = batch.values() if isinstance(batch, Mapping) else batch if isinstance(batch, (tuple, list)) else ()
    for v in values:
        found = _first_leading_size(v)
        if found is not None:
            return found
    return None


def _rebuild_mapping(template: Mapping[Any, Any], items: dict[Any, Any]) -> Mapping[Any, Any]:
    """A mapping of ``template``'s class holding ``items``, or ``items`` itself where that class is not built from a
    dict (``Mapping`` declares no constructor: the concrete classes, ``dict`` and ``OrderedDict`` say, take one)."""
    rebuild = cast(Callable[[dict[Any, Any]], Mapping[Any, Any]], type(template))
    try:
        return rebuild(items)
    except TypeError:
        return items


def _is_dataclass(value: Any) -> bool:
    """A dataclass instance (not a dataclass type)."""
    return dataclasses.is_dataclass(value) and not isinstance(value, type)


def _rebuild_dataclass(template: Any, fields: dict[str, Any]) -> Any:
    """A shallow copy of ``template`` with ``fields`` set (``object.__setattr__``: frozen dataclasses too)."""
    chunk = copy.copy(template)
    for name, value in fields.items():
        object.__setattr__(chunk, name, value)
    return chunk
