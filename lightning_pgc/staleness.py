"""Staleness corrections: how the pipelined schemes and ``bounded`` compensate for the age of the gradients they reuse.

Pure tensor math on flat parameter and gradient vectors (no Lightning, no ``torch.distributed``);
:class:`~lightning_pgc.PGCStrategy` calls it at three points of a step (``coding={"staleness_correction": ...}``):

- ``"momentum"`` (momentum accounting): the window of ages ``0..c-1`` is implicit momentum
  ``mu_c = D / (1 + D)``, ``D`` the window's mean age (:func:`nominal_mean_age`); at fit start the optimizer's
  momentum ``m`` (SGD's ``momentum``, Adam-style ``betas[0]``) is replaced by ``max(0, m - mu_c)``
  (:func:`accounted_momentum`), so that explicit plus implicit momentum is what the user chose;
- ``"lookahead"``: the fresh gradient is evaluated at ``beta_t + k (beta_t - beta_(t-1))``
  (:meth:`StalenessCorrection.shifted`); by default (:func:`default_lookahead`) ``k = c - 1``, the window's oldest age,
  for the pipelined schemes (it needed fewer steps than ``k = D`` on the quadratic model and in every measurement of
  both) and ``k = D`` for ``bounded`` (each gradient's mean age of use is then zero);
- ``"delay_compensation"``: every cached entry of age ``t - v > 0`` is sent as
  ``g + lam * g * g * (beta_t - beta_v)`` (:func:`delay_compensate`), the diagonal ``g * g`` standing in for the
  Hessian. It keeps the parameters of the last ``c`` versions (the versions a cached entry can have).

Every replica applies the same aggregates, so ``beta_t - beta_v`` is known locally, with no communication. The
theory (stability boundaries and rates on the quadratic model) is in ``benchmarks/pgc_lab/corrections.py`` (in the repository) and
``docs/results/theory.md``.
"""

from __future__ import annotations

import logging
from contextlib import contextmanager
from typing import Any, Iterator, Mapping, Optional, Sequence

import torch
from torch import Tensor

__all__ = [
    "CORRECTIONS",
    "StalenessCorrection",
    "accounted_momentum",
    "check_applies",
    "default_lookahead",
    "delay_compensate",
    "implicit_momentum",
    "nominal_mean_age",
    "set_momentum",
]

log = logging.getLogger(__name__)

#: The values of ``PGCStrategy(coding={"staleness_correction": ...})`` (:class:`~lightning_pgc.CodingOptions`).
CORRECTIONS: tuple[str, ...] = ("none", "momentum", "lookahead", "delay_compensation")
#: Schemes whose codes hold reused (stale) gradients, and so accept a correction.
STALE_SCHEMES: tuple[str, ...] = ("pgc_fr", "pgc_cr", "pgc_cr_naive", "bounded")


def check_applies(kind: str, scheme: str) -> None:
    """Raise if correction ``kind`` cannot be applied to the scheme named ``scheme``.

    Raises:
        ValueError: delay compensation under ``bounded`` (a rank sends only its fresh gradient there and the
            aggregator reuses the stale ones, so no rank holds a stale entry to correct).
    """
    if kind == "delay_compensation" and scheme == "bounded":
        raise ValueError(
            "staleness_correction='delay_compensation' corrects the stale entries a rank encodes; under "
            "scheme='bounded' a rank sends only its fresh gradient and the aggregator reuses the stale "
            "ones: use 'momentum' or 'lookahead'"
        )


def nominal_mean_age(scheme: Any) -> float:
    """Mean age of the gradients in an aggregate when the arrivals are as the scheme plans them.

    Pipelined schemes (``pgc_fr``, ``pgc_cr``, ``pgc_cr_naive``): every code holds one gradient of each age
    ``0..c-1``, mean ``(c - 1) / 2``. ``bounded`` (round robin): a version closes on ``fresh`` fresh codes and the
    other ``n - fresh`` partitions come from the version before, mean ``(n - fresh) / n`` (capped at the window's
    ``c - 1``). Stragglers beyond the plan make the real ages larger.
    """
    if getattr(scheme, "name", "") == "bounded":
        return min(float(scheme.n - scheme.wait_for) / scheme.n, float(scheme.window - 1))
    if getattr(scheme, "pipelined", False):
        return (scheme.c - 1) / 2.0
    raise ValueError(f"scheme {getattr(scheme, 'name', scheme)!r} uses fresh gradients only: no staleness to correct")


