"""The convergence theory's quantities measured on one aggregate: copy weights, error decomposition, constants.

Pure math (numpy / torch, float64), no Lightning and no ``torch.distributed``. ``docs/results/theory.md`` explains every
quantity; ``tests/test_theory.py`` checks them exhaustively on small cases, and
:class:`~lightning_pgc.callbacks.PGCDiagnostics` (``theory_every_n_steps``) evaluates them during a real run.

Notation (as in ``docs/math.md``): ``n`` ranks and partitions, ``c = s + 1`` copies, model version ``t``.
``g_j^(v)`` is the mini-batch gradient of partition ``j`` at version ``v``; ``grad F_j(beta_v)`` the gradient of
partition ``j``'s whole loss; the objective the schemes optimise is ``F = (1/n) sum_j F_j``. Rank ``k``'s cache holds
partition ``j`` at version ``v_kj``; ``W[k, j]`` is the weight of that copy in the aggregate.

- coefficients: :func:`code_weights`, :func:`copy_weights`, :func:`reference_copy_weights`,
  :func:`received_patterns`, :func:`pattern_rank_weights`, :func:`nominal_cache_versions`,
  :func:`versions_from_ages`;
- the received-subset estimator versus the all-rank average: :func:`subset_moments`;
- the exact error decomposition of one aggregate: :func:`decompose_error`;
- the constants of the convergence bounds: :func:`gamma_hat`, :func:`xi_hat`, :func:`copy_statistics` (the cross
  terms between copies of one partition).

The research lab built on them (an exact simulator on a quadratic, delayed-gradient stability) is
:mod:`lightning_pgc.theory.quadratic`, outside ``import lightning_pgc``.
"""

from __future__ import annotations

import itertools
import math
from dataclasses import dataclass, field
from typing import Any, Hashable, Mapping, Optional, Sequence

import numpy as np
import torch
from torch import Tensor

__all__ = [
    "code_weights",
    "copy_weights",
    "reference_copy_weights",
    "received_patterns",
    "pattern_rank_weights",
    "nominal_cache_versions",
    "versions_from_ages",
    "codes_from_copies",
    "weighted_copy_sum",
    "SubsetMoments",
    "subset_moments",
    "ErrorDecomposition",
    "decompose_error",
    "gamma_hat",
    "xi_hat",
    "copy_statistics",
    "Versions",
    "Key",
]

Versions = Mapping[int, Mapping[int, int]]  # rank -> {partition: version of its cached copy}
Key = Hashable  # (partition, version) in the in-run measurements


# ===================================================================================================== coefficients
def code_weights(scheme: Any, worker: int, present: Optional[Sequence[int]] = None) -> dict[int, float]:
    """``b_kj``: the coefficient of held partition ``j`` in ``worker``'s code when its cache holds ``present``.

    Computed by encoding unit vectors with ``scheme.encode`` itself, so it is the scheme's own arithmetic (the
    ``c/m`` rescale of partial caches in ``pgc_fr``/``pgc_cr``, Tandon's ``B[k, j]`` in ``gc_cr``/``pgc_cr_naive``),
    rounded to the scheme's payload dtype as the real codes are.
    """
    held = scheme.partitions(worker)
    parts = tuple(held if present is None else (j for j in held if j in set(present)))
    basis = {j: torch.zeros(scheme.n, dtype=torch.float64) for j in parts}
    for j in parts:
        basis[j][j] = 1.0
    code = scheme.encode(worker, basis).to(torch.float64)
    return {j: float(code[j]) for j in parts}


def copy_weights(scheme: Any, received: Sequence[int], present: Optional[Mapping[int, Sequence[int]]] = None) -> Tensor:
    """``W[k, j] = w_k(received) * b_kj(present_k)``: weight of rank ``k``'s copy of partition ``j`` in the aggregate.

    ``received`` is in arrival order (as the coordinator admitted it). With full caches this equals
    ``scheme.copy_coefficients(received)``; ``present`` (rank -> cached partitions) covers partial caches.
    """
    W = torch.zeros(scheme.n, scheme.n, dtype=torch.float64)
    for k, w in scheme.decoding_weights(list(received)).items():
        if w == 0.0:
            continue
        for j, b in code_weights(scheme, k, None if present is None else present.get(k, ())).items():
            W[k, j] = w * b
    return W


