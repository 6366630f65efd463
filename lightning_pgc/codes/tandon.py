"""Tandon et al. (2017) cyclic gradient code ``B`` and its numerical health.

``B`` is ``n x n``, row ``k`` supported on ``{k, ..., k+s} mod n``; any ``n-s``
rows span the all-ones vector, so the coordinator can recover ``sum_j g_j``
from any ``n-s`` codes ``f_k = sum_j B[k, j] g_j``. Decoding solves a linear
system whose condition number grows fast with ``n`` and ``s``, hence the
float64 construction and the condition checks: the worst case over received
sets when the scheme is built (exact when the sets can be enumerated), and the
set actually received at decode time. The residual ``|a^T B_K - 1|`` is no such
check: least squares drives it below 1e-7 even where ``cond(B_K)`` is 3.5e11
and ``a`` is 3e8 large (``n = 32, s = 4``, seed 2), so it only catches a
numerically singular ``B_K``.
"""

from __future__ import annotations

import itertools
import math
from functools import lru_cache
from typing import Sequence

import numpy as np

__all__ = [
    "MAX_ENUMERATED_SUBSETS",
    "SAMPLED_SUBSETS",
    "SEED_TRIES",
    "RESIDUAL_TOL",
    "tandon_b",
    "decoding_subsets",
    "subset_conditions",
    "worst_condition",
    "best_tandon_b",
    "solve_decoding_vector",
    "tiling_b",
    "tiling_decoding_vector",
]

MAX_ENUMERATED_SUBSETS: int = 40_000
"""Enumerate all C(n, s) received subsets up to this many (C(32, 4) = 35960 takes a few seconds per seed); above
it, sample :data:`SAMPLED_SUBSETS` of them, which gives only a lower bound on the worst case."""

SAMPLED_SUBSETS: int = 5000
"""How many received subsets (seeded by ``(n, s)``) are sampled when there are too many to enumerate."""

SEED_TRIES: int = 8
"""``best_tandon_b`` tries seeds ``seed .. seed + SEED_TRIES - 1`` and keeps the B with the smallest worst case."""

RESIDUAL_TOL: float = 1e-6
"""Largest accepted ``|a^T B_K - 1|_inf`` of a decoding vector ``a`` (catches a numerically singular ``B_K``
only; the condition check is what bounds the decode error)."""


def tandon_b(n: int, s: int, seed: int = 0) -> np.ndarray:
    """Tandon's Algorithm 2: B (float64, ``n x n``) from a seeded random ``H`` (``s x n``) with ``H @ 1 = 0``.

    Row ``k`` has ``B[k, k] = 1`` and its other support ``{k+1..k+s} mod n``
    solves ``H b_k = 0``; every row lies in ``null(H)`` (dimension ``n-s``,
    containing the all-ones vector), so generic ``n-s`` rows span it.
    """
    if n < 1 or not 0 <= s < n:
        raise ValueError(f"tandon_b needs n >= 1 and 0 <= s < n, got n={n}, s={s}")
    B = np.zeros((n, n), dtype=np.float64)
    if s == 0:
        np.fill_diagonal(B, 1.0)
        return B
    rng = np.random.default_rng(seed)
    H = rng.standard_normal((s, n))
    H[:, n - 1] = -H[:, : n - 1].sum(axis=1)
    for k in range(n):
        rest = [(k + i) % n for i in range(1, s + 1)]
        B[k, k] = 1.0
        B[k, rest] = np.linalg.solve(H[:, rest], -H[:, k])
    return B


def decoding_subsets(
    n: int, s: int, max_subsets: int = MAX_ENUMERATED_SUBSETS, samples: int = SAMPLED_SUBSETS
) -> np.ndarray:
    """Received subsets (rows: sorted ranks, ``n-s`` each) used to measure conditioning.

    All ``C(n, s)`` subsets when there are at most ``max_subsets``; otherwise ``samples`` random ones from a
    generator seeded by ``(n, s)`` only, so every candidate ``B`` is judged on the same subsets (deterministic).
    """
    total = math.comb(n, s)
    if total <= max_subsets:
        rows = [sorted(set(range(n)) - set(drop)) for drop in itertools.combinations(range(n), s)]
        return np.asarray(rows, dtype=np.int64).reshape(total, n - s)
    rng = np.random.default_rng([n, s, 20170707])
    keys = rng.random((samples, n))
    return np.sort(np.argsort(keys, axis=1)[:, : n - s], axis=1)


