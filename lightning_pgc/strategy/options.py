"""PGCStrategy's option groups: frozen, typed dataclasses, one per concept, each checking its own fields.

:class:`~lightning_pgc.PGCStrategy` takes each group as the dataclass or as a plain dict of its fields
(``PGCStrategy(coordinator={"staleness": 3})``, or nested YAML under LightningCLI). A bad value fails at
construction with an error that names the option (``coordinator.staleness``), not later inside a rank; an unknown
key in a dict is refused. :func:`check_options` then checks what depends on the scheme (an option of ``bounded``
given to another scheme, a correction for a scheme without stale gradients).

No Lightning and no ``torch.distributed`` here: the groups can be built, compared and printed anywhere.
"""

from __future__ import annotations

import math
from dataclasses import MISSING, dataclass, fields
from numbers import Integral, Real
from typing import Any, ClassVar, Literal, Mapping, Optional, TypeVar, Union

from lightning_pgc.codes import CHOICES, SCHEMES, WARMUPS
from lightning_pgc.staleness import CORRECTIONS, STALE_SCHEMES, check_applies

__all__ = [
    "AutoOptions",
    "CodingOptions",
    "CoordinatorOptions",
    "DiagnosticsOptions",
    "GROUPS",
    "LivenessOptions",
    "STRATEGY_SCHEMES",
    "as_group",
    "check_options",
]

#: Scheme names PGCStrategy accepts: the coded schemes plus ``bounded`` (:class:`~lightning_pgc.codes.BoundedScheme`)
#: and ``auto`` (:class:`~lightning_pgc.codes.AutoScheme`: the leader chooses the arm).
STRATEGY_SCHEMES: tuple[str, ...] = SCHEMES + ("bounded", "auto")


class _Group:
    """What the groups share: the parameter name they are passed as, and the checks of their fields."""

    group: ClassVar[str]  # PGCStrategy's parameter (and the YAML key) this group is passed as

    def _type(self, name: str, types: Union[type, tuple[type, ...]]) -> None:
        """A ``TypeError`` that names the option (``liveness.timeout``); ``bool`` is no number here."""
        value = getattr(self, name)
        allowed = types if isinstance(types, tuple) else (types,)
        if (isinstance(value, bool) and bool not in allowed) or not isinstance(value, allowed):
            spelled = {Integral: "int", Real: "float", type(None): "None"}
            names = " or ".join(spelled.get(t, t.__name__) for t in allowed)
            raise TypeError(f"{self.group}.{name} must be {names}, got {type(value).__name__} {value!r}")

    def _fail(self, name: str, need: str) -> None:
        raise ValueError(f"{self.group}.{name} must be {need}, got {getattr(self, name)!r}")

    def _one_of(self, name: str, values: tuple[str, ...]) -> None:
        self._type(name, str)
        if getattr(self, name) not in values:
            self._fail(name, "one of " + ", ".join(repr(v) for v in values))

    def changed(self) -> dict[str, Any]:
        """The fields that differ from their defaults (what a user set)."""
        out = {}
        for f in fields(self):  # type: ignore[arg-type]
            value = getattr(self, f.name)
            if f.default is MISSING or value != f.default:
                out[f.name] = value
        return out


