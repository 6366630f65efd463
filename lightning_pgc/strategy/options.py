"""The checks of :class:`~lightning_pgc.PGCStrategy`'s constructor arguments: a bad value fails at construction
with an error that names the parameter, not later inside a rank."""

from __future__ import annotations

from numbers import Integral, Real
from typing import Any, Optional, Union

from lightning_pgc.codes import CHOICES, SCHEMES
from lightning_pgc.runtime.group import DATA_BACKENDS
from lightning_pgc.staleness import CORRECTIONS, STALE_SCHEMES, check_applies

#: Scheme names PGCStrategy accepts: the coded schemes plus ``bounded`` (:class:`~lightning_pgc.codes.BoundedScheme`)
#: and ``auto`` (:class:`~lightning_pgc.codes.AutoScheme`: the leader chooses the arm).
STRATEGY_SCHEMES: tuple[str, ...] = SCHEMES + ("bounded", "auto")


def check_options(
    *,
    scheme: str,
    stragglers: int,
    replication: Optional[int],
    staleness: Optional[int],
    fresh: Optional[int],
    widen_after: Optional[float],
    max_staleness: Optional[int],
    choice: Optional[str],
    warmup: str,
    timeout: float,
    max_lag: Optional[int],
    heartbeat_interval: float,
    heartbeat_misses: int,
    nonfinite: str,
    seed: int,
    diagnostics: bool,
    diagnostics_every: int,
    max_condition: float,
    failover: Optional[bool] = None,
    staleness_correction: str = "none",
    lookahead_steps: Optional[float] = None,
    dc_lambda: Optional[float] = None,
    data_backend: Optional[str] = None,
    max_stragglers: Optional[int] = None,
    auto_margin: Optional[float] = None,
    auto_patience: Optional[int] = None,
    auto_window: Optional[int] = None,
) -> None:
    """Check PGCStrategy's own arguments (types first, then values).

    Raises:
        TypeError: an argument has the wrong type (``PGCStrategy(timeout="5m")``).
        ValueError: an argument is out of range, or a ``bounded``-only one is given to another scheme.
    """
    _check_type("scheme", scheme, str)
    _check_type("stragglers", stragglers, Integral)
    _check_type("warmup", warmup, str)
    _check_type("timeout", timeout, Real)
    _check_type("max_lag", max_lag, (Integral, type(None)))
    _check_type("seed", seed, Integral)
    _check_type("diagnostics", diagnostics, bool)
    _check_type("diagnostics_every", diagnostics_every, Integral)
    _check_type("max_condition", max_condition, Real)
    _check_type("heartbeat_interval", heartbeat_interval, Real)
    _check_type("heartbeat_misses", heartbeat_misses, Integral)
    _check_type("nonfinite", nonfinite, str)
    for name, value in (
        ("replication", replication),
        ("staleness", staleness),
        ("fresh", fresh),
        ("max_staleness", max_staleness),
    ):
        _check_type(name, value, (Integral, type(None)))
    _check_type("widen_after", widen_after, (Real, type(None)))
    _check_type("choice", choice, (str, type(None)))
    _check_type("failover", failover, (bool, type(None)))
    _check_type("data_backend", data_backend, (str, type(None)))
    if scheme not in STRATEGY_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(STRATEGY_SCHEMES)}")
    _check_auto(scheme, stragglers, max_stragglers, auto_margin, auto_patience, auto_window)
    if data_backend is not None and data_backend not in DATA_BACKENDS:
        raise ValueError(f"data_backend must be one of {', '.join(DATA_BACKENDS)} or None, got {data_backend!r}")
    if stragglers < 0:
        raise ValueError(f"stragglers must be >= 0, got {stragglers}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    bounded_args = {
        "replication": replication,
        "staleness": staleness,
        "fresh": fresh,
        "widen_after": widen_after,
        "max_staleness": max_staleness,
        "choice": choice,
    }
    if scheme != "bounded" and any(v is not None for v in bounded_args.values()):
        given = sorted(k for k, v in bounded_args.items() if v is not None)
        raise ValueError(f"{given} apply to scheme='bounded' only (scheme={scheme!r} uses `stragglers`)")
    if widen_after is not None and widen_after < 0:
        raise ValueError(f"widen_after must be >= 0 seconds or None, got {widen_after}")
    if choice is not None and choice not in CHOICES:
        raise ValueError(f"choice must be one of {', '.join(CHOICES)}, got {choice!r}")
    if max_staleness is not None and max_staleness < (2 if staleness is None else staleness):
        raise ValueError(f"max_staleness ({max_staleness}) must be >= staleness ({staleness})")
    if warmup not in ("full", "gradual"):
        raise ValueError(f"warmup must be 'full' or 'gradual', got {warmup!r}")
    if scheme == "pgc_cr_naive" and warmup != "full":
        raise ValueError("pgc_cr_naive decodes Tandon codes and needs every cache entry: use warmup='full'")
    if timeout <= 0:
        raise ValueError(f"timeout must be positive seconds, got {timeout}")
    if heartbeat_interval <= 0 or heartbeat_misses < 1:
        raise ValueError(
            f"need heartbeat_interval > 0 and heartbeat_misses >= 1, got {heartbeat_interval} and {heartbeat_misses}"
        )
    if nonfinite not in ("skip", "raise"):
        raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
    if max_lag is not None and max_lag < 1:
        raise ValueError(f"max_lag must be >= 1 or None, got {max_lag}")
    if diagnostics_every < 1:
        raise ValueError(f"diagnostics_every must be >= 1, got {diagnostics_every}")
    _check_correction(scheme, staleness_correction, lookahead_steps, dc_lambda)


