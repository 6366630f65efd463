"""Each rank's share of a decoded aggregate: the scheme's decode split into per-rank terms (pure math, no I/O).

The leader closes version ``t`` with a plan: ``(decode key, rank, code version)`` per code the aggregate uses (key =
rank for the coded schemes, key = partition under bounded staleness; rank ``-1`` marks a partition left out). The
aggregate is ``sum_key w_key * code[key]`` on the decoded region (gradient and loss) and the plain mean of the used
codes on the rest (buffers). Split by rank, that sum is ``sum_k contribution_k``: so every rank contributes its own
terms to one all-reduce, and the sum is the decoded aggregate on every rank.

The weights are the scheme's :meth:`~lightning_pgc.codes.Scheme.decoding_weights` of the used keys in key order
(the same set gives the same weights whatever the arrival order): uniform for ``pgc_cr``, ``ignore`` and ``dgd``,
the first rank of every group for FR, Tandon's decoding vector for ``gc_cr``, and, under bounded staleness, each
partition's weight on whichever rank's code of whichever version the plan names for it.
"""

from __future__ import annotations

from typing import Optional, Sequence

import torch
from torch import Tensor

from lightning_pgc.codes import Scheme

Plan = Sequence[tuple[int, int, int]]


def contributions(scheme: Scheme, plan: Plan, rank: int) -> dict[int, tuple[float, float]]:
    """``{code version: (weight on the decoded region, weight on the averaged region)}`` of ``rank``'s codes in the
    aggregate of ``plan`` (empty: ``rank`` contributes zeros). A rank named twice (bounded staleness: two
    partitions' entries from one rank, of different versions or not) gets the sum of its entries' weights.
    """
    used = sorted((key, k, v) for key, k, v in plan if k >= 0)
    if not used:
        raise ValueError(f"a plan needs at least one code, got {list(plan)}")
    weights = scheme.decoding_weights([key for key, _, _ in used])
    plain = 1.0 / len(used)
    out: dict[int, tuple[float, float]] = {}
    for key, k, v in used:
        if k == rank:
            w, p = out.get(v, (0.0, 0.0))
            out[v] = (w + weights[key], p + plain)
    return out


def contribute(
    scheme: Scheme, plan: Plan, rank: int, codes: dict[int, Tensor], coded_numel: int, out: Tensor
) -> Tensor:
    """Write ``rank``'s share of the aggregate of ``plan`` into ``out`` (zeros if it has none), in ``out``'s dtype.

    ``codes``: this rank's kept codes by version (flat, at least ``out.numel()`` elements). ``coded_numel``: where
    the decoded region ends (the rest is averaged).

    Raises:
        KeyError: the plan names a code of this rank that ``codes`` lacks.
    """
    terms = contributions(scheme, plan, rank)
    n = out.numel()
    if not terms:
        return out.zero_()
    first = True
    for v, (w, p) in sorted(terms.items()):
        if v not in codes:
            raise KeyError(
                f"the plan names rank {rank}'s code of version {v}, which it does not keep (kept: {sorted(codes)})"
            )
        code = codes[v][:n]
        if first:
            torch.mul(code[:coded_numel], w, out=out[:coded_numel])
            torch.mul(code[coded_numel:], p, out=out[coded_numel:])
            first = False
        else:
            out[:coded_numel].add_(code[:coded_numel], alpha=w)
            out[coded_numel:].add_(code[coded_numel:], alpha=p)
    return out


def reference_decode(
    scheme: Scheme,
    plan: Plan,
    codes: dict[tuple[int, int], Tensor],
    coded_numel: int,
    dtype: Optional[torch.dtype] = None,
) -> Tensor:
    """The aggregate of ``plan`` decoded in one place: ``scheme.decode`` of the used codes in key order on the decoded
    region, their plain mean on the rest (``codes``: ``(rank, version) -> code``). What every rank's share must add
    up to; for tests and checks."""
    used = sorted((key, k, v) for key, k, v in plan if k >= 0)
    coded = {key: codes[(k, v)][:coded_numel] for key, k, v in used}
    first = codes[(used[0][1], used[0][2])]
    out = torch.empty(first.numel(), dtype=dtype or first.dtype)
    out[:coded_numel] = scheme.decode(coded).to(out.dtype)
    tail = torch.zeros(first.numel() - coded_numel, dtype=first.dtype)
    for _, k, v in used:
        tail.add_(codes[(k, v)][coded_numel:], alpha=1.0 / len(used))
    out[coded_numel:] = tail.to(out.dtype)
    return out
