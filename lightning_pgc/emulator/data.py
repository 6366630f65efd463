"""Data conditions of the emulator: which training samples each of the ``n`` partitions holds.

``iid``: the runtime's own split (:func:`lightning_pgc.sampling.split_partitions`, a seeded shuffle cut in ``n`` near-equal
parts), so partitions are identical in distribution. ``dirichlet``: a label-skewed split; for every class the
shares of the ``n`` partitions are drawn from ``Dirichlet(alpha * 1_n)`` and the class's samples are dealt out in
those shares. Small ``alpha`` (0.1) gives each partition one or two dominant labels, large ``alpha`` tends to iid.
Every partition keeps at least one sample. Pure numpy; the mini-batch streams over the partitions are the
runtime's :class:`~lightning_pgc.sampling.PartitionStreams` (one deterministic stream per partition).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np

from lightning_pgc.sampling import PartitionStreams, split_partitions

__all__ = ["DataCondition", "dirichlet_partitions", "label_skew", "partition_streams"]


@dataclass(frozen=True)
class DataCondition:
    """How the training set is split over partitions: ``kind`` ``"iid"`` or ``"dirichlet"`` (with ``alpha``)."""

    kind: str = "iid"
    alpha: float = 0.1

    def __post_init__(self) -> None:
        if self.kind not in ("iid", "dirichlet"):
            raise ValueError(f"data condition must be 'iid' or 'dirichlet', got {self.kind!r}")
        if not (isinstance(self.alpha, (int, float)) and math.isfinite(self.alpha) and self.alpha > 0):
            raise ValueError(f"dirichlet concentration alpha must be a finite number > 0, got {self.alpha!r}")

    @property
    def label(self) -> str:
        """``iid`` or ``dirichlet(alpha=...)`` (what records and tables show)."""
        return "iid" if self.kind == "iid" else f"dirichlet(alpha={self.alpha:g})"

    def partitions(self, labels: np.ndarray, n: int, seed: int) -> list[np.ndarray]:
        """The members (sample indices) of each of the ``n`` partitions."""
        if self.kind == "iid":
            return split_partitions(len(labels), n, seed)
        return dirichlet_partitions(labels, n, self.alpha, seed)


def dirichlet_partitions(labels: np.ndarray, n: int, alpha: float, seed: int) -> list[np.ndarray]:
    """Split sample indices into ``n`` label-skewed partitions (``Dirichlet(alpha)`` shares per class).

    Deterministic in ``seed``; every index lands in exactly one partition; every partition is non-empty (a sample
    is moved from the largest partition into any empty one).

    Raises:
        ValueError: fewer samples than partitions, ``n < 1`` or ``alpha <= 0``.
    """
    labels = np.asarray(labels)
    if n < 1:
        raise ValueError(f"n must be >= 1, got {n}")
    if len(labels) < n:
        raise ValueError(f"cannot split {len(labels)} samples into {n} non-empty partitions")
    if not alpha > 0:
        raise ValueError(f"alpha must be > 0, got {alpha}")
    rng = np.random.default_rng([int(seed), 7919])
    parts: list[list[int]] = [[] for _ in range(n)]
    for cls in np.unique(labels):
        members = np.flatnonzero(labels == cls)
        members = members[rng.permutation(len(members))]
        shares = rng.dirichlet(np.full(n, float(alpha)))
        cuts = np.floor(np.cumsum(shares)[:-1] * len(members)).astype(np.int64)
        for i, chunk in enumerate(np.split(members, cuts)):
            parts[i].extend(chunk.tolist())
    for i in range(n):
        if not parts[i]:
            donor = max(range(n), key=lambda j: len(parts[j]))
            parts[i].append(parts[donor].pop())
    return [np.sort(np.asarray(p, dtype=np.int64)) for p in parts]


def label_skew(labels: np.ndarray, partitions: list[np.ndarray], classes: int) -> float:
    """Mean total-variation distance between each partition's label histogram and the whole set's (0: iid-like,
    near 1: each partition holds labels the others do not)."""
    labels = np.asarray(labels)
    overall = np.bincount(labels, minlength=classes) / len(labels)
    tv = [0.5 * np.abs(np.bincount(labels[p], minlength=classes) / len(p) - overall).sum() for p in partitions]
    return float(np.mean(tv))


def partition_streams(labels: np.ndarray, n: int, seed: int, condition: DataCondition) -> PartitionStreams:
    """The runtime's per-partition mini-batch streams over ``condition``'s partitions (iid: exactly the streams a
    real run with strategy seed ``seed`` draws)."""
    streams = PartitionStreams(len(labels), n, seed)
    if condition.kind != "iid":
        streams.partitions = condition.partitions(labels, n, seed)
    return streams
