"""The exact aggregate of one version: each admitted code rebuilt from the partition gradients it really held.

Rank ``k``'s code at version ``t`` is ``scheme.encode(k, entries)`` over the cached entries the leader's record
lists (their ages, in held order; :func:`lightning_pgc.theory.quadratic.versions_from_ages` maps them back to partitions and
model versions), and the aggregate is ``scheme.decode`` of the admitted codes in arrival order. Both maps are
linear, so the emulator asks the scheme's own ``encode`` for the coefficients of a code (by encoding unit vectors,
once per pattern of present entries) and its own ``decoding_weights`` for the weights, and applies them to the
partition gradients in float64: ``aggregate = sum_k w_k sum_{(j, v)} B_k[j] g_j(theta_v)``. What it returns is a
list of ``(model version, partition, coefficient)`` terms.

Under bounded staleness (:class:`BoundedPlan`) a code is one uncoded partition gradient and the leader's record names,
per partition, the rank and model version of the code the aggregate uses (``BoundedRecord.plan()``); the aggregate
is ``sum_i w_i g_i(theta_{v_i})`` with the scheme's ``decoding_weights`` of the covered partitions, as every rank's
share (:func:`lightning_pgc.codes.shares.contribute`) adds up to. :func:`plan_for` picks the plan of a scheme.
"""

from __future__ import annotations

import math
from typing import Mapping, Optional, Sequence

import torch

from lightning_pgc.codes import Scheme
from lightning_pgc.codes.bounded import BoundedScheme
from lightning_pgc.emulator.schedule import Version
from lightning_pgc.theory.quadratic import versions_from_ages

__all__ = ["AggregatePlan", "BoundedPlan", "plan_for"]

#: ``(partition, rank, model version)`` per partition; rank -1: the partition was left out of the aggregate
Entries = Sequence[tuple[int, int, int]]


class AggregatePlan:
    """Turns a version's admitted set and ages into aggregate terms with ``scheme``'s real encode and decode.

    Args:
        scheme: the scheme the run used (any of :func:`~lightning_pgc.codes.make_scheme` but ``pgc_cr_naive``;
            a :class:`~lightning_pgc.codes.BoundedScheme` takes :class:`BoundedPlan`).
        start: the step at which the caches were empty (0 for a fresh fit).
    """

    def __init__(self, scheme: Scheme, start: int = 0) -> None:
        if scheme.name == "pgc_cr_naive":
            raise ValueError(
                "the emulator does not replay pgc_cr_naive (its codes need the full cache history); "
                "use pgc_cr, pgc_fr, gc_cr, gc_fr, ignore or dgd"
            )
        if isinstance(scheme, BoundedScheme) and not isinstance(self, BoundedPlan):
            raise ValueError("a bounded scheme's aggregate is its leader's plan: use BoundedPlan (or plan_for)")
        self.scheme = scheme
        self.start = start
        self._encode: dict[tuple[int, tuple[int, ...]], dict[int, float]] = {}

    def code_coefficients(self, worker: int, present: tuple[int, ...]) -> dict[int, float]:
        """``B_k[j]``: coefficient of partition ``j``'s gradient in ``worker``'s code built from ``present``, read off
        ``scheme.encode`` applied to unit vectors."""
        key = (worker, present)
        out = self._encode.get(key)
        if out is None:
            eye = torch.eye(len(present), dtype=torch.float64)
            code = self.scheme.encode(worker, {j: eye[i] for i, j in enumerate(present)})
            out = {j: float(code[i]) for i, j in enumerate(present)}
            self._encode[key] = out
        return out

    def terms(
        self, version: int, admitted: Sequence[int], ages: Mapping[int, Sequence[int]]
    ) -> list[tuple[int, int, float]]:
        """``(model version, partition, coefficient)`` of every gradient in the aggregate of ``version``.

        Raises:
            ValueError: the ages of an admitted code do not fit the scheme's rotation (a record from another scheme),
                or the admitted set does not decode.
        """
        weights = self.scheme.decoding_weights(list(admitted))
        out: list[tuple[int, int, float]] = []
        for k in admitted:
            w = weights[k]
            if w == 0.0:
                continue
            if k not in ages:
                raise ValueError(f"version {version}: no ages recorded for admitted rank {k}")
            versions = versions_from_ages(self.scheme, k, version, ages[k], self.start)
            if versions is None or not versions:
                raise ValueError(
                    f"version {version}: ages {list(ages[k])} of rank {k} do not fit "
                    f"{self.scheme.name}'s rotation over partitions {list(self.scheme.partitions(k))}"
                )
            coeffs = self.code_coefficients(k, tuple(versions))
            out.extend((versions[j], j, w * b) for j, b in coeffs.items())
        return out

    def terms_of(self, entry: Version) -> list[tuple[int, int, float]]:
        """:meth:`terms` of one schedule entry."""
        return self.terms(entry.version, entry.admitted, entry.ages)

    def keep(self, schedule: Sequence[Version]) -> int:
        """How many versions of partition gradients the aggregates of ``schedule`` reach back: ``c + 1`` (every
        cached entry is younger than ``c``)."""
        return self.scheme.c + 1

    def combine(
        self,
        terms: Sequence[tuple[int, int, float]],
        gradients: Mapping[int, torch.Tensor],
        dtype: torch.dtype = torch.float64,
    ) -> torch.Tensor:
        """``sum coefficient * gradients[v][j]`` in ``dtype`` (float64: as exact as a real run's float32 sums, or
        more); ``gradients[v]`` is ``[n, numel]`` (row ``j``: partition ``j``'s flat gradient, with the loss appended,
        at model version ``v``)."""
        by_version: dict[int, tuple[list[int], list[float]]] = {}
        for v, j, a in terms:
            if v not in gradients:
                raise ValueError(f"the aggregate needs gradients of model version {v}, which are no longer kept")
            js, coeffs = by_version.setdefault(v, ([], []))
            js.append(j)
            coeffs.append(a)
        out = None
        for v, (js, coeffs) in sorted(by_version.items()):
            row = torch.zeros(self.scheme.n, dtype=torch.float64).index_add_(
                0, torch.tensor(js), torch.tensor(coeffs, dtype=torch.float64)
            )
            part = row.to(dtype) @ gradients[v].to(dtype)
            out = part if out is None else out + part
        assert out is not None, "an aggregate with no terms"
        return out