def reference_copy_weights(scheme: Any, present: Optional[Mapping[int, Sequence[int]]] = None) -> Tensor:
    """The all-rank average ``Wbar``: every rank's code received, each copy of partition ``j`` weighted equally.

    ``Wbar[k, j] = 1 / (n * m_j)`` for every rank ``k`` whose cache holds ``j`` (``m_j`` such copies), so every
    partition's total weight is the ideal ``1/n``. For ``pgc_cr`` with full caches this is exactly
    ``scheme.copy_coefficients(range(n))`` (``mu`` with ``|R| = n``); for ``pgc_fr`` it is the expectation of the
    one-rank-per-group decode when every rank of a group is equally likely to arrive first; for fresh gradients
    (``dgd``, ``gc_*``) every copy is the same gradient and ``Wbar`` gives the exact aggregate.
    """
    n = scheme.n
    holds = {k: set(scheme.partitions(k) if present is None else present.get(k, ())) for k in range(n)}
    W = torch.zeros(n, n, dtype=torch.float64)
    for j in range(n):
        holders = [k for k in range(n) if j in holds[k]]
        for k in holders:
            W[k, j] = 1.0 / (n * len(holders))
    return W


def _is_fr(scheme: Any) -> bool:
    return getattr(scheme, "name", "") in ("gc_fr", "pgc_fr")


