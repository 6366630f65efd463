"""Cluster models: per-step delay patterns that look like clusters, and compute-to-communication ratios.

Times are in units of one partition gradient's compute, ``COMPUTE_S`` = 0.1 s (a GPU forward and backward of one
mini-batch). A cluster is ``(pattern, ratio)``:

- ``ratio`` = compute of one partition gradient / communication per step, where communication is the code's
  trip to the leader plus the aggregate's trip back (``Costs.code_s + Costs.aggregate_s``, split evenly).
  :data:`RATIOS`: ``compute`` = 4 (a large model's step dominated by compute), ``comm`` = 0.5 (gradients of a
  communication-bound model: moving them takes twice a gradient's compute).
- ``pattern`` is one of :data:`PATTERNS`, built for ``n`` workers by :func:`delay_model`; every pattern but
  ``none`` carries log-normal jitter, and each is a :class:`~lightning_pgc.delays.DelayModel`, so the
  simulated clock draws it exactly as :class:`~lightning_pgc.StragglerInjector` would sleep it.

Pure: numpy only (no Lightning at run time, no torch.distributed).
"""

from __future__ import annotations

import bisect
import functools
import math
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Optional

import numpy as np

from lightning_pgc.emulator.clock import Costs
from lightning_pgc.emulator.traces import TraceDelays, block_length, load_trace, trace_delays
from lightning_pgc.delays import DelayModel, LogNormal, NoDelay, SlowRanks, Spikes, SumDelay, parse_delay

__all__ = [
    "COMPUTE_S",
    "NODE_PATTERNS",
    "NODE_SIZE",
    "PATTERNS",
    "RATIOS",
    "TRACE_PREFIX",
    "Cluster",
    "NodeStalls",
    "Pareto",
    "SlowSpells",
    "costs_for",
    "delay_model",
    "node_size",
    "trace_delay_model",
]

COMPUTE_S = 0.1  #: seconds of one partition gradient's compute
NODE_SIZE = 8  #: workers per node (a node stall stops all of them at once)
RATIOS: dict[str, float] = {"compute": 4.0, "comm": 0.5}  #: compute per gradient / communication per step


class Pareto(DelayModel):
    """Heavy-tailed delays: ``scale * X`` with ``X`` Lomax (Pareto II) of shape ``alpha``: ``P(X > x) = (1+x)^-alpha``;
    mean ``scale / (alpha - 1)`` for ``alpha > 1`` (infinite variance for ``alpha <= 2``)."""

    name = "pareto"

    def __init__(self, scale: float, alpha: float) -> None:
        if not (math.isfinite(scale) and scale >= 0):
            raise ValueError(f"pareto scale must be finite and >= 0 seconds, got {scale!r}")
        if not (math.isfinite(alpha) and alpha > 0):
            raise ValueError(f"pareto alpha must be finite and > 0, got {alpha!r}")
        self.scale, self.alpha = float(scale), float(alpha)

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        return self.scale * float(rng.pareto(self.alpha))

    def mean_seconds(self, rank: int) -> float:
        return self.scale / (self.alpha - 1) if self.alpha > 1 else math.inf

    def scaled(self, factor: float) -> "Pareto":
        return Pareto(self.scale * factor, self.alpha)

    def _params(self) -> dict[str, Any]:
        return {"scale": self.scale, "alpha": self.alpha}