class BoundedPlan(AggregatePlan):
    """The terms of a bounded-staleness version: the gradient of partition ``i`` at the model version of the code the
    leader named for it, weighted by ``scheme.decoding_weights`` of the covered partitions. The entries come from the
    record's plan (``Version.plan``, ``(partition, rank, model version)`` per partition).

    Args:
        scheme: the bounded scheme the run used.
        start: the first version of the fit.
    """

    def __init__(self, scheme: BoundedScheme, start: int = 0) -> None:
        if not isinstance(scheme, BoundedScheme):
            raise TypeError(f"BoundedPlan needs a BoundedScheme, got {type(scheme).__name__}")
        super().__init__(scheme, start)
        self.bounded = scheme

    def terms(
        self,
        version: int,
        admitted: Sequence[int],
        ages: Mapping[int, Sequence[int]],
        plan: Optional[Entries] = None,
        weights: Optional[Mapping[int, float]] = None,
    ) -> list[tuple[int, int, float]]:
        """``(model version, partition, coefficient)`` of every gradient in the aggregate of ``plan``.

        Raises:
            ValueError: no plan, a plan whose ranks are not ``admitted``, a partition listed twice, an entry of a rank
                that does not hold its partition or of a model version after ``version``, or recorded ``weights``
                (per rank) that differ from the scheme's.
        """
        if plan is None:
            raise ValueError(
                f"version {version}: a bounded version's aggregate is its leader's plan, and this schedule has none "
                "(record it with schedule.from_records)"
            )
        if {k for _, k, _ in plan if k >= 0} != set(admitted):
            raise ValueError(f"version {version}: the plan's ranks are not the admitted ranks {list(admitted)}")
        if len({i for i, _, _ in plan}) != len(plan):
            raise ValueError(f"version {version}: a partition is listed twice in {list(plan)}")
        used = sorted((int(i), int(k), int(v)) for i, k, v in plan if k >= 0)
        for i, k, v in used:
            if i not in self.bounded.partitions(k):
                raise ValueError(f"version {version}: rank {k} does not hold partition {i}")
            if not self.start <= v <= version:
                raise ValueError(f"version {version}: partition {i}'s entry is of model version {v}")
        w = self.bounded.decoding_weights([i for i, _, _ in used])
        if weights is not None:
            per_rank: dict[int, float] = {}
            for i, k, _ in used:
                per_rank[k] = per_rank.get(k, 0.0) + w[i]
            if set(per_rank) != set(weights) or any(
                not math.isclose(per_rank[k], weights[k], rel_tol=1e-9, abs_tol=1e-12) for k in per_rank
            ):
                raise ValueError(
                    f"version {version}: the recorded weights {dict(weights)} are not the scheme's {per_rank} "
                    "(a record from another scheme or other partition sizes)"
                )
        return [(v, i, w[i]) for i, _, v in used]

    def terms_of(self, entry: Version) -> list[tuple[int, int, float]]:
        return self.terms(entry.version, entry.admitted, entry.ages, entry.plan, entry.weights)

    def keep(self, schedule: Sequence[Version]) -> int:
        """One more than the oldest entry any plan of ``schedule`` uses (the leader may widen the window), and at
        least ``c``."""
        oldest = max((e.version - v for e in schedule for _, k, v in (e.plan or ()) if k >= 0), default=0)
        return max(self.bounded.window, oldest + 1)


def plan_for(scheme: Scheme, start: int = 0) -> AggregatePlan:
    """The aggregate plan of ``scheme``: :class:`BoundedPlan` for a bounded scheme, else :class:`AggregatePlan`."""
    if isinstance(scheme, BoundedScheme):
        return BoundedPlan(scheme, start)
    return AggregatePlan(scheme, start)
