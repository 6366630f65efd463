"""The straggler-tolerance schemes: what each rank evaluates, sends, and how the coordinator decodes.

Every aggregate is on the *mean* scale: with fresh gradients and no stragglers
it equals ``(1/n) sum_i g_i``, what DDP applies. See ``docs/math.md``.
"""

from __future__ import annotations

import math
import numbers
import operator
from abc import ABC, abstractmethod
from typing import Any, Iterable, Mapping, Sequence

import numpy as np
import torch
from torch import Tensor

from .placements import CRPlacement, FRPlacement, OwnPlacement, Placement, fr_suggestions
from .tandon import best_tandon_b, solve_decoding_vector, tiling_b, tiling_decoding_vector

__all__ = [
    "SCHEMES",
    "WARMUPS",
    "OPTIONS",
    "Scheme",
    "DGDScheme",
    "IgnoreScheme",
    "AutoScheme",
    "GCFRScheme",
    "GCCRScheme",
    "PGCFRScheme",
    "PGCCRScheme",
    "PGCCRNaiveScheme",
    "make_scheme",
]

SCHEMES: tuple[str, ...] = ("dgd", "ignore", "gc_fr", "gc_cr", "pgc_fr", "pgc_cr", "pgc_cr_naive")
"""Public scheme names accepted by ``make_scheme``."""

WARMUPS: tuple[str, ...] = ("full", "gradual")
"""``full``: evaluate all held partitions at the first step (the paper); ``gradual``: fill one per step."""

OPTIONS: dict[str, Any] = {"warmup": "full", "seed": 0, "max_condition": 1e8}
"""Options of ``make_scheme`` and their defaults."""

_DECODE_CACHE_SIZE = 4096


def _as_int(value: Any, what: str) -> int:
    if isinstance(value, bool) or not isinstance(value, numbers.Integral):
        raise ValueError(f"{what} must be an int, got {value!r}")
    return operator.index(value)