@dataclass(frozen=True, kw_only=True)
class CoordinatorOptions(_Group):
    """The bounded-staleness coordinator (``scheme="bounded"`` only; ``docs/results/bounded_staleness.md``).

    The leader keeps, for every partition, the newest gradient received and the version it was computed at, and
    closes version ``t`` once every partition has an entry younger than the window ``c`` (``staleness``).

    Args:
        replication: copies ``r`` of each partition (rank ``k`` holds ``k, ..., k+r-1 mod n``). Raise it if
            ``pgc/bounded/coverage_waits`` grow because both holders of a partition are slow at once.
        staleness: the window ``c``; a version uses per partition the newest gradient with age ``< c``. Raise it if
            coverage waits dominate ``pgc/bounded/coverage_wait_s``; lower it if ``pgc/bounded/stale_fresh_cos``
            drops or the loss rises against ``dgd``. Every rank keeps its last ``c`` gradients (``c`` payloads of
            memory) to announce them again to a new leader.
        fresh: codes of the open version the leader waits for before closing it; ``None``: ``n - r + 1``. Lower it to
            step on the fastest ranks' gradients (more staleness), raise it for fresher ones.
        widen_after: seconds of coverage wait after which the leader widens ``c`` by one (logged,
            ``pgc/bounded/widened``), up to ``max_staleness``; ``None`` only waits.
        max_staleness: the largest ``c`` widening may reach; ``None``: ``2 * staleness``.
        choice: which held partition a rank evaluates. ``"round_robin"``: held position ``t mod r``, so when every
            rank reports each partition is evaluated once per step. ``"oldest"``: the one whose table entry was
            oldest when ``t - 1`` closed (ties by round robin); the loader then fetches the mini-batches of all
            ``r`` held partitions per step (one is computed). With ``r = 2`` on the digits job both trained alike
            (``docs/results/bounded_staleness.md``) and ``"round_robin"`` loads less. Under ``"oldest"``,
            ``pgc/bounded/duplicates`` growing by about one per step means ranks compute the same partition for the
            same version (several holders chasing one stale partition, possible with ``r >= 3``): go back to
            ``"round_robin"``.
    """

    group: ClassVar[str] = "coordinator"

    replication: int = 2
    staleness: int = 2
    fresh: Optional[int] = None
    widen_after: Optional[float] = None
    max_staleness: Optional[int] = None
    choice: Literal["round_robin", "oldest"] = "round_robin"

    def __post_init__(self) -> None:
        for name in ("replication", "staleness"):
            self._type(name, Integral)
            if getattr(self, name) < 1:
                self._fail(name, "an int >= 1")
        for name in ("fresh", "max_staleness"):
            self._type(name, (Integral, type(None)))
        self._type("widen_after", (Real, type(None)))
        self._one_of("choice", CHOICES)
        if self.fresh is not None and self.fresh < 1:
            self._fail("fresh", "an int >= 1 (at most n, the ranks) or None")
        if self.widen_after is not None and self.widen_after < 0:
            self._fail("widen_after", "seconds >= 0 or None")
        if self.max_staleness is not None and self.max_staleness < self.staleness:
            self._fail("max_staleness", f"None or >= staleness ({self.staleness})")


@dataclass(frozen=True, kw_only=True)
class AutoOptions(_Group):
    """``pgc_auto``'s switching rule (``scheme="auto"`` only; ``docs/guide.md``): it starts as ``dgd`` and switches
    to ignoring the ``s`` slowest ranks (``s`` up to ``max_stragglers``) and back, from the step times the leader
    measures, by a change-point test on the predicted saving.

    Args:
        max_stragglers: the largest ``s`` it may switch to.
        margin: the least relative gain a version must predict to count for a switch: the candidate must cost at
            most ``1 - margin`` of the current arm per unit of progress. Raise it if a run switches for gains too
            small to trust; lower it to catch smaller slowdowns.
        threshold: the predicted saving, summed over the versions since it began, that switches, in versions of
            the candidate's predicted step time. Lower it to switch sooner, raise it to need more evidence; one
            version alone never switches.
        horizon: versions over which the rate of stalls (one rank far slower than its neighbouring versions, for
            a few versions at most) is estimated; each arm's predicted cost includes what stalls add at that rate.
    """

    group: ClassVar[str] = "auto"

    max_stragglers: int = 1
    margin: float = 0.05
    threshold: float = 1.0
    horizon: int = 200

    def __post_init__(self) -> None:
        for name in ("max_stragglers", "horizon"):
            self._type(name, Integral)
            if getattr(self, name) < 1:
                self._fail(name, "an int >= 1")
        for name in ("margin", "threshold"):
            self._type(name, Real)
        if not 0 <= self.margin < 1:
            self._fail("margin", "in [0, 1)")
        if not (math.isfinite(self.threshold) and self.threshold > 0):
            self._fail(
                "threshold",
                "a finite number > 0 (versions of step time; 1 switches after about one "
                "version's worth of predicted saving)",
            )


