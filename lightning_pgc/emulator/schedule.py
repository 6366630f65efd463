"""A schedule: per version, which ranks' codes the aggregate decodes (in arrival order) and the ages of the cached
entries each code was built from (under bounded staleness also the leader's plan: which rank's code of which model
version stands for each partition). It is what the leader decides (:class:`~lightning_pgc.decisions.leader.StepRecord`),
whether on the simulated clock or in a real run, reduced to plain data that a JSON file can hold.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping, Optional, Sequence

__all__ = ["Version", "from_records", "from_json", "to_json"]


@dataclass(frozen=True)
class Version:
    """One closed version: ``admitted`` ranks in arrival order, ``ages[k]`` the ages (held order) of the entries of
    rank ``k``'s code, and when the version's aggregate was usable on rank 0 (virtual or real seconds).

    ``plan``: bounded staleness only, ``(partition, rank, model version)`` per partition in partition order, rank
    -1 for a partition left out (``BoundedRecord.plan()``); ``None`` for the other schemes.
    """

    version: int
    admitted: tuple[int, ...]
    ages: Mapping[int, tuple[int, ...]]
    time_s: float = 0.0
    weights: Optional[Mapping[int, float]] = field(default=None, compare=False)
    plan: Optional[tuple[tuple[int, int, int], ...]] = None


def _plan(rows: Optional[Iterable[Sequence[int]]]) -> Optional[tuple[tuple[int, int, int], ...]]:
    return None if rows is None else tuple((int(i), int(k), int(v)) for i, k, v in rows)


def from_records(records: Iterable[Any], times: Optional[Sequence[float]] = None) -> list[Version]:
    """Versions from the leader's :class:`~lightning_pgc.decisions.leader.StepRecord` objects (``times[t]``: when
    version ``t`` applied on rank 0; default the records' closing times). A bounded-staleness record
    (:class:`~lightning_pgc.decisions.bounded.BoundedRecord`, the one with per-partition ``entries``) keeps its plan."""
    out = []
    for i, rec in enumerate(records):
        when = float(times[i]) if times is not None else float(rec.closed_at)
        out.append(
            Version(
                int(rec.version),
                tuple(int(k) for k in rec.admitted),
                {int(k): tuple(int(a) for a in v) for k, v in rec.ages.items()},
                when,
                {int(k): float(w) for k, w in rec.weights.items()},
                _plan(rec.plan()) if getattr(rec, "entries", None) else None,
            )
        )
    return out


def to_json(versions: Sequence[Version]) -> list[dict[str, Any]]:
    """Plain JSON rows (rank keys as strings; ``plan`` only where there is one)."""
    rows = []
    for v in versions:
        row: dict[str, Any] = {
            "version": v.version,
            "admitted": list(v.admitted),
            "time_s": v.time_s,
            "ages": {str(k): list(a) for k, a in v.ages.items()},
            "weights": None if v.weights is None else {str(k): w for k, w in v.weights.items()},
        }
        if v.plan is not None:
            row["plan"] = [list(e) for e in v.plan]
        rows.append(row)
    return rows


def from_json(rows: Sequence[Mapping[str, Any]]) -> list[Version]:
    """Inverse of :func:`to_json` (rows without ``plan``, as written before plans were recorded, read as ``None``)."""
    return [
        Version(
            int(r["version"]),
            tuple(int(k) for k in r["admitted"]),
            {int(k): tuple(int(a) for a in v) for k, v in r["ages"].items()},
            float(r.get("time_s", 0.0)),
            None if r.get("weights") is None else {int(k): float(w) for k, w in r["weights"].items()},
            _plan(r.get("plan")),
        )
        for r in rows
    ]
