"""The exact aggregate of one version: each admitted code rebuilt from the partition gradients it really held.

Rank ``k``'s code at version ``t`` is ``scheme.encode(k, entries)`` over the cached entries the leader's record
lists (their ages, in held order; :func:`lightning_pgc.theory.quadratic.versions_from_ages` maps them back to partitions and
model versions), and the aggregate is ``scheme.decode`` of the admitted codes in arrival order. Both maps are
linear, so the emulator asks the scheme's own ``encode`` for the coefficients of a code (by encoding unit vectors,
once per pattern of present entries) and its own ``decoding_weights`` for the weights, and applies them to the
partition gradients in float64: ``aggregate = sum_k w_k sum_{(j, v)} B_k[j] g_j(theta_v)``. What it returns is a
list of ``(model version, partition, coefficient)`` terms.
"""

from __future__ import annotations

from typing import Mapping, Sequence

import torch

from lightning_pgc.codes import Scheme
from lightning_pgc.theory.quadratic import versions_from_ages

__all__ = ["AggregatePlan"]


class AggregatePlan:
    """Turns a version's admitted set and ages into aggregate terms with ``scheme``'s real encode and decode.

    Args:
        scheme: the scheme the run used (any of :func:`~lightning_pgc.codes.make_scheme` but ``pgc_cr_naive``).
        start: the step at which the caches were empty (0 for a fresh fit).
    """

    def __init__(self, scheme: Scheme, start: int = 0) -> None:
        if scheme.name == "pgc_cr_naive":
            raise ValueError(
                "the emulator does not replay pgc_cr_naive (its codes need the full cache history); "
                "use pgc_cr, pgc_fr, gc_cr, gc_fr, ignore or dgd"
            )
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