@dataclass(frozen=True, kw_only=True)
class CodingOptions(_Group):
    """How each rank's code is built and decoded: the pipelined cache's warm-up, the staleness correction of the
    gradients it reuses, and the conditioning a Tandon decode may have.

    Args:
        warmup: the pipelined schemes (``pgc_fr``, ``pgc_cr``, ``pgc_cr_naive``) start with an empty cache:
            ``"full"`` evaluates every held partition at the first step (the paper; ``pgc_cr_naive`` needs it),
            ``"gradual"`` fills the cache over the first ``c`` steps at no extra cost (a staler start).
        staleness_correction: how the schemes that reuse stale gradients (``pgc_fr``, ``pgc_cr``, ``pgc_cr_naive``,
            ``bounded``) compensate for their age (:mod:`lightning_pgc.staleness`, ``docs/guide.md``, theory in
            ``docs/results/theory.md``); refused for the schemes without stale entries. ``"none"`` (the default:
            ``"lookahead"`` needed fewer steps wherever it was measured, but it copies the parameters to host
            memory at every step, see ``docs/guide.md``); ``"momentum"``: at fit start every param group's momentum
            ``m`` (``momentum``, or ``betas[0]``) becomes ``max(0, m - D / (1 + D))``, ``D`` the window's mean age
            (``(c - 1) / 2``; ``bounded``: ``(n - fresh) / n``), an optimizer without either is refused;
            ``"lookahead"``: the fresh gradient is computed at ``beta_t + lookahead_steps * (beta_t - beta_(t-1))``
            (two parameter vectors of memory); ``"delay_compensation"``: each cached gradient of version ``v`` is
            sent as ``g + dc_lambda * g * g * (beta_t - beta_v)`` (``c`` parameter vectors of memory plus, while
            encoding, a corrected copy of each stale entry; not for ``bounded``, whose stale entries are reused by
            the aggregator). The decode is unchanged (exact schemes stay exact for the entries they are sent).
        lookahead_steps: ``"lookahead"`` only: the extrapolation ``k``; ``None``: ``c - 1`` (the window's oldest
            age) for the pipelined schemes, the window's mean age ``(n - fresh) / n`` for ``bounded``
            (:func:`lightning_pgc.staleness.default_lookahead`).
        dc_lambda: ``"delay_compensation"`` only: ``lambda``; ``None``: 0.04.
        max_condition: the largest worst-case condition number accepted for the Tandon-coded cyclic schemes
            (``gc_cr``, ``pgc_cr_naive``): a configuration whose decode would lose more digits is refused.
    """

    group: ClassVar[str] = "coding"

    warmup: Literal["full", "gradual"] = "full"
    staleness_correction: Literal["none", "momentum", "lookahead", "delay_compensation"] = "none"
    lookahead_steps: Optional[float] = None
    dc_lambda: Optional[float] = None
    max_condition: float = 1e8

    def __post_init__(self) -> None:
        self._one_of("warmup", WARMUPS)
        self._one_of("staleness_correction", CORRECTIONS)
        self._type("lookahead_steps", (Real, type(None)))
        self._type("dc_lambda", (Real, type(None)))
        self._type("max_condition", Real)
        kind = self.staleness_correction
        if self.lookahead_steps is not None and (kind != "lookahead" or self.lookahead_steps < 0):
            self._fail("lookahead_steps", f"None, or >= 0 with staleness_correction='lookahead' (it is {kind!r})")
        if self.dc_lambda is not None and (kind != "delay_compensation" or self.dc_lambda < 0):
            self._fail("dc_lambda", f"None, or >= 0 with staleness_correction='delay_compensation' (it is {kind!r})")
        if not (math.isfinite(self.max_condition) and self.max_condition >= 1):
            self._fail("max_condition", "a finite number >= 1")


