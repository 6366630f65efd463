"""Synthetic per-rank time sequences for ``scheme="auto"``'s switching rule, and the rule run over them (pure).

Times are 0.1 s per version times a log-normal jitter, as the leader receives them: one code per rank and version.
A switch is reported as the first version that runs the new arm; a delay counts from the first slow (or first
healthy) version to it. ``tests/test_auto_detect.py`` asserts on these runs and ``benchmarks/auto_detect.py``
reports them.
"""

from __future__ import annotations

import math
import random
from typing import Callable, Optional

from lightning_pgc.decisions.auto import AutoCandidate, AutoRule, FactorTable, candidates

#: (version, rng) -> every rank's own time at that version
Times = Callable[[int, random.Random], list[float]]
Switches = list[tuple[int, AutoCandidate]]


def jittered(n: int, rng: random.Random, sigma: float) -> list[float]:
    """``n`` healthy times: 0.1 s times a log-normal factor of ``sigma``."""
    return [0.1 * math.exp(rng.gauss(0.0, sigma)) for _ in range(n)]


def simulate(n: int, times: Times, versions: int, seed: int, **rule: float) -> Switches:
    """The rule (its defaults unless ``rule`` says, ``max_stragglers`` 1, the shipped table's entry for ``n``) fed
    ``versions`` versions of ``times``: its switches."""
    rng = random.Random(seed)
    auto = AutoRule(n, candidates(1), FactorTable.shipped(n), **rule)  # type: ignore[arg-type]
    out = []
    for v in range(versions):
        for rank, t in enumerate(times(v, rng)):
            auto.add(rank, v, t)
        decision = auto.step(v)
        if decision.switched:
            out.append((v + 1, decision.arm))
    return out


def healthy(n: int, sigma: float) -> Times:
    return lambda v, rng: jittered(n, rng, sigma)


def slow_spell(n: int, factor: float, start: int, end: Optional[int], seed: int, sigma: float = 0.05) -> Times:
    """Rank ``seed mod n`` ``factor`` times slower from version ``start`` to ``end`` (None: to the end)."""

    def times(v: int, rng: random.Random) -> list[float]:
        row = jittered(n, rng, sigma)
        if v >= start and (end is None or v < end):
            row[seed % n] *= factor
        return row

    return times


def rare_stalls(n: int, factor: float, seed: int, gaps: tuple[int, int] = (30, 50), sigma: float = 0.1) -> Times:
    """One rank (a random one each time) ``factor`` times slower for one version, every ``gaps`` versions."""
    plan = random.Random(1000 + seed)
    at, v = {}, 0
    while v < 100_000:
        v += plan.randint(*gaps)
        at[v] = plan.randrange(n)

    def times(u: int, rng: random.Random) -> list[float]:
        row = jittered(n, rng, sigma)
        if u in at:
            row[at[u]] *= factor
        return row

    return times


def random_stalls(n: int, factor: float, seed: int, rate: float = 1 / 40, sigma: float = 0.1) -> Times:
    """At each version, with probability ``rate``, one random rank ``factor`` times slower for that version (so two
    stalls, of one rank or two, may come in consecutive versions)."""
    plan = random.Random(2000 + seed)

    def times(u: int, rng: random.Random) -> list[float]:
        row = jittered(n, rng, sigma)
        if plan.random() < rate:
            row[plan.randrange(n)] *= factor
        return row

    return times


def most_in_any(switches: Switches, versions: int) -> int:
    """The most switches within any ``versions`` consecutive versions."""
    starts = [v for v, _ in switches]
    return max((sum(1 for b in starts if a <= b < a + versions) for a in starts), default=0)