class Scheme(ABC):
    """One straggler-tolerance scheme for ``n`` ranks tolerating ``s`` stragglers (see ``make_scheme``)."""

    name: str = ""
    pipelined: bool = False
    payload_dtype: torch.dtype = torch.float32
    reuses_codes: bool = False  # True: a code may enter aggregates of later versions (shard owners keep it)

    def __init__(self, n: int, s: int, *, warmup: str = "full", seed: int = 0, max_condition: float = 1e8) -> None:
        n = _as_int(n, "n (number of ranks)")
        s = _as_int(s, "s (tolerated stragglers)")
        if n < 2:
            raise ValueError(
                f"{self.name}: n must be >= 2 ranks, got n={n}; with one rank there is nothing to tolerate "
                "(use a single-device strategy)"
            )
        if s < 0:
            raise ValueError(f"{self.name}: s (tolerated stragglers) must be >= 0, got s={s}")
        if s >= n:
            raise ValueError(
                f"{self.name}: s must be < n; tolerating s={s} stragglers out of n={n} ranks leaves nobody "
                f"to wait for; use s <= {n - 1} (or more ranks)"
            )
        if not isinstance(warmup, str) or warmup not in WARMUPS:
            raise ValueError(f"{self.name}: warmup must be one of {list(WARMUPS)}, got {warmup!r}")
        seed = _as_int(seed, "seed")
        if (
            isinstance(max_condition, bool)
            or not isinstance(max_condition, numbers.Real)
            or not math.isfinite(float(max_condition))
            or float(max_condition) < 1.0
        ):
            raise ValueError(f"{self.name}: max_condition must be a finite number >= 1, got {max_condition!r}")
        self.n: int = n
        self.s: int = s
        self.warmup: str = warmup
        self.seed: int = seed
        self.max_condition: float = float(max_condition)
        self._validate()
        self.placement: Placement = self._make_placement()
        self.c: int = self.placement.c
        self.wait_for: int = n - s

    # ----------------------------------------------------------------- setup
    def _validate(self) -> None:
        """Scheme-specific configuration checks (raise ValueError saying what to change)."""

    @abstractmethod
    def _make_placement(self) -> Placement:
        """The data placement of this scheme."""

    # ------------------------------------------------------------- placement
    def partitions(self, worker: int) -> tuple[int, ...]:
        """Partitions held by ``worker`` (in its rotation order)."""
        return self.placement.partitions(worker)

    def holders(self, partition: int) -> tuple[int, ...]:
        """Ranks holding ``partition``."""
        return self.placement.holders(partition)

    @property
    def cache_max_age(self) -> int | None:
        """``max_age`` for this scheme's ``StaleCache``: ``c`` for pipelined schemes (staleness <= c-1), else 1."""
        return self.c if self.pipelined else 1

    @property
    def max_staleness(self) -> int:
        """Largest age (in steps) of a gradient inside a code: ``c-1`` for pipelined schemes, else 0."""
        return self.c - 1 if self.pipelined else 0

    # ------------------------------------------------------------ evaluation
    def _check_step(self, step: int, start: int) -> tuple[int, int]:
        step = _as_int(step, "step")
        start = _as_int(start, "start")
        if start < 0 or step < start:
            raise ValueError(f"need 0 <= start <= step, got start={start}, step={step}")
        return step, start

    def evaluations(self, worker: int, step: int, start: int = 0) -> tuple[int, ...]:
        """Partitions ``worker`` evaluates (fresh gradients) at ``step``; ``start`` is when its cache was empty."""
        self.placement.check_worker(worker)
        self._check_step(step, start)
        return self.partitions(worker)

    # -------------------------------------------------------------- encoding
    def _check_grads(self, worker: int, grads: Mapping[int, Tensor]) -> tuple[int, ...]:
        """Validate ``grads`` for ``worker``; return the held partitions present, in held order."""
        held = self.partitions(worker)
        extra = sorted(j for j in grads if j not in held)
        if extra:
            raise ValueError(f"{self.name}: rank {worker} does not hold partition(s) {extra}; it holds {list(held)}")
        present = tuple(j for j in held if j in grads)
        numel = None
        for j in present:
            g = grads[j]
            if not isinstance(g, Tensor) or g.dim() != 1:
                raise ValueError(f"{self.name}: gradient of partition {j} must be a 1-D tensor")
            if numel is None:
                numel = g.numel()
            elif g.numel() != numel:
                raise ValueError(f"{self.name}: gradients have different sizes ({numel} vs {g.numel()})")
        return present

    def _require_all(self, worker: int, present: tuple[int, ...]) -> None:
        missing = [j for j in self.partitions(worker) if j not in present]
        if missing:
            raise ValueError(
                f"{self.name}: rank {worker} must encode all held partitions {list(self.partitions(worker))}; "
                f"missing {missing}"
            )

    def _weighted_sum(
        self, grads: Mapping[int, Tensor], coeffs: Mapping[int, float], out: Tensor | None = None
    ) -> Tensor:
        """``sum_j coeffs[j] * grads[j]`` accumulated in ``payload_dtype`` (held order, deterministic).

        ``out`` (any shape with the gradients' numel, e.g. the rows of a ready-to-send message) receives the
        result in place instead of a new tensor.
        """
        first = grads[next(iter(coeffs))]
        if out is None:
            out = torch.zeros(first.numel(), dtype=self.payload_dtype, device=first.device)
        else:
            if out.numel() != first.numel() or out.dtype != self.payload_dtype:
                raise ValueError(
                    f"{self.name}: out must hold {first.numel()} {self.payload_dtype} elements, "
                    f"got {out.numel()} {out.dtype}"
                )
        return _linear_combination(out, [(grads[j], a) for j, a in coeffs.items()])

    @abstractmethod
    def _copy_weights(self, worker: int) -> dict[int, float]:
        """Coefficient of each held partition in ``worker``'s code, assuming a full cache."""

    def code_coefficients(self, worker: int, present: Sequence[int]) -> dict[int, float]:
        """The coefficient of each held partition in ``worker``'s code when the partitions ``present`` (held order)
        are given: the code is ``sum_j a_j g_j``. A caller that lays the gradients out itself (e.g. one tensor per
        parameter) encodes with these; :meth:`encode` is the same sum over flat gradients.

        Raises:
            ValueError: the scheme cannot encode from ``present`` (e.g. a classic code needs every held partition).
        """
        self._require_all(worker, tuple(present))
        return self._copy_weights(worker)

    def encode(self, worker: int, grads: Mapping[int, Tensor], out: Tensor | None = None) -> Tensor:
        """Rank ``worker``'s code from ``grads`` (partition -> newest 1-D gradient); dtype ``payload_dtype``.

        With ``out`` the code is written there (no new tensor); see :meth:`_weighted_sum`.
        """
        self.placement.check_worker(worker)
        present = self._check_grads(worker, grads)
        return self._weighted_sum(grads, self.code_coefficients(worker, present), out)

    # -------------------------------------------------------------- decoding
    def _check_received(self, received: Iterable[int]) -> list[int]:
        ranks = list(received)
        for k in ranks:
            self.placement.check_worker(k)
        if len(set(ranks)) != len(ranks):
            raise ValueError(f"{self.name}: received ranks must be distinct, got {ranks}")
        return ranks

    def admits(self, received: Iterable[int]) -> bool:
        """Whether codes from the ranks ``received`` suffice to decode."""
        return len(set(self._check_received(set(received)))) >= self.wait_for

    def _not_admitted(self, ranks: Sequence[int]) -> ValueError:
        missing = sorted(set(range(self.n)) - set(ranks))
        return ValueError(
            f"{self.name}: cannot decode from {len(ranks)} rank(s) {sorted(ranks)}; needs {self.wait_for} of "
            f"{self.n} (missing ranks {missing})"
        )

    @abstractmethod
    def _weights(self, ranks: list[int]) -> dict[int, float]:
        """Decoding weights for admitted, validated ``ranks`` (arrival order)."""

    def decoding_weights(self, received: Sequence[int]) -> dict[int, float]:
        """Weight ``w_k`` of each received rank's code (arrival order; unused ranks get 0.0)."""
        ranks = self._check_received(received)
        if not self.admits(ranks):
            raise self._not_admitted(ranks)
        return self._weights(ranks)

    def decode(self, coded: Mapping[int, Tensor], out: Tensor | None = None) -> Tensor:
        """Aggregate ``sum_k w_k coded[k]``, summed in mapping order (the runtime passes codes in key order).

        Weights are computed in float64. Without ``out`` they are applied in float64 (a new tensor); with ``out``
        (one shard of an aggregate, in the payload's dtype) they are applied in ``out``'s dtype, in place.
        """
        weights = self.decoding_weights(list(coded))
        first = coded[next(iter(coded))]
        if out is None:
            out = torch.zeros(first.numel(), dtype=torch.float64, device=first.device)
        terms = []
        for k, w in weights.items():
            if w != 0.0:
                if coded[k].numel() != out.numel():
                    raise ValueError(f"{self.name}: codes have different sizes ({out.numel()} vs {coded[k].numel()})")
                terms.append((coded[k], w))
        return _linear_combination(out, terms)

    def copy_coefficients(self, received: Sequence[int]) -> Tensor:
        """``W[k, j]``: weight of rank ``k``'s copy of partition ``j`` in the aggregate (full caches), float64 ``[n, n]``."""
        W = torch.zeros(self.n, self.n, dtype=torch.float64)
        for k, w in self.decoding_weights(received).items():
            for j, b in self._copy_weights(k).items():
                W[k, j] = w * b
        return W

    def coefficients(self, received: Sequence[int]) -> Tensor:
        """Each partition's total weight in the aggregate (column sums of ``copy_coefficients``), float64 ``[n]``."""
        return self.copy_coefficients(received).sum(dim=0)

    def __repr__(self) -> str:
        return f"{type(self).__name__}(name={self.name!r}, n={self.n}, s={self.s}, c={self.c}, warmup={self.warmup!r})"