@dataclass(frozen=True, kw_only=True)
class LivenessOptions(_Group):
    """How the job notices dead, frozen and lagging ranks, and how long it goes on without them.

    Args:
        timeout: seconds the job may run with fewer live ranks than a version needs (``n - s``) before every rank
            fails with an error naming the missing ones; counted after the heartbeat window that detects a death.
            Slow steps never trigger it: liveness is the heartbeats, not progress. Raise it if frozen ranks are
            expected back (e.g. a preempted node that resumes). Lightning's collectives during fit (validation,
            checkpoints) also wait this long past the heartbeat window for a silent rank, then go on without it.
        max_lag: how many versions a rank may fall behind before it is detached: it stops receiving aggregates
            (its memory stays bounded) and, once back, catches up by state transfer; nobody waits for it.
            ``None``: as many as fit in 512 MiB, between ``c + 1`` and 1024. Lower it if a slow rank's memory grows
            (``buffer_stats['mailbox_high_water']``); raise it if ``rank_stats()[k]['rejoined']`` counts state
            transfers after short hiccups (each one costs a copy of the model and optimizer state).
        heartbeat_interval: seconds between heartbeats (every rank to the leader and back).
        heartbeat_misses: heartbeats a rank may miss before it counts as dead or frozen (it leaves the data group
            and rejoins by state transfer). Raise it if healthy ranks are reported missing, or ``PGC: rank k is
            missing`` or ``the leader (rank 0) is silent`` appears under heavy load (e.g. long GIL-holding
            callbacks, or checkpoints of a large model written in one go).
        failover: when rank 0 (the leader) dies, a live rank (the lowest, normally) takes over: the control plane,
            checkpoints, the loggers' runs and (``fork``/``spawn``) the fit's results; the job goes on as with any
            other dead rank (the log says ``... takes over``). A frozen leader (no heartbeat for a window) is
            replaced the same way; when it resumes it steps down and rejoins by state transfer, and writes nothing
            meanwhile. Under ``scheme="bounded"`` the successor rebuilds the table from the codes every rank keeps
            (its last ``staleness`` ones). ``None``: wherever it is available, i.e. not when rank 0 is the
            launching process (``start_method="popen"`` outside SLURM or torchrun): there rank 0's death ends the
            job, fast. ``True``: required (refused where unavailable); ``False``: the job ends whenever rank 0 dies.
    """

    group: ClassVar[str] = "liveness"

    timeout: float = 3.0
    max_lag: Optional[int] = None
    heartbeat_interval: float = 0.2
    heartbeat_misses: int = 15
    failover: Optional[bool] = None

    def __post_init__(self) -> None:
        self._type("timeout", Real)
        self._type("max_lag", (Integral, type(None)))
        self._type("heartbeat_interval", Real)
        self._type("heartbeat_misses", Integral)
        self._type("failover", (bool, type(None)))
        if not self.timeout > 0:
            self._fail("timeout", "positive seconds")
        if self.max_lag is not None and self.max_lag < 1:
            self._fail("max_lag", "an int >= 1 or None")
        if not self.heartbeat_interval > 0:
            self._fail("heartbeat_interval", "positive seconds")
        if self.heartbeat_misses < 1:
            self._fail("heartbeat_misses", "an int >= 1")


@dataclass(frozen=True, kw_only=True)
class DiagnosticsOptions(_Group):
    """The :class:`~lightning_pgc.PGCDiagnostics` callback the strategy attaches to a fit (the ``pgc/...``
    metrics). To configure the callback further, add your own ``PGCDiagnostics(...)`` to the Trainer's callbacks:
    the strategy then attaches none.

    Args:
        enabled: attach :class:`~lightning_pgc.PGCDiagnostics` unless one is already there.
        every_n_steps: steps between the probe-batch diagnostics (displacement, ``L_hat``).
    """

    group: ClassVar[str] = "diagnostics"

    enabled: bool = True
    every_n_steps: int = 25

    def __post_init__(self) -> None:
        self._type("enabled", bool)
        self._type("every_n_steps", Integral)
        if self.every_n_steps < 1:
            self._fail("every_n_steps", "an int >= 1")