def subset_conditions(B: np.ndarray, subsets: np.ndarray, chunk: int = 1024) -> np.ndarray:
    """2-norm condition number ``sigma_max / sigma_min`` of ``B[K]`` for each row-subset ``K``."""
    out = np.empty(len(subsets), dtype=np.float64)
    for lo in range(0, len(subsets), chunk):
        sub = B[subsets[lo : lo + chunk]]
        sv = np.linalg.svd(sub, compute_uv=False)
        with np.errstate(divide="ignore", invalid="ignore"):
            cond = sv[:, 0] / sv[:, -1]
        out[lo : lo + chunk] = np.where(np.isfinite(cond), cond, np.inf)
    return out


def worst_condition(B: np.ndarray, s: int, max_subsets: int = MAX_ENUMERATED_SUBSETS) -> float:
    """Worst ``cond(B_K)`` over received sets of ``n-s`` ranks (exact if enumerated, else a sampled lower bound)."""
    n = B.shape[0]
    return float(subset_conditions(B, decoding_subsets(n, s, max_subsets)).max())


@lru_cache(maxsize=64)
def _best(n: int, s: int, seed: int, tries: int, max_subsets: int) -> tuple[np.ndarray, float, int]:
    subsets = decoding_subsets(n, s, max_subsets)
    chunk = 2048
    best: tuple[np.ndarray, float, int] | None = None
    for cand in range(seed, seed + tries):
        B = tandon_b(n, s, cand)
        worst = 0.0
        for lo in range(0, len(subsets), chunk):
            worst = max(worst, float(subset_conditions(B, subsets[lo : lo + chunk]).max()))
            if best is not None and worst >= best[1]:
                break  # already no better than the best seed: the rest of its subsets cannot help
        if best is None or worst < best[1]:
            best = (B, worst, cand)
    assert best is not None
    best[0].setflags(write=False)
    return best


def best_tandon_b(
    n: int, s: int, seed: int = 0, tries: int = SEED_TRIES, max_subsets: int = MAX_ENUMERATED_SUBSETS
) -> tuple[np.ndarray, float, int]:
    """The ``tandon_b`` over seeds ``seed..seed+tries-1`` with the smallest worst ``cond(B_K)`` over received sets
    (:func:`decoding_subsets`): ``(B copy, its worst condition, seed used)``.

    The worst case, and hence the choice, is exact when ``C(n, s) <= max_subsets`` (every set enumerated; a seed
    is abandoned as soon as one of its sets is worse than the best seed's worst); above it, it is taken over a
    seeded sample and is a lower bound. Deterministic and memoised per process (ranks and tests rebuild schemes
    often).
    """
    B, worst, used = _best(n, s, seed, tries, max_subsets)
    return B.copy(), worst, used


