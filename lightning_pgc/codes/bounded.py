"""Bounded-staleness aggregation (the bounded-staleness coordinator's table): pure math, no Lightning, no torch.distributed.

Each of ``n`` ranks holds ``r`` partitions (cyclic placement), evaluates ONE of them per step at its model version
and sends that gradient uncoded. A table keeps the newest ``(rank, version)`` per partition; version ``t`` closes
when every partition has an entry with ``t - v_i < c``, and the aggregate is ``sum_i w_i g_i`` with ``w_i = 1/n``
(or proportional to partition sizes). ``r`` (replication) and ``c`` (staleness window) are independent.
See ``docs/results/bounded_staleness.md``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Iterable, Mapping, Optional, Sequence

import torch
from torch import Tensor

from .placements import CRPlacement, Placement
from .schemes import Scheme, _as_int

__all__ = [
    "CHOICES",
    "BoundedScheme",
    "CoverageTable",
    "Entry",
    "adapt_step",
    "choose_partition",
    "error_decomposition",
]

#: How a rank picks the held partition it evaluates (``BoundedScheme(choice=...)``).
CHOICES: tuple[str, ...] = ("round_robin", "oldest")
#: Most partitions whose table ages an aggregate header carries (4 bits each in one int64 word).
MAX_TABLE_PARTITIONS = 16


def choose_partition(
    held: Sequence[int], step: int, ages: Optional[Sequence[int]], own: Optional[Mapping[int, int]] = None
) -> int:
    """The held partition a rank evaluates at ``step`` under ``choice="oldest"``.

    ``held``: the rank's partitions in placement order. ``ages``: ``(step - 1) - v_i`` of every partition's table
    entry when ``step - 1`` closed (None: unknown, e.g. the first step of a fit or after a rejoin). ``own``: the
    last version this rank *chose* each partition, whether its code was sent, late or never computed (a version
    the rank skipped because it was already closed). Counting late codes keeps a rank whose code missed the close
    from evaluating that partition again next to its other holder; counting skipped choices keeps a rank that
    skipped a version in step with the others (it would otherwise pick the partition it skipped, which its other
    holder picks too, and stay out of phase). The rank takes the held partition with the largest age; ties (and
    unknown ages) go to the held order rotated by ``step``, so with equal ages it is round robin
    (``held[step % r]``) and the ranks' choices cover every partition once.
    """
    r = len(held)
    if r == 0:
        raise ValueError("choose_partition needs at least one held partition")
    order = [held[(step + j) % r] for j in range(r)]
    if ages is None:
        return order[0]
    own = own or {}

    def age(i: int) -> int:
        mine = own.get(i)
        return ages[i] if mine is None else min(ages[i], step - 1 - mine)

    return max(order, key=age)  # max keeps the first of equal keys: the rotation breaks ties


class BoundedScheme(Scheme):
    """Cyclic placement with replication ``r``, one fresh uncoded partition gradient per rank and step.

    Decoding is keyed by *partition* (not rank): ``decode({i: g_i for every i})`` is ``sum_i w_i g_i``.

    Args:
        n: ranks (= partitions).
        replication: ``r``, copies of each partition (rank ``k`` holds ``k, ..., k+r-1 mod n``).
        staleness: ``c``, the window: version ``t`` uses only entries with ``t - v_i < c``.
        fresh: codes of the open version the leader waits for before closing it (besides coverage); default
            ``n - r + 1`` (as many as pgc_cr with ``s = r - 1``). 1 steps as soon as the fastest rank reports.
        partition_sizes: weight partitions by these sizes instead of ``1/n`` each.
        choice: which held partition a rank evaluates: ``"round_robin"`` (held position ``t mod r``) or
            ``"oldest"`` (the one whose table entry is oldest at the close of ``t - 1``, ties by round robin; see
            :func:`choose_partition`). Under ``"oldest"`` a rank samples the mini-batches of all its held partitions
            (:meth:`sampled`) and computes the one :meth:`choose` names.
    """

    name = "bounded"
    reuses_codes = True

    def __init__(
        self,
        n: int,
        replication: int = 2,
        staleness: int = 2,
        *,
        fresh: Optional[int] = None,
        partition_sizes: Optional[Sequence[int]] = None,
        choice: str = "round_robin",
        seed: int = 0,
    ) -> None:
        replication = _as_int(replication, "replication")
        staleness = _as_int(staleness, "staleness")
        if replication < 1:
            raise ValueError(f"bounded: replication must be >= 1, got {replication}")
        if staleness < 1:
            raise ValueError(
                f"bounded: staleness c must be >= 1 (c = 1 uses only gradients of the current version), got {staleness}"
            )
        if choice not in CHOICES:
            raise ValueError(f"bounded: choice must be one of {CHOICES}, got {choice!r}")
        super().__init__(n, replication - 1, seed=seed)
        if choice == "oldest" and self.n > MAX_TABLE_PARTITIONS:
            raise ValueError(
                f"bounded: choice='oldest' carries the table's ages in the aggregate header, which has "
                f"room for {MAX_TABLE_PARTITIONS} partitions; n = {self.n}: use choice='round_robin'"
            )
        self.replication = replication
        self.choice = choice
        self.window = staleness  # current c; lowered by StalenessValve(action="window"), identical on every rank
        if fresh is not None:
            fresh = _as_int(fresh, "fresh")
            if not 1 <= fresh <= self.n:
                raise ValueError(f"bounded: fresh must be in [1, n={self.n}], got {fresh}")
            self.wait_for = fresh
        if partition_sizes is None:
            self.partition_weights = [1.0 / self.n] * self.n
        else:
            sizes = [float(x) for x in partition_sizes]
            if len(sizes) != self.n or any(not math.isfinite(x) or x < 0 for x in sizes) or sum(sizes) <= 0:
                raise ValueError(
                    f"bounded: partition_sizes must be {self.n} non-negative numbers with a positive "
                    f"sum, got {partition_sizes!r}"
                )
            total = sum(sizes)
            self.partition_weights = [x / total for x in sizes]

    def _make_placement(self) -> Placement:
        return CRPlacement(self.n, self.s + 1)

    @property
    def max_staleness(self) -> int:
        """Largest age of an entry in an aggregate under the current window: ``c - 1``."""
        return self.window - 1

    @property
    def cache_max_age(self) -> int | None:
        """1: a rank keeps only its fresh gradient (the table lives with the shard owners)."""
        return 1

    def evaluations(self, worker: int, step: int, start: int = 0) -> tuple[int, ...]:
        """Round robin: held position ``step % r``; every partition is evaluated once per step when all report."""
        self.placement.check_worker(worker)
        step, start = self._check_step(step, start)
        return (self.partitions(worker)[step % self.replication],)

    def evaluated(self, worker: int, version: int) -> int:
        """The partition ``worker``'s code for ``version`` carries under round robin."""
        return self.evaluations(worker, version)[0]

    def sampled(self, worker: int, step: int, start: int = 0) -> tuple[int, ...]:
        """The partitions whose mini-batches the data loader yields for ``step``: every held one under
        ``"oldest"`` (the loader prefetches before the choice is known), else :meth:`evaluations`."""
        if self.choice == "oldest":
            self.placement.check_worker(worker)
            return self.partitions(worker)
        return self.evaluations(worker, step, start)

    def choose(
        self, worker: int, step: int, ages: Optional[Sequence[int]] = None, own: Optional[Mapping[int, int]] = None
    ) -> tuple[int, ...]:
        """The partition ``worker`` evaluates at ``step``: :meth:`evaluations` under round robin; under
        ``"oldest"`` :func:`choose_partition` with the table ``ages`` at the close of ``step - 1`` (None: unknown)
        and ``own``, the last version ``worker`` chose each partition (see :func:`choose_partition`).

        Raises:
            ValueError: ``ages`` does not have one entry per partition.
        """
        if self.choice != "oldest":
            return self.evaluations(worker, step)
        if ages is not None and len(ages) != self.n:
            raise ValueError(f"bounded: need the ages of all {self.n} partitions, got {len(ages)}")
        self.placement.check_worker(worker)
        return (choose_partition(self.partitions(worker), step, ages, own),)

    def _copy_weights(self, worker: int) -> dict[int, float]:
        return {j: 1.0 for j in self.partitions(worker)}

    def code_coefficients(self, worker: int, present: Sequence[int]) -> dict[int, float]:
        """The single fresh gradient, uncoded.

        Raises:
            ValueError: not exactly one held partition given.
        """
        if len(present) != 1:
            raise ValueError(f"bounded: a code carries exactly one partition gradient, got {list(present)}")
        return {present[0]: 1.0}

    def admits(self, received: Iterable[int]) -> bool:
        """Whether the *partitions* ``received`` cover every partition."""
        return set(self._check_received(set(received))) == set(range(self.n))

    def decoding_weights(self, received: Sequence[int]) -> dict[int, float]:
        """``w_i`` of every received partition. Without some partitions (a version the leader closed although one
        could not be covered, :class:`~lightning_pgc.decisions.bounded.BoundedLeader`) the others are averaged:
        ``w_i / sum_j w_j`` over the received ``j``.

        Raises:
            ValueError: no partition (or only partitions of weight 0), or one twice.
        """
        parts = self._check_received(received)
        if set(parts) == set(range(self.n)):
            return self._weights(parts)
        total = math.fsum(self.partition_weights[i] for i in parts)
        if total <= 0:
            raise ValueError(f"bounded: cannot decode from partitions {sorted(parts)}: their weight is 0")
        return {i: self.partition_weights[i] / total for i in parts}

    def _weights(self, ranks: list[int]) -> dict[int, float]:
        return {i: self.partition_weights[i] for i in ranks}

    def __repr__(self) -> str:
        return (
            f"BoundedScheme(n={self.n}, replication={self.replication}, staleness={self.window}, "
            f"fresh={self.wait_for}" + ("" if self.choice == "round_robin" else f", choice={self.choice!r}") + ")"
        )