#: Every group, by the parameter it is passed as.
GROUPS: dict[str, type[_Group]] = {
    cls.group: cls for cls in (CodingOptions, CoordinatorOptions, AutoOptions, LivenessOptions, DiagnosticsOptions)
}

G = TypeVar("G", bound=_Group)


def as_group(cls: type[G], value: Union[G, Mapping[str, Any]]) -> G:
    """``value`` as a ``cls``: the dataclass itself, or a dict of its fields (the others keep their defaults).

    Raises:
        TypeError: ``value`` is neither.
        ValueError: a key of the dict is not one of the group's fields, or a field's value is invalid.
    """
    if isinstance(value, cls):
        return value
    if isinstance(value, Mapping):
        names = [f.name for f in fields(cls)]  # type: ignore[arg-type]
        unknown = sorted(repr(k) for k in value if k not in names)
        if unknown:
            raise ValueError(
                f"PGCStrategy({cls.group}=...): unknown option {', '.join(unknown)}; "
                f"{cls.__name__} has {', '.join(names)}"
            )
        return cls(**value)
    raise TypeError(
        f"PGCStrategy({cls.group}=...) must be a {cls.__name__} or a dict of its fields, "
        f"got {type(value).__name__} {value!r}"
    )


def check_options(
    *,
    scheme: str,
    stragglers: int,
    seed: int,
    nonfinite: str,
    coding: CodingOptions,
    coordinator: CoordinatorOptions,
    auto: AutoOptions,
) -> None:
    """Check PGCStrategy's own arguments and what in the groups depends on the scheme.

    Raises:
        TypeError: an argument has the wrong type (``PGCStrategy(stragglers="1")``).
        ValueError: an argument is out of range, or a group's options do not apply to the scheme.
    """
    for name, value, types in (
        ("scheme", scheme, (str,)),
        ("stragglers", stragglers, (Integral,)),
        ("seed", seed, (Integral,)),
        ("nonfinite", nonfinite, (str,)),
    ):
        if isinstance(value, bool) or not isinstance(value, types):
            raise TypeError(
                f"PGCStrategy({name}=...) must be {types[0].__name__}, got {type(value).__name__} {value!r}"
            )
    if scheme not in STRATEGY_SCHEMES:
        raise ValueError(f"unknown scheme {scheme!r}; choose one of {', '.join(STRATEGY_SCHEMES)}")
    if stragglers < 0:
        raise ValueError(f"stragglers must be >= 0, got {stragglers}")
    if seed < 0:
        raise ValueError(f"seed must be >= 0, got {seed}")
    if nonfinite not in ("skip", "raise"):
        raise ValueError(f"nonfinite must be 'skip' or 'raise', got {nonfinite!r}")
    for group, only in ((coordinator, "bounded"), (auto, "auto")):
        given = group.changed()
        if scheme != only and given:
            raise ValueError(
                f"{group.group} options apply to scheme={only!r} only (scheme={scheme!r} uses `stragglers`), "
                f"got {group.group}={given!r}"
            )
    if scheme == "auto" and stragglers != 1:
        raise ValueError(
            f"scheme='auto' chooses s itself, up to auto.max_stragglers: pass auto={{'max_stragglers': {stragglers}}}, "
            "not stragglers"
        )
    if scheme == "pgc_cr_naive" and coding.warmup != "full":
        raise ValueError("pgc_cr_naive decodes Tandon codes and needs every cache entry: use coding.warmup='full'")
    kind = coding.staleness_correction
    if kind != "none" and scheme not in STALE_SCHEMES:
        raise ValueError(
            f"coding.staleness_correction={kind!r}: scheme {scheme!r} uses fresh gradients only, there is no "
            f"staleness to correct (the corrections apply to {', '.join(STALE_SCHEMES)})"
        )
    check_applies(kind, scheme)