def default_lookahead(scheme: Any) -> float:
    """``k`` of ``"lookahead"`` when ``lookahead_steps`` is not given: ``c - 1`` (the window's oldest age) for the
    pipelined schemes, the nominal mean age (:func:`nominal_mean_age`) for ``bounded``.

    On the quadratic model (``docs/results/theory.md``, section 7) ``k = c - 1`` converges faster than ``k = (c - 1) / 2`` at
    ``c = 2`` and ``c = 4``, and it needed fewer steps to target in the measurements of both (4 real ranks, c = 2;
    the emulated cluster, c = 2 and 4). ``bounded`` was measured with its mean age only.
    """
    if getattr(scheme, "name", "") == "bounded":
        return nominal_mean_age(scheme)
    if getattr(scheme, "pipelined", False):
        return float(scheme.c - 1)
    raise ValueError(f"scheme {getattr(scheme, 'name', scheme)!r} uses fresh gradients only: no staleness to correct")


def implicit_momentum(mean_age: float) -> float:
    """``mu = D / (1 + D)``: the heavy-ball momentum whose geometric weights have the window's mean age ``D``
    (``mu / (1 - mu) = D``); for the pipeline's uniform window ``(c - 1) / (c + 1)``."""
    if mean_age < 0:
        raise ValueError(f"mean age must be >= 0, got {mean_age}")
    return mean_age / (1.0 + mean_age)


def accounted_momentum(momentum: float, mean_age: float) -> float:
    """The explicit momentum that, added to the window's implicit momentum, gives ``momentum``: ``max(0, m - mu)``.

    Clipped at 0 (torch's optimizers refuse negative momentum). See ``docs/results/theory.md`` for the derivation and what it
    does to the stability boundary and to the rate on the quadratic model.
    """
    if not 0.0 <= momentum < 1.0:
        raise ValueError(f"momentum must be in [0, 1), got {momentum}")
    return max(0.0, momentum - implicit_momentum(mean_age))


def set_momentum(optimizer: torch.optim.Optimizer, mean_age: float) -> list[tuple[float, float]]:
    """Apply :func:`accounted_momentum` to every param group of ``optimizer``; returns ``(chosen, applied)`` per group.

    SGD-style groups have ``momentum``, Adam-style ones ``betas`` (its first entry is the momentum). The value the
    user chose is kept in the group as ``pgc_momentum`` (it travels with the optimizer's state dict), so a fit that
    resumes from a checkpoint applies the rule to the chosen value again, not to the already reduced one.

    Raises:
        ValueError: a param group has neither ``momentum`` nor ``betas``.
    """
    changes = []
    for i, group in enumerate(optimizer.param_groups):
        if "momentum" in group:
            key = "momentum"
            chosen = float(group.get("pgc_momentum", group["momentum"]))
        elif "betas" in group:
            key = "betas"
            chosen = float(group.get("pgc_momentum", group["betas"][0]))
        else:
            raise ValueError(
                f"staleness_correction='momentum' adjusts the optimizer's momentum, but param group {i} of "
                f"{type(optimizer).__name__} has neither 'momentum' nor 'betas'; use 'lookahead' or "
                "'delay_compensation' with this optimizer"
            )
        applied = accounted_momentum(chosen, mean_age)
        group["pgc_momentum"] = chosen
        if key == "momentum":
            group["momentum"] = applied
        else:
            group["betas"] = (applied, *tuple(group["betas"])[1:])
        changes.append((chosen, applied))
    return changes


def delay_compensate(grad: Tensor, displacement: Tensor, lam: float) -> Tensor:
    """``g + lam * g * g * d``: a gradient computed at ``beta_v`` moved to ``beta_t = beta_v + d`` (a new tensor).

    ``g * g`` is the diagonal stand-in for the Hessian: on a log-likelihood loss its expectation over mini-batches
    is the diagonal of the Fisher information, which equals the Hessian's at the optimum.
    """
    return torch.addcmul(grad, grad * displacement.to(grad.dtype), grad, value=float(lam))


def flat_parameters(params: Sequence[Tensor]) -> Tensor:
    """A float32 CPU copy of the parameters, flattened in order."""
    if not params:
        return torch.zeros(0)
    return torch.cat([p.detach().reshape(-1).to("cpu", torch.float32) for p in params])