# --------------------------------------------------------------------- baselines
class _OwnPartitionScheme(Scheme):
    """Rank ``k`` evaluates and sends only its own partition ``k``."""

    def _make_placement(self) -> Placement:
        return OwnPlacement(self.n)

    def _copy_weights(self, worker: int) -> dict[int, float]:
        return {worker: 1.0}


class DGDScheme(_OwnPartitionScheme):
    """Synchronous distributed GD (DDP): wait for all ``n`` ranks, average their gradients."""

    name = "dgd"

    def _validate(self) -> None:
        if self.s != 0:
            raise ValueError(
                f"dgd waits for all n ranks and tolerates no stragglers, so s must be 0 (got s={self.s}); "
                "to tolerate stragglers use 'ignore' or a coded scheme (gc_fr, gc_cr, pgc_fr, pgc_cr)"
            )

    def _weights(self, ranks: list[int]) -> dict[int, float]:
        return {k: 1.0 / self.n for k in ranks}


class IgnoreScheme(_OwnPartitionScheme):
    """Ignore stragglers: average the fastest ``n-s`` (or more) gradients; biased, drops partitions."""

    name = "ignore"

    def _weights(self, ranks: list[int]) -> dict[int, float]:
        return {k: 1.0 / len(ranks) for k in ranks}