#: ``scheme="auto"``'s arguments and their defaults (``PGCStrategy`` docstring).
AUTO_DEFAULTS: dict[str, Any] = {"max_stragglers": 1, "auto_margin": 0.1, "auto_patience": 10, "auto_window": 30}


def _check_auto(scheme: str, stragglers: int, max_stragglers: Any, margin: Any, patience: Any, window: Any) -> None:
    """``scheme="auto"``'s own arguments (None: the default of :data:`AUTO_DEFAULTS`)."""
    given = {"max_stragglers": max_stragglers, "auto_margin": margin, "auto_patience": patience, "auto_window": window}
    for name, value in given.items():
        _check_type(name, value, (Real if name == "auto_margin" else Integral, type(None)))
    if scheme != "auto" and any(v is not None for v in given.values()):
        named = sorted(k for k, v in given.items() if v is not None)
        raise ValueError(f"{named} apply to scheme='auto' only (scheme={scheme!r} uses `stragglers`)")
    if scheme == "auto" and stragglers != 1:
        raise ValueError(
            f"scheme='auto' chooses s itself, up to max_stragglers: pass max_stragglers={stragglers}, not stragglers"
        )
    if max_stragglers is not None and max_stragglers < 1:
        raise ValueError(f"max_stragglers must be >= 1, got {max_stragglers}")
    if margin is not None and not 0 < margin < 1:
        raise ValueError(f"auto_margin must be in (0, 1), got {margin}")
    for name, value in (("auto_patience", patience), ("auto_window", window)):
        if value is not None and value < 1:
            raise ValueError(f"{name} must be >= 1, got {value}")


def _check_correction(scheme: str, kind: Any, lookahead_steps: Any, dc_lambda: Any) -> None:
    """``staleness_correction`` and its parameters (:mod:`lightning_pgc.staleness`)."""
    _check_type("staleness_correction", kind, str)
    _check_type("lookahead_steps", lookahead_steps, (Real, type(None)))
    _check_type("dc_lambda", dc_lambda, (Real, type(None)))
    if kind not in CORRECTIONS:
        raise ValueError(f"staleness_correction must be one of {', '.join(CORRECTIONS)}, got {kind!r}")
    if kind != "none" and scheme not in STALE_SCHEMES:
        raise ValueError(
            f"staleness_correction={kind!r}: scheme {scheme!r} uses fresh gradients only, there is no "
            f"staleness to correct (the corrections apply to {', '.join(STALE_SCHEMES)})"
        )
    check_applies(kind, scheme)
    if lookahead_steps is not None and (kind != "lookahead" or lookahead_steps < 0):
        raise ValueError(
            f"lookahead_steps must be >= 0 and applies to staleness_correction='lookahead' only, got "
            f"{lookahead_steps} with {kind!r}"
        )
    if dc_lambda is not None and (kind != "delay_compensation" or dc_lambda < 0):
        raise ValueError(
            f"dc_lambda must be >= 0 and applies to staleness_correction='delay_compensation' only, got "
            f"{dc_lambda} with {kind!r}"
        )


def _check_type(name: str, value: Any, types: Union[type, tuple[type, ...]]) -> None:
    """A ``TypeError`` that names the parameter (``PGCStrategy(timeout="5m")``); ``bool`` is no number here."""
    allowed = types if isinstance(types, tuple) else (types,)
    if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
        spelled = {Integral: "int", Real: "float", type(None): "None"}
        names = " or ".join(spelled.get(t, t.__name__) for t in allowed)
        raise TypeError(f"PGCStrategy({name}=...) must be {names}, got {type(value).__name__} {value!r}")