def received_patterns(scheme: Any, max_patterns: int = 5000, seed: int = 0) -> list[tuple[float, tuple[int, ...]]]:
    """The decoded received sets under exchangeable arrivals (every arrival order equally likely), with probabilities.

    The coordinator closes a version as soon as the codes in admit a decode. For FR schemes that is the first
    arrival of every group (uniform within a group, independent across groups: ``c^(n/c)`` patterns); for all
    others the first ``wait_for`` arrivals, a uniform ``wait_for``-subset. Exact enumeration when there are at most
    ``max_patterns`` patterns, otherwise ``max_patterns`` seeded uniform draws (equal probabilities).
    """
    n = scheme.n
    rng = np.random.default_rng(seed)
    if _is_fr(scheme):
        c = scheme.c
        groups = [list(range(g * c, g * c + c)) for g in range(n // c)]
        total = c ** len(groups)
        if total <= max_patterns:
            return [(1.0 / total, tuple(p)) for p in itertools.product(*groups)]
        return [(1.0 / max_patterns, tuple(int(rng.choice(g)) for g in groups)) for _ in range(max_patterns)]
    m = scheme.wait_for
    total = math.comb(n, m)
    if total <= max_patterns:
        return [(1.0 / total, p) for p in itertools.combinations(range(n), m)]
    return [
        (1.0 / max_patterns, tuple(sorted(rng.choice(n, size=m, replace=False).tolist()))) for _ in range(max_patterns)
    ]


def pattern_rank_weights(scheme: Any, patterns: Sequence[tuple[float, Sequence[int]]]) -> tuple[np.ndarray, np.ndarray]:
    """``(p, w)``: probabilities ``[P]`` and decoding weights ``w[P, n]`` (``w_k`` of rank ``k``'s code) per pattern."""
    probs = np.array([float(p) for p, _ in patterns], dtype=np.float64)
    weights = np.zeros((len(patterns), scheme.n), dtype=np.float64)
    for row, (_, received) in enumerate(patterns):
        for k, w in scheme.decoding_weights(list(received)).items():
            weights[row, k] = w
    return probs, weights


def nominal_cache_versions(scheme: Any, worker: int, step: int, start: int = 0) -> dict[int, int]:
    """What ``worker``'s cache holds at ``step`` when it computed at every step since ``start``: partition -> version.

    Walks back through ``scheme.evaluations`` (rotation and warm-up) and drops entries older than the scheme's
    ``cache_max_age`` (bounded staleness). Returned in held order.
    """
    held = scheme.partitions(worker)
    max_age = scheme.cache_max_age
    found: dict[int, int] = {}
    u = step
    while u >= start and len(found) < len(held):
        if max_age is not None and step - u >= max_age:
            break
        for j in scheme.evaluations(worker, u, start=start):
            found.setdefault(j, u)
        u -= 1
    return {j: found[j] for j in held if j in found}


def versions_from_ages(
    scheme: Any, worker: int, step: int, ages: Sequence[int], start: int = 0
) -> Optional[dict[int, int]]:
    """Which cached partition each reported age belongs to: partition -> version, or ``None`` if inconsistent.

    A code's header carries the ages of the entries it was built from, in held order, but not their partitions
    (a rank that skipped steps has fewer than ``c``). An entry of age ``a`` was computed at step ``step - a``, when
    the rank evaluated ``scheme.evaluations(worker, step - a)``; walking the held partitions in order and matching
    each against the next age recovers the partitions exactly (each rotating step evaluates one partition, and a
    warm-up entry that is still valid implies every partition of that step is present).
    """
    held = scheme.partitions(worker)
    ages = [int(a) for a in ages]
    out: dict[int, int] = {}
    i = 0
    for j in held:
        if i < len(ages) and 0 <= ages[i] <= step - start and j in scheme.evaluations(worker, step - ages[i], start):
            out[j] = step - ages[i]
            i += 1
    return out if i == len(ages) else None


# ================================================================================================ vector helpers
def _vec(x: Any) -> Tensor:
    return torch.as_tensor(x, dtype=torch.float64).reshape(-1)


def weighted_copy_sum(W: Tensor, versions: Versions, vectors: Mapping[Key, Tensor]) -> Tensor:
    """``sum_{k, j} W[k, j] * vectors[(j, v_kj)]`` in float64 (rank order, then held order)."""
    out: Optional[Tensor] = None
    for k in sorted(versions):
        for j, v in versions[k].items():
            w = float(W[k, j])
            if w == 0.0:
                continue
            x = _vec(vectors[(j, v)])
            out = x * w if out is None else out.add(x, alpha=w)
    if out is None:
        first = _vec(next(iter(vectors.values())))
        return torch.zeros_like(first)
    return out


def codes_from_copies(scheme: Any, versions: Versions, vectors: Mapping[Key, Tensor]) -> Tensor:
    """Every rank's code ``f_k = sum_j b_kj g_(j, v_kj)`` (float64, ``[n, d]``), from its cached copies ``versions[k]``."""
    rows = []
    for k in range(scheme.n):
        present = versions.get(k, {})
        b = code_weights(scheme, k, tuple(present)) if present else {}
        row: Optional[Tensor] = None
        for j, v in present.items():
            x = _vec(vectors[(j, v)])
            row = x * b[j] if row is None else row.add(x, alpha=b[j])
        rows.append(row)
    d = next(r for r in rows if r is not None).numel()
    return torch.stack([r if r is not None else torch.zeros(d, dtype=torch.float64) for r in rows])


# ========================================================================================= Lemma 3: subset moments
@dataclass
class SubsetMoments:
    """Second moments of the received-subset estimator ``g_hat(R) = sum_k w_k(R) f_k`` over the straggler pattern ``R``.

    ``reference`` is the all-rank average ``g_bar``. ``mse = E|g_hat - g_bar|^2 = bias_sq + variance`` is the extra
    error the received subset adds on top of the all-rank average; Lemma 3's proof of the paper replaces
    ``E|g_hat|^2`` by ``|g_bar|^2`` (the review's objection), i.e. drops ``mean_sq - reference_sq``.
    """

    mean_sq: float  # E_R |g_hat|^2
    reference_sq: float  # |g_bar|^2
    mse: float  # E_R |g_hat - g_bar|^2
    bias_sq: float  # |E_R g_hat - g_bar|^2
    variance: float  # E_R |g_hat - E_R g_hat|^2
    num_patterns: int

    @property
    def lemma3_gap(self) -> float:
        """``E|g_hat|^2 - |g_bar|^2``: what Lemma 3's proof drops (``= variance`` when the estimator is unbiased)."""
        return self.mean_sq - self.reference_sq


def subset_moments(codes: Tensor, reference: Tensor, probs: np.ndarray, rank_weights: np.ndarray) -> SubsetMoments:
    """Exact moments over the patterns (``probs[P]``, ``rank_weights[P, n]``) for fixed codes ``[n, d]``.

    Uses the Gram matrix of the codes, so the cost is one ``n x n x d`` product plus ``O(P n^2)``.
    """
    V = torch.as_tensor(codes, dtype=torch.float64)
    ref = _vec(reference)
    G = (V @ V.T).numpy()
    r = (V @ ref).numpy()
    rr = float(ref @ ref)
    p = np.asarray(probs, dtype=np.float64)
    p = p / p.sum()
    Wp = np.asarray(rank_weights, dtype=np.float64)
    per = np.einsum("pi,ij,pj->p", Wp, G, Wp)
    mean_sq = float(p @ per)
    wbar = p @ Wp
    mean_norm_sq = float(wbar @ G @ wbar)
    cross = float(wbar @ r)
    return SubsetMoments(
        mean_sq=mean_sq,
        reference_sq=rr,
        mse=mean_sq - 2.0 * cross + rr,
        bias_sq=mean_norm_sq - 2.0 * cross + rr,
        variance=mean_sq - mean_norm_sq,
        num_patterns=len(p),
    )


# ================================================================================== the exact error decomposition
@dataclass
class ErrorDecomposition:
    """``g_hat - grad F(beta_t) = subset + sampling + staleness`` (vectors, float64), exactly.

    - ``subset = g_hat - g_bar``: which codes were received (``g_bar`` is the all-rank average of the same copies);
    - ``sampling = sum_kj Wbar_kj (g_j^(v_kj) - grad F_j(beta_(v_kj)))``: mini-batch noise of the copies;
    - ``staleness = sum_kj Wbar_kj grad F_j(beta_(v_kj)) - grad F(beta_t)``: the copies' versions are old.
    """

    total: Tensor
    subset: Tensor
    sampling: Tensor
    staleness: Tensor
    terms: dict[str, Tensor] = field(init=False)

    def __post_init__(self) -> None:
        self.terms = {"subset": self.subset, "sampling": self.sampling, "staleness": self.staleness}

    def squared_norms(self) -> dict[str, float]:
        out = {name: float(v @ v) for name, v in self.terms.items()}
        out["total"] = float(self.total @ self.total)
        return out

    def cross_terms(self) -> dict[str, float]:
        """``2 <a, b>`` for each pair of terms; ``|total|^2 = sum of squared norms + sum of cross terms``."""
        names = list(self.terms)
        return {f"{a}*{b}": 2.0 * float(self.terms[a] @ self.terms[b]) for a, b in itertools.combinations(names, 2)}

    @property
    def residual(self) -> float:
        """``|subset + sampling + staleness - total| / |total|`` (0 up to rounding)."""
        diff = self.subset + self.sampling + self.staleness - self.total
        return float(diff.norm() / max(float(self.total.norm()), 1e-300))


def decompose_error(
    aggregate: Tensor,
    reference_weights: Tensor,
    versions: Versions,
    minibatch: Mapping[Key, Tensor],
    full: Mapping[Key, Tensor],
    grad_now: Tensor,
) -> ErrorDecomposition:
    """Split ``aggregate - grad_now`` into subset, sampling and staleness terms that sum to it exactly.

    Args:
        aggregate: the aggregate applied at version ``t`` (``g_hat``).
        reference_weights: ``Wbar`` of :func:`reference_copy_weights` (the all-rank average; columns sum to ``1/n``).
        versions: rank -> {partition: version} of every rank's cached copies (all ranks, received or not).
        minibatch: ``(j, v) -> g_j^(v)``, the mini-batch gradient of partition ``j`` at version ``v``.
        full: ``(j, v) -> grad F_j(beta_v)`` for the same keys.
        grad_now: ``grad F(beta_t) = (1/n) sum_j grad F_j(beta_t)``.
    """
    g_hat = _vec(aggregate)
    now = _vec(grad_now)
    g_bar = weighted_copy_sum(reference_weights, versions, minibatch)
    s_bar = weighted_copy_sum(reference_weights, versions, full)
    return ErrorDecomposition(total=g_hat - now, subset=g_hat - g_bar, sampling=g_bar - s_bar, staleness=s_bar - now)


# ======================================================================================== constants of the theorems
def gamma_hat(grad_now: Tensor, grad_old: Tensor) -> float:
    """``|grad F(beta_t) - grad F(beta_v)|^2 / |grad F(beta_t)|^2``: the staleness bias the theorems assume ``< 1``."""
    now, old = _vec(grad_now), _vec(grad_old)
    return float((now - old).pow(2).sum() / max(float(now.pow(2).sum()), 1e-300))


def xi_hat(
    versions: Versions, minibatch: Mapping[Key, Tensor], full: Mapping[Key, Tensor], objective: Mapping[int, Tensor]
) -> dict[str, float]:
    """The noise ratio over the copies in use, as a ratio of sums over copies ``(k, j)``.

    - ``xi``: ``sum |g_j^(v) - grad F(beta_v)|^2 / sum |grad F(beta_v)|^2``, the paper's assumption (centred at the
      whole objective, so it includes partition heterogeneity); the theorems need it below 1;
    - ``xi_within``: the same with ``grad F_j(beta_v)`` in the numerator, i.e. mini-batch noise only.

    ``objective[v]`` is ``grad F(beta_v)``.
    """
    num = num_within = den = 0.0
    for k in sorted(versions):
        for j, v in versions[k].items():
            g, fj, F = _vec(minibatch[(j, v)]), _vec(full[(j, v)]), _vec(objective[v])
            num += float((g - F).pow(2).sum())
            num_within += float((g - fj).pow(2).sum())
            den += float(F.pow(2).sum())
    den = max(den, 1e-300)
    return {"xi": num / den, "xi_within": num_within / den}


def _cos(a: Tensor, b: Tensor) -> float:
    return float(a @ b / max(float(a.norm() * b.norm()), 1e-300))


def copy_statistics(
    reference_weights: Tensor,
    versions: Versions,
    minibatch: Mapping[Key, Tensor],
    full: Mapping[Key, Tensor],
    objective: Mapping[int, Tensor],
) -> dict[str, float]:
    """How dependent the copies of one partition are (the review's objection to Lemma 4).

    Over every pair of distinct evaluations ``a = (j, u)``, ``b = (j, v)``, ``u != v``, of the same partition in use
    (copies of one evaluation held by several ranks are merged, their weights added):

    - ``copy_cos``: mean cosine of the raw gradients ``g_j^(u)``, ``g_j^(v)`` (stale vs fresh);
    - ``copy_noise_corr``: correlation of their errors against the whole objective,
      ``e = g_j^(v) - grad F(beta_v)`` (the factors of Lemma 4's cross terms):
      ``sum <e_a, e_b> / sqrt(sum |e_a|^2 sum |e_b|^2)``;
    - ``copy_sampling_corr``: the same with ``grad F_j`` (mini-batch noise only);
    - ``lemma4_cross_ratio``: the same-partition cross terms that Lemma 4 sets to 0, weighted as in the all-rank
      average, relative to the diagonal terms it keeps: ``sum_j sum_{a != b} W_a W_b <e_a, e_b> / sum W_a^2 |e_a|^2``
      (0 when there is no pair, e.g. fresh codes).
    """
    # Copies that are the same evaluation (j, v) (held by several ranks: fresh codes, warm-up) are one gradient:
    # merge them, adding their weights, so that only distinct evaluations form pairs.
    by_partition: dict[int, dict[int, float]] = {}
    for k in sorted(versions):
        for j, v in versions[k].items():
            slot = by_partition.setdefault(j, {})
            slot[v] = slot.get(v, 0.0) + float(reference_weights[k, j])
    cos: list[float] = []
    dot_e = sq_a = sq_b = 0.0
    dot_s = sq_sa = sq_sb = 0.0
    cross = diag = 0.0
    for j, copies in by_partition.items():
        for v, w in copies.items():
            e = _vec(minibatch[(j, v)]) - _vec(objective[v])
            diag += w * w * float(e @ e)
        for (va, wa), (vb, wb) in itertools.combinations(sorted(copies.items()), 2):
            ga, gb = _vec(minibatch[(j, va)]), _vec(minibatch[(j, vb)])
            ea, eb = ga - _vec(objective[va]), gb - _vec(objective[vb])
            sa, sb = ga - _vec(full[(j, va)]), gb - _vec(full[(j, vb)])
            cross += 2.0 * wa * wb * float(ea @ eb)
            cos.append(_cos(ga, gb))
            dot_e += float(ea @ eb)
            sq_a += float(ea @ ea)
            sq_b += float(eb @ eb)
            dot_s += float(sa @ sb)
            sq_sa += float(sa @ sa)
            sq_sb += float(sb @ sb)
    out = {"lemma4_cross_ratio": cross / max(diag, 1e-300)}
    if cos:
        out["copy_cos"] = float(np.mean(cos))
        out["copy_noise_corr"] = dot_e / max(math.sqrt(sq_a * sq_b), 1e-300)
        out["copy_sampling_corr"] = dot_s / max(math.sqrt(sq_sa * sq_sb), 1e-300)
    return out