class AutoScheme(IgnoreScheme):
    """``scheme="auto"``: every rank evaluates its own partition; an aggregate averages the codes it admits.

    ``s`` is ``max_stragglers``, the most codes an aggregate may leave out. How many it does leave out at each
    version (0 under the ``dgd`` arm: every live rank's code, ddp's math) is the leader's choice
    (:class:`~lightning_pgc.decisions.auto_leader.AutoLeader`); the decode is the same for every arm, ``1/|R|`` for
    each of the ``|R|`` admitted codes, so the plan alone tells every rank what to apply. Not one of
    :data:`SCHEMES` (``make_scheme`` does not build it): the leader, not the scheme, sets the arm.
    """

    name = "auto"


# ------------------------------------------------------------ fractional repetition
class _FRScheme(Scheme):
    """FR placement; the aggregate takes the first received rank of every group with weight ``1/n``."""

    cr_alternative: str = ""

    def _validate(self) -> None:
        c = self.s + 1
        if self.n % c != 0:
            raise ValueError(
                f"{self.name} needs c = s+1 to divide n (got n={self.n}, s={self.s}, c={c}); try "
                f"{fr_suggestions(self.n, self.s)}; or use the cyclic variant {self.cr_alternative}, "
                "which works for any s < n"
            )

    def _make_placement(self) -> Placement:
        return FRPlacement(self.n, self.s + 1)

    def _copy_weights(self, worker: int) -> dict[int, float]:
        return {j: 1.0 for j in self.partitions(worker)}

    def group(self, worker: int) -> int:
        """FR group of ``worker``."""
        assert isinstance(self.placement, FRPlacement)
        return self.placement.group(worker)

    def admits(self, received: Iterable[int]) -> bool:
        ranks = set(self._check_received(set(received)))
        return {k // self.c for k in ranks} == set(range(self.n // self.c))

    def _not_admitted(self, ranks: Sequence[int]) -> ValueError:
        have = {k // self.c for k in ranks}
        missing = [g for g in range(self.n // self.c) if g not in have]
        detail = ", ".join(f"group {g} = ranks {list(range(g * self.c, g * self.c + self.c))}" for g in missing)
        return ValueError(f"{self.name}: cannot decode from ranks {sorted(ranks)}; no rank received from {detail}")

    def _weights(self, ranks: list[int]) -> dict[int, float]:
        seen: set[int] = set()
        out: dict[int, float] = {}
        for k in ranks:
            g = k // self.c
            out[k] = 0.0 if g in seen else 1.0 / self.n
            seen.add(g)
        return out


class GCFRScheme(_FRScheme):
    """Gradient coding, FR: every rank evaluates its ``c`` partitions each step and sends their sum (exact)."""

    name = "gc_fr"
    cr_alternative = "gc_cr"


class PGCFRScheme(_FRScheme):
    """Pipelined GC, FR: one rotating fresh partition per step plus ``c-1`` cached ones (offset per rank)."""

    name = "pgc_fr"
    pipelined = True
    cr_alternative = "pgc_cr"

    def evaluations(self, worker: int, step: int, start: int = 0) -> tuple[int, ...]:
        self.placement.check_worker(worker)
        step, start = self._check_step(step, start)
        held = self.partitions(worker)
        if self.warmup == "full" and step == start:
            return held
        return (held[((worker % self.c) + step) % self.c],)

    def code_coefficients(self, worker: int, present: Sequence[int]) -> dict[int, float]:
        """``(c/m) * sum`` of the ``m`` given held gradients (``m < c`` only in gradual warm-up or after expiry)."""
        return _pipelined_coefficients(self, worker, present)


# --------------------------------------------------------------- cyclic repetition
class _TandonScheme(Scheme):
    """CR placement coded with Tandon's ``B``; exact decode ``(1/n) sum a_k f_k`` with ``B_K^T a = 1``."""

    payload_dtype = torch.float64

    def _make_placement(self) -> Placement:
        return CRPlacement(self.n, self.s + 1)

    def _validate(self) -> None:
        B, worst, used = best_tandon_b(self.n, self.s, self.seed)
        if not worst <= self.max_condition:
            raise ValueError(
                f"{self.name} with n={self.n}, s={self.s}: the worst-case condition number of B_K over "
                f"received sets of n-s={self.n - self.s} ranks is {worst:.3g} > max_condition="
                f"{self.max_condition:.3g}, so decoding would lose ~{math.log10(worst):.0f} of float64's 16 digits; "
                f"lower s, use fewer ranks, or use pgc_cr / gc_fr (no decoding matrix), "
                f"or raise max_condition knowingly"
            )
        B.setflags(write=False)
        self.B: np.ndarray = B
        self.worst_condition: float = worst
        self.b_seed: int = used
        self._decode_cache: dict[tuple[int, ...], np.ndarray] = {}

    def _copy_weights(self, worker: int) -> dict[int, float]:
        return {j: float(self.B[worker, j]) for j in self.partitions(worker)}

    def decoding_vector(self, ranks: Sequence[int]) -> np.ndarray:
        """``a`` (float64, aligned with ``sorted(ranks)``) solving ``B_K^T a = 1`` for exactly ``n-s`` ranks.

        Raises:
            ValueError: ``cond(B_K) > max_condition`` (possible only where the worst case was sampled, not
                enumerated, when the scheme was built) or ``B_K`` numerically singular.
        """
        key = tuple(sorted(ranks))
        a = self._decode_cache.get(key)
        if a is None:
            a = solve_decoding_vector(self.B, key, max_condition=self.max_condition)
            if len(self._decode_cache) >= _DECODE_CACHE_SIZE:
                self._decode_cache.pop(next(iter(self._decode_cache)))
            self._decode_cache[key] = a
        return a

    def _weights(self, ranks: list[int]) -> dict[int, float]:
        used = ranks[: self.n - self.s]
        a = self.decoding_vector(used)
        by_rank = dict(zip(sorted(used), a.tolist()))
        return {k: (by_rank[k] / self.n if k in by_rank else 0.0) for k in ranks}


class GCCRScheme(_TandonScheme):
    """Gradient coding, CR (Tandon et al. 2017): every rank evaluates its ``c`` partitions, sends ``sum_j B[k,j] g_j``.

    Where ``c`` divides ``n``, ``B`` is :func:`~lightning_pgc.codes.tandon.tiling_b` (unit coefficients; any
    ``n - s`` ranks hold a whole tiling, decoded with weights 0 and 1: exact at any ``n``, built in ``O(n c)``);
    otherwise Tandon's random construction (:func:`~lightning_pgc.codes.tandon.best_tandon_b`, a search over
    received sets whose worst condition number grows with ``n`` and ``s``). ``construction`` says which.
    """

    name = "gc_cr"

    def _validate(self) -> None:
        if self.s == 0 or self.n % (self.s + 1):
            self.construction: str = "tandon"
            super()._validate()
            return
        self.construction = "tiling"
        B = tiling_b(self.n, self.s)
        B.setflags(write=False)
        self.B = B
        self.worst_condition = 1.0  # decoding weights are 0 and 1: no amplification of the payload's rounding
        self.b_seed = -1
        self._decode_cache = {}

    def decoding_vector(self, ranks: Sequence[int]) -> np.ndarray:
        if self.construction == "tiling":
            return tiling_decoding_vector(self.n, self.s, ranks)
        return super().decoding_vector(ranks)


class PGCCRNaiveScheme(_TandonScheme):
    """Naive pipelined CR: Tandon codes of cached (stale) gradients; decoding weights amplify staleness (paper Fig. 6)."""

    name = "pgc_cr_naive"
    pipelined = True

    def _validate(self) -> None:
        if self.warmup != "full":
            raise ValueError(
                "pgc_cr_naive needs all c held gradients in every code (Tandon's B has no partial-sum rescale); "
                "use warmup='full'"
            )
        super()._validate()

    @property
    def cache_max_age(self) -> int | None:
        """``None``: the naive code needs every held gradient, so cache entries never expire."""
        return None

    def evaluations(self, worker: int, step: int, start: int = 0) -> tuple[int, ...]:
        return _cr_rotation(self, worker, step, start)


class PGCCRScheme(Scheme):
    """Pipelined CR (the paper's design): plain sums of cached gradients, aggregate ``(mu/n) sum_{k in R} f_k``."""

    name = "pgc_cr"
    pipelined = True

    def _make_placement(self) -> Placement:
        return CRPlacement(self.n, self.s + 1)

    def _copy_weights(self, worker: int) -> dict[int, float]:
        return {j: 1.0 for j in self.partitions(worker)}

    def evaluations(self, worker: int, step: int, start: int = 0) -> tuple[int, ...]:
        return _cr_rotation(self, worker, step, start)

    def code_coefficients(self, worker: int, present: Sequence[int]) -> dict[int, float]:
        """``(c/m) * sum`` of the ``m`` given held gradients (``m < c`` only in gradual warm-up or after expiry)."""
        return _pipelined_coefficients(self, worker, present)

    def mu(self, num_received: int) -> float:
        """``mu = n / (|R| c)``; ``n / ((n-s) c)`` when exactly ``n-s`` codes are received."""
        return self.n / (num_received * self.c)

    def _weights(self, ranks: list[int]) -> dict[int, float]:
        w = self.mu(len(ranks)) / self.n
        return {k: w for k in ranks}


# ----------------------------------------------------------------------- helpers
def _linear_combination(out: Tensor, terms: Sequence[tuple[Tensor, float]]) -> Tensor:
    """``out = sum_i a_i t_i`` in ``out``'s dtype and shape, in the given order, in place.

    The first term is written (copy or multiply) rather than added to zeros: one pass less over a payload-sized
    buffer, same bits (``0 + a t`` rounds like ``a t``). A first term of weight 1 and the second, both of ``out``'s
    dtype, are written by one ``add`` (``t_0 + a_1 t_1``, the kernel that adding ``t_1`` to a copy of ``t_0`` runs):
    one pass less again. Terms of another dtype are converted one at a time.
    """
    if not terms:
        return out.zero_()

    def shaped(t: Tensor) -> Tensor:  # (one term converted at a time: no payload-sized temporaries held at once)
        return t.reshape(-1).to(out.dtype).view(out.shape)

    t0, a0 = terms[0]
    start = 1
    if a0 == 1.0 and len(terms) > 1 and t0.dtype == out.dtype and terms[1][0].dtype == out.dtype:
        torch.add(shaped(t0), shaped(terms[1][0]), alpha=terms[1][1], out=out)
        start = 2
    elif a0 == 1.0:
        out.copy_(shaped(t0))
    else:
        torch.mul(shaped(t0), a0, out=out)
    for t, a in terms[start:]:
        out.add_(shaped(t), alpha=a)
    return out


def _cr_rotation(scheme: Scheme, worker: int, step: int, start: int) -> tuple[int, ...]:
    """CR rotation: held position ``step % c``, i.e. partition ``(worker + step % c) % n`` (one fresh holder per partition)."""
    scheme.placement.check_worker(worker)
    step, start = scheme._check_step(step, start)
    held = scheme.partitions(worker)
    if scheme.warmup == "full" and step == start:
        return held
    return (held[step % scheme.c],)


def _pipelined_coefficients(scheme: Scheme, worker: int, present: Sequence[int]) -> dict[int, float]:
    """``c/m`` for each of the ``m >= 1`` given cached gradients; the rescale keeps the code on the full-sum scale."""
    if not present:
        raise ValueError(
            f"{scheme.name}: rank {worker} has no gradient to encode; give at least one of "
            f"{list(scheme.partitions(worker))}"
        )
    scale = scheme.c / len(present)
    return {j: scale for j in present}


_CLASSES: dict[str, type[Scheme]] = {
    cls.name: cls
    for cls in (DGDScheme, IgnoreScheme, GCFRScheme, GCCRScheme, PGCFRScheme, PGCCRScheme, PGCCRNaiveScheme)
}
assert tuple(_CLASSES) == SCHEMES


def make_scheme(name: str, n: int, s: int, **options: Any) -> Scheme:
    """Build scheme ``name`` for ``n`` ranks tolerating ``s`` stragglers; options: warmup, seed, max_condition."""
    key = name.strip().lower() if isinstance(name, str) else None
    if key not in _CLASSES:
        raise ValueError(f"unknown scheme {name!r}; valid schemes: {', '.join(SCHEMES)}")
    unknown = sorted(set(options) - set(OPTIONS))
    if unknown:
        raise ValueError(
            f"unknown option(s) {unknown} for scheme {key!r}; valid options: "
            + ", ".join(f"{k} (default {v!r})" for k, v in OPTIONS.items())
        )
    return _CLASSES[key](n, s, **options)