def solve_decoding_vector(
    B: np.ndarray, ranks: Sequence[int], tol: float = RESIDUAL_TOL, max_condition: float | None = None
) -> np.ndarray:
    """Solve ``B_K^T a = 1`` (float64 least squares) for the received ranks ``K``.

    Args:
        B: Tandon's ``B`` (``n x n``).
        ranks: the received ranks ``K`` (``n - s`` of them).
        tol: largest accepted residual ``|a^T B_K - 1|_inf``.
        max_condition: if set, the largest accepted ``cond(B_K)``. This, not the residual, bounds the decode
            error (about ``cond(B_K)`` times the payload's rounding error); it matters where the worst case over
            received sets was sampled rather than enumerated, so a set worse than the sample may arrive.

    Returns:
        ``a`` (float64), aligned with ``ranks``.

    Raises:
        ValueError: ``cond(B_K) > max_condition``, or the residual exceeds ``tol`` (``B_K`` numerically singular).
    """
    K = np.asarray(list(ranks), dtype=np.int64)
    BK = np.asarray(B, dtype=np.float64)[K]
    if max_condition is not None:
        sv = np.linalg.svd(BK, compute_uv=False)
        cond = float(sv[0] / sv[-1]) if sv[-1] > 0 else math.inf
        if not cond <= max_condition:
            raise ValueError(
                f"cannot decode from ranks {sorted(K.tolist())}: cond(B_K) = {cond:.3g} > max_condition = "
                f"{max_condition:.3g} (the decode would lose ~{math.log10(cond):.0f} of float64's 16 digits); this "
                f"received set is worse than the worst case measured when the scheme was built (sampled for large "
                f"C(n, s)); lower s, use fewer ranks, or use pgc_cr / gc_fr"
            )
    ones = np.ones(BK.shape[1], dtype=np.float64)
    a, *_ = np.linalg.lstsq(BK.T, ones, rcond=None)
    residual = float(np.max(np.abs(a @ BK - ones)))
    if not residual <= tol:
        raise ValueError(
            f"cannot decode from ranks {sorted(K.tolist())}: residual |a^T B_K - 1|_inf = {residual:.3g} "
            f"> {tol:g} (B_K is numerically singular); lower s, use fewer ranks, or use pgc_cr / gc_fr"
        )
    return a


def tiling_b(n: int, s: int) -> np.ndarray:
    """The cyclic-repetition code with unit coefficients, for ``(s + 1) | n``: ``B[k, j] = 1`` on ``{k..k+s} mod n``.

    Rank ``k``'s code is the plain sum of its ``c = s + 1`` partitions' gradients. The ranks ``o, o + c, o + 2c,
    ...`` (one *tiling* per offset ``o < c``) hold disjoint partitions that cover all ``n``, so their codes sum to
    the full gradient. A straggler ``k`` breaks only tiling ``k mod c``; ``s`` stragglers break at most ``s`` of the
    ``c = s + 1`` tilings, so every received set of ``n - s`` ranks contains a whole tiling and decodes with weights
    0 and 1 (:func:`tiling_decoding_vector`): exact, with no condition number to grow with ``n``, and built in
    ``O(n c)``. (``B`` itself has rank ``n - s``, so a received ``B_K`` may be singular: its decode is the tiling's,
    not a least-squares solve.)

    Raises:
        ValueError: ``s + 1`` does not divide ``n``, or ``not 0 <= s < n``.
    """
    if n < 1 or not 0 <= s < n:
        raise ValueError(f"tiling_b needs n >= 1 and 0 <= s < n, got n={n}, s={s}")
    c = s + 1
    if n % c:
        raise ValueError(f"the tiling construction needs c = s + 1 = {c} to divide n = {n}")
    B = np.zeros((n, n), dtype=np.float64)
    rows = np.repeat(np.arange(n), c)
    cols = (rows + np.tile(np.arange(c), n)) % n
    B[rows, cols] = 1.0
    return B


def tiling_decoding_vector(n: int, s: int, ranks: Sequence[int]) -> np.ndarray:
    """``a`` (float64, aligned with ``sorted(ranks)``) with ``a^T B_K = 1`` for :func:`tiling_b`: 1 on the ranks of
    the first whole tiling (smallest offset) among ``ranks``, 0 elsewhere.

    Raises:
        ValueError: ``ranks`` contain no whole tiling (more than ``s`` ranks missing).
    """
    c = s + 1
    K = sorted(int(k) for k in ranks)
    present = set(K)
    for offset in range(c):
        tiling = set(range(offset, n, c))
        if tiling <= present:
            return np.asarray([1.0 if k in tiling else 0.0 for k in K], dtype=np.float64)
    raise ValueError(
        f"cannot decode from ranks {K}: no whole tiling (ranks o, o+{c}, ... for some o < {c}) among them; "
        f"at most s={s} of n={n} ranks may be missing"
    )