@dataclass(frozen=True)
class Entry:
    """A table entry: ``rank``'s gradient of the partition, computed at model ``version``."""

    rank: int
    version: int


class CoverageTable:
    """The coordinator's table: newest entry per partition and the coverage rule ``t - v_i < c``.

    Replacement keeps the newest version; on a tie the first arrival stays (a later equal version changes nothing).
    """

    def __init__(self, n: int) -> None:
        if n < 1:
            raise ValueError(f"CoverageTable needs n >= 1 partitions, got {n}")
        self.n = n
        self.entries: list[Optional[Entry]] = [None] * n

    def offer(self, partition: int, rank: int, version: int) -> bool:
        """Keep ``(rank, version)`` for ``partition`` if it is newer than the entry there; True if it replaced."""
        old = self.entries[partition]
        if old is not None and version <= old.version:
            return False
        self.entries[partition] = Entry(rank, version)
        return True

    def ages(self, t: int) -> list[Optional[int]]:
        """``t - v_i`` per partition (None: no entry yet).

        Raises:
            ValueError: an entry newer than ``t`` (versions out of step).
        """
        out: list[Optional[int]] = []
        for i, e in enumerate(self.entries):
            if e is not None and e.version > t:
                raise ValueError(f"partition {i} has an entry of version {e.version}, newer than version {t}")
            out.append(None if e is None else t - e.version)
        return out

    def missing(self, t: int, window: int) -> list[int]:
        """Partitions without an entry younger than ``window`` at version ``t`` (empty: ``t`` may close)."""
        return [i for i, a in enumerate(self.ages(t)) if a is None or a >= window]

    def decision(self, t: int, window: int) -> tuple[Entry, ...]:
        """The entry of every partition for version ``t``.

        Raises:
            ValueError: coverage fails (some partition has no entry younger than ``window``).
        """
        missing = self.missing(t, window)
        if missing:
            raise ValueError(f"version {t} is not covered with c={window}: partitions {missing} lack an entry")
        return tuple(e for e in self.entries if e is not None)