class NodeStalls(DelayModel):
    """Correlated stalls: at each step, each node of ``node_size`` consecutive workers stalls with probability
    ``prob`` for ``seconds``, all its workers at once. The draw depends on ``(seed, node, step)`` only, so every
    worker of a node sees the same stall."""

    name = "nodestalls"

    def __init__(self, prob: float, seconds: float, node_size: int = NODE_SIZE, seed: int = 0) -> None:
        if not 0 <= prob <= 1:
            raise ValueError(f"nodestalls prob must be in [0, 1], got {prob!r}")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"nodestalls seconds must be finite and >= 0, got {seconds!r}")
        if isinstance(node_size, bool) or not isinstance(node_size, int) or node_size < 1:
            raise ValueError(f"node_size must be an int >= 1, got {node_size!r}")
        self.prob, self.seconds, self.node_size, self.seed = float(prob), float(seconds), node_size, int(seed)

    def stalled(self, node: int, step: int) -> bool:
        """Whether ``node`` stalls at ``step``."""
        return bool(np.random.default_rng([self.seed, 104729, node, step]).random() < self.prob)

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        return self.seconds if self.stalled(rank // self.node_size, step) else 0.0

    def mean_seconds(self, rank: int) -> float:
        return self.prob * self.seconds

    def scaled(self, factor: float) -> "NodeStalls":
        return NodeStalls(self.prob, self.seconds * factor, self.node_size, self.seed)

    def _params(self) -> dict[str, Any]:
        return {"prob": self.prob, "seconds": self.seconds, "node_size": self.node_size, "seed": self.seed}


class SlowSpells(DelayModel):
    """Temporally correlated slowness: every worker alternates between normal spells (mean ``normal_steps`` steps)
    and slow spells (mean ``slow_steps``) in which it is ``seconds`` slower on every step; spell lengths are
    geometric. The spells of a worker depend on ``(seed, worker)`` only (drawn once, then read per step), so a
    slow spell lasts across steps as a degraded machine or a noisy neighbour does, and every scheme sees the same
    spells."""

    name = "slowspells"

    def __init__(self, normal_steps: float, slow_steps: float, seconds: float, seed: int = 0) -> None:
        for label, value in (("normal_steps", normal_steps), ("slow_steps", slow_steps)):
            if not (math.isfinite(value) and value >= 1):
                raise ValueError(f"slowspells {label} must be a finite number >= 1 step, got {value!r}")
        if not (math.isfinite(seconds) and seconds >= 0):
            raise ValueError(f"slowspells seconds must be finite and >= 0, got {seconds!r}")
        self.normal_steps, self.slow_steps = float(normal_steps), float(slow_steps)
        self.seconds, self.seed = float(seconds), int(seed)
        self._bounds: dict[int, list[int]] = {}  # worker -> ends of its spells so far (normal first, alternating)

    def slow(self, rank: int, step: int) -> bool:
        """Whether ``rank`` is in a slow spell at ``step``."""
        bounds = self._bounds.setdefault(rank, [])
        while not bounds or bounds[-1] <= step:  # spell i's length: a function of (seed, rank, i) only
            mean = self.normal_steps if len(bounds) % 2 == 0 else self.slow_steps
            rng = np.random.default_rng([self.seed, 7727, rank, len(bounds)])
            bounds.append((bounds[-1] if bounds else 0) + int(rng.geometric(1.0 / mean)))
        return bisect.bisect_right(bounds, step) % 2 == 1

    def sample(self, rank: int, step: int, rng: np.random.Generator) -> float:
        return self.seconds if self.slow(rank, step) else 0.0

    def mean_seconds(self, rank: int) -> float:
        return self.seconds * self.slow_steps / (self.normal_steps + self.slow_steps)

    def scaled(self, factor: float) -> "SlowSpells":
        return SlowSpells(self.normal_steps, self.slow_steps, self.seconds * factor, self.seed)

    def _params(self) -> dict[str, Any]:
        return {
            "normal_steps": self.normal_steps,
            "slow_steps": self.slow_steps,
            "seconds": self.seconds,
            "seed": self.seed,
        }


#: Straggler patterns (user words -> what :func:`delay_model` builds; seconds, with 0.1 s per gradient).
PATTERNS: dict[str, str] = {
    "none": "no delay",
    "lognormal": "log-normal jitter, median 0.02 s, sigma 1.5, every worker every step",
    "pareto": "Pareto tail: 0.02 s x Lomax(alpha=1.5) per worker and step (infinite variance)",
    "slow node": "jitter (median 0.02 s, sigma 0.5) + one persistent slow node (the last min(8, n/4) workers) "
    "0.2 s slower every step",
    "node stalls": "jitter (median 0.02 s, sigma 0.5) + each node of min(8, n/4) workers stalls 1 s, all at once, "
    "with probability 0.02 per step",
    "lognormal + stalls": "jitter (median 0.02 s, sigma 0.5) + 10-30 s stalls of single workers, probability "
    "0.0005 per worker and step",
    "rank stalls": "jitter (median 0.02 s, sigma 0.5) + 1-3 s stalls of single workers, probability 0.01 per "
    "worker and step",
    "slow spells": "jitter (median 0.02 s, sigma 0.5) + every worker alternates between normal spells (mean 300 "
    "steps) and slow spells (mean 100 steps) in which it is 0.3 s slower every step",
}
#: the patterns whose slowness is a node's (min(8, n/4) workers at once): a scheme bypasses them only with s at or
#: above the node size
NODE_PATTERNS: tuple[str, ...] = ("slow node", "node stalls")


def node_size(n: int) -> int:
    """Workers per node in a cluster of ``n``: ``min(NODE_SIZE, n / 4)``, at least 1."""
    return max(1, min(NODE_SIZE, n // 4))


#: prefix of the pattern that replays a recorded step trace: ``"trace:" + path of a trace.json``
TRACE_PREFIX = "trace:"


def _jitter(sigma: float = 0.5) -> LogNormal:
    return LogNormal(median=0.02, sigma=sigma)


def delay_model(pattern: str, n: int, seed: int = 0) -> DelayModel:
    """The delay model of ``pattern`` (a key of :data:`PATTERNS`, or ``"trace:PATH"``: a step trace replayed by
    block resampling, :func:`trace_delay_model`) for ``n`` workers (``seed``: node
    stalls' draw, a trace's block starts).

    Raises:
        ValueError: an unknown pattern or ``n < 2``.
    """
    if n < 2:
        raise ValueError(f"n must be >= 2 workers, got {n}")
    node = node_size(n)
    if pattern == "none":
        return NoDelay()
    if pattern == "lognormal":
        return _jitter(1.5)
    if pattern == "pareto":
        return Pareto(scale=0.02, alpha=1.5)
    if pattern == "slow node":
        return SumDelay([_jitter(), SlowRanks(ranks=list(range(n - node, n)), seconds=0.2)])
    if pattern == "node stalls":
        return SumDelay([_jitter(), NodeStalls(prob=0.02, seconds=1.0, node_size=node, seed=seed)])
    if pattern == "lognormal + stalls":
        return SumDelay([_jitter(), Spikes(prob=0.0005, low=10.0, high=30.0)])
    if pattern == "rank stalls":
        return SumDelay([_jitter(), Spikes(prob=0.01, low=1.0, high=3.0)])
    if pattern == "slow spells":
        return SumDelay([_jitter(), SlowSpells(normal_steps=300, slow_steps=100, seconds=0.3, seed=seed)])
    if pattern.startswith(TRACE_PREFIX):  # a recorded step trace, block-resampled (emulator/traces.py)
        return trace_delay_model(pattern[len(TRACE_PREFIX) :], n, seed)
    raise ValueError(f"unknown straggler pattern {pattern!r}; valid: {', '.join(PATTERNS)}")


def trace_delay_model(path: str | Path, n: int, seed: int = 0, compute_s: Optional[float] = None) -> TraceDelays:
    """The delay pattern ``"trace:PATH"`` of the map for ``n`` workers: the trace's delays, block-resampled with its
    :func:`~lightning_pgc.emulator.traces.block_length`, scaled so that its typical step is ``compute_s`` (default:
    the map's ``COMPUTE_S``).

    Raises:
        ValueError: ``n < 2``, or the file is not a step trace.
    """
    if n < 2:
        raise ValueError(f"n must be >= 2 workers, got {n}")
    if compute_s is None:
        compute_s = COMPUTE_S
    path = Path(path).resolve()
    stat = path.stat()
    own, block = _trace_file(str(path), stat.st_mtime_ns, stat.st_size)
    typical, delays = trace_delays(own)
    return TraceDelays(delays * (compute_s / typical), block, seed)


@functools.lru_cache(maxsize=16)
def _trace_file(path: str, mtime_ns: int, size: int) -> tuple[np.ndarray, int]:
    """A trace file's own times and block length, cached by its path and its version (modification time, size)."""
    own = load_trace(path).own
    return own, block_length(own)


def costs_for(ratio: float, compute_s: float = COMPUTE_S) -> Costs:
    """Simulated-clock costs with ``compute_s`` per gradient and ``compute_s / ratio`` of communication per step
    (half to the leader, half back).

    Raises:
        ValueError: ``ratio <= 0``.
    """
    if not (math.isfinite(ratio) and ratio > 0):
        raise ValueError(f"compute-to-communication ratio must be a finite number > 0, got {ratio!r}")
    comm = compute_s / ratio
    return Costs(compute_s=compute_s, code_s=comm / 2, aggregate_s=comm / 2)


@dataclass(frozen=True)
class Cluster:
    """``n`` workers with straggler ``pattern`` and compute-to-communication ``bound`` (a key of :data:`RATIOS`),
    or an explicit ``delay`` spec and ``costs`` (the 4-rank cells that mirror the real measurements)."""

    n: int
    pattern: str
    bound: str = "compute"
    delay: Optional[str] = None
    costs: Optional[Costs] = None

    def delay_model(self, seed: int) -> DelayModel:
        if self.delay is not None:
            return parse_delay(self.delay.replace("{last}", str(self.n - 1)))
        return delay_model(self.pattern, self.n, seed)

    def clock_costs(self) -> Costs:
        if self.costs is not None:
            return self.costs
        if self.bound not in RATIOS:
            raise ValueError(f"bound must be one of {list(RATIOS)}, got {self.bound!r}")
        return costs_for(RATIOS[self.bound])