class StalenessCorrection:
    """The per-rank state of one correction: parameter snapshots by version, the look-ahead shift.

    Args:
        kind: one of :data:`CORRECTIONS`.
        mean_age: the window's mean age ``D`` (:func:`nominal_mean_age`).
        lookahead: ``k``, steps of extrapolation for ``"lookahead"`` (default ``D``: mean age of use zero;
            :meth:`for_fit` uses :func:`default_lookahead` instead).
        dc_lambda: ``lam`` of ``"delay_compensation"``.
        window: how many versions back a cached entry can be (``c``): older snapshots are dropped.
    """

    def __init__(
        self, kind: str, mean_age: float, *, lookahead: Optional[float] = None, dc_lambda: float = 0.04, window: int = 2
    ) -> None:
        if kind not in CORRECTIONS:
            raise ValueError(f"staleness_correction must be one of {', '.join(CORRECTIONS)}, got {kind!r}")
        self.kind = kind
        self.mean_age = float(mean_age)
        self.lookahead = self.mean_age if lookahead is None else float(lookahead)
        self.dc_lambda = float(dc_lambda)
        self.window = int(window)
        self._snapshots: dict[int, Tensor] = {}  # version -> flat parameters at that version

    @classmethod
    def for_fit(
        cls,
        kind: str,
        scheme: Any,
        optimizers: Sequence[torch.optim.Optimizer],
        *,
        lookahead: Optional[float] = None,
        dc_lambda: float = 0.04,
    ) -> "StalenessCorrection":
        """The correction for one fit of ``scheme``; under ``"momentum"`` it adjusts ``optimizers`` now
        (:func:`set_momentum`, identical on every rank)."""
        if kind == "none":
            return cls("none", 0.0)
        check_applies(kind, getattr(scheme, "name", ""))
        mean_age = nominal_mean_age(scheme)
        if kind == "momentum":
            for optimizer in optimizers:
                for chosen, applied in set_momentum(optimizer, mean_age):
                    log.info(
                        "PGC momentum accounting: momentum %.4g -> %.4g (window mean age %.3g)",
                        chosen,
                        applied,
                        mean_age,
                    )
        window = scheme.window if getattr(scheme, "name", "") == "bounded" else scheme.c
        if kind == "lookahead" and lookahead is None:
            lookahead = default_lookahead(scheme)
        return cls(kind, mean_age, lookahead=lookahead, dc_lambda=dc_lambda, window=window)

    # ------------------------------------------------------------------------------------------ per step
    def begin_step(self, version: int, params: Sequence[Tensor]) -> None:
        """Record ``beta_version`` (the parameters before this step's update) if the correction needs it.

        Called where the parameters are ``beta_version``: when the rank computes a gradient for ``version`` or
        applies a published aggregate without computing. A rank catching up by state transfer records nothing
        meanwhile: it then has no ``beta_(t-1)`` to look ahead with, and sends entries of versions it has no
        parameters for uncorrected.
        """
        if self.kind not in ("lookahead", "delay_compensation"):
            return
        keep = 2 if self.kind == "lookahead" else self.window
        for v in [v for v in self._snapshots if v <= version - keep or v > version]:
            del self._snapshots[v]  # too old to be needed, or from before a rejoin / resume
        self._snapshots[version] = flat_parameters(params)

    @property
    def snapshots(self) -> int:
        """Parameter vectors kept (the memory cost, besides the model)."""
        return len(self._snapshots)

    def displacement(self, version: int, since: int) -> Optional[Tensor]:
        """``beta_version - beta_since`` from the snapshots (None if either is missing)."""
        now, then = self._snapshots.get(version), self._snapshots.get(since)
        if now is None or then is None:
            return None
        return now - then

    @contextmanager
    def shifted(self, version: int, params: Sequence[Tensor]) -> Iterator[None]:
        """Under ``"lookahead"``: the parameters are ``beta_t + k (beta_t - beta_(t-1))`` inside the block and exactly
        ``beta_t`` again after it (restored from the snapshot, bit for bit). Otherwise does nothing.

        Without ``beta_(t-1)`` (the first step of a fit, after a rejoin) there is no shift.
        """
        delta = self.displacement(version, version - 1) if self.kind == "lookahead" else None
        if delta is None or self.lookahead == 0.0:
            yield
            return
        saved = [p.detach().clone() for p in params]
        with torch.no_grad():
            offset = 0
            for p in params:
                n = p.numel()
                p.add_(delta[offset : offset + n].view_as(p).to(device=p.device, dtype=p.dtype), alpha=self.lookahead)
                offset += n
        try:
            yield
        finally:
            with torch.no_grad():
                for p, old in zip(params, saved):
                    p.copy_(old)

    def compensate(
        self, entries: Mapping[int, Tensor], versions: Mapping[int, int], version: int, numel: int
    ) -> dict[int, Tensor]:
        """Under ``"delay_compensation"``: the entries to encode, each stale one (``versions[j] < version``) replaced
        by a corrected copy of its first ``numel`` values (the gradient; the tail, loss and padding, is kept).
        Fresh entries and every entry under other corrections are returned as they are (not copied).
        """
        if self.kind != "delay_compensation":
            return dict(entries)
        out: dict[int, Tensor] = {}
        for j, g in entries.items():
            v = versions[j]
            d = self.displacement(version, v) if v < version else None
            if d is None:
                out[j] = g
                continue
            fixed = g.clone()
            fixed[:numel] = delay_compensate(g[:numel], d[:numel], self.dc_lambda)
            out[j] = fixed
        return out

    def reset(self) -> None:
        self._snapshots.clear()

    def state_dict(self) -> dict[str, Any]:
        """The snapshots by version (a rank that rejoins by state transfer looks ahead from its first step)."""
        return {"kind": self.kind, "snapshots": dict(self._snapshots)}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if state["kind"] != self.kind:
            raise ValueError(f"a {state['kind']!r} staleness correction's state cannot load into a {self.kind!r} one")
        self._snapshots = dict(state["snapshots"])