def adapt_step(
    ratio: float,
    *,
    threshold: float,
    recover_below: Optional[float],
    value: float,
    factor: float,
    lowest: float,
    highest: float,
) -> float:
    """The staleness valve's decision for one controlled quantity (the ``lr`` scale or the window ``c``).

    When ``ratio = L_hat^2 displacement / |g_hat|^2`` exceeds ``threshold``, lower ``value`` (no lower than
    ``lowest``); when it is below ``recover_below``, raise it back (no higher than ``highest``). ``factor > 0``
    multiplies (learning rate), ``factor < 0`` adds (window: ``-1`` lowers ``c`` by one). Pure and deterministic,
    so every rank with the same inputs takes the same decision without a collective.
    """
    if ratio > threshold:
        new = value * factor if factor > 0 else value + factor
        return max(new, lowest)
    if recover_below is not None and ratio < recover_below:
        new = value / factor if factor > 0 else value - factor
        return min(new, highest)
    return value


def error_decomposition(
    grad_now: Tensor,
    grad_at: Mapping[int, Tensor],
    versions: Sequence[int],
    weights: Sequence[float],
    aggregate: Tensor,
    params_now: Optional[Tensor] = None,
    params_at: Optional[Mapping[int, Tensor]] = None,
    scale: float = 1.0,
) -> dict[str, float]:
    """The bounded-staleness method's error decomposition of one aggregate, with the cross terms it drops (float64).

    Every vector may be the same uniform sample of ``k`` of the ``N`` coordinates instead: with ``scale = N / k``
    each inner product is estimated as ``scale`` times the sample's (unbiased; the identities below hold exactly on
    the estimates, and the cosines do not depend on ``scale``).

    With ``a = grad F(beta_t)`` (``grad_now``), ``m = sum_i w_i grad F(beta_{s(t,i)})`` (``grad_at[v]`` is
    ``grad F`` at version ``v``; ``versions[i] = s(t,i)``) and ``g = g_hat`` (``aggregate``):

    - ``total = |a - g|^2 = staleness + noise + cross`` exactly, with ``staleness = |a - m|^2``,
      ``noise = |m - g|^2`` and ``cross = -2 <a - m, g - m>``;
    - the method's stated Lemma 1 reads ``card_rhs = |a - m|^2 - |m|^2 + |g|^2``; ``card_gap = total - card_rhs =
      -2 <a, g - m>``, zero only in expectation and only if ``E[g | s] = m``;
    - ``staleness_mean = sum_i w_i |a - grad F(beta_{s(t,i)})|^2`` (the method's per-partition staleness term) and,
      given parameters, ``displacement = sum_i w_i |beta_t - beta_{s(t,i)}|^2`` (its Lipschitz bound is
      ``L^2 displacement``);
    - ``cos_min`` / ``cos_mean``: cosine between ``a`` and the stale gradients (oldest / weighted mean).
    """
    a = grad_now.to(torch.float64).reshape(-1)
    g = aggregate.to(torch.float64).reshape(-1)
    at = {v: t.to(torch.float64).reshape(-1) for v, t in grad_at.items()}
    m = torch.zeros_like(a)
    for v, w in zip(versions, weights):
        m.add_(at[v], alpha=float(w))
    dot = lambda x, y: scale * float(torch.dot(x, y))  # noqa: E731
    staleness, noise = dot(a - m, a - m), dot(m - g, m - g)
    out = {"total": dot(a - g, a - g), "staleness": staleness, "noise": noise, "cross": -2.0 * dot(a - m, g - m)}
    out["card_rhs"] = staleness - dot(m, m) + dot(g, g)
    out["card_gap"] = out["total"] - out["card_rhs"]
    out["staleness_mean"] = sum(float(w) * dot(a - at[v], a - at[v]) for v, w in zip(versions, weights))
    norm_a = math.sqrt(dot(a, a))
    cos = {v: dot(a, t) / max(norm_a * math.sqrt(dot(t, t)), 1e-300) for v, t in at.items()}
    out["cos_min"] = cos[min(versions)]
    out["cos_mean"] = sum(float(w) * cos[v] for v, w in zip(versions, weights))
    if params_now is not None and params_at is not None:
        p = params_now.to(torch.float64).reshape(-1)
        out["displacement"] = sum(
            float(w) * scale * float((p - params_at[v].to(torch.float64).reshape(-1)).pow(2).sum())
            for v, w in zip(versions, weights)
        )
    return out
