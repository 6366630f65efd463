"""How fast ``scheme="auto"``'s rule detects a slowness and how rarely it switches otherwise, on synthetic per-rank
times (pure, seconds on one core):

    python benchmarks/auto_detect.py

The rule runs with its defaults and the shipped factor table (:mod:`pgc_lab.auto_scenarios`; the goals are asserted
by ``tests/test_auto_detect.py``), 6 seeds per case:

* slow spells: one rank ``factor`` times slower for versions 30-89 of 150, jitter 5 % (log-normal sigma), n = 2, 4,
  8 and 16: the versions from the first slow version to the first under ``ignore_stragglers``, and from the first
  healthy one to the first under ``dgd`` again;
* heavier jitter (10 %) with a rank 2x, 3x or 10x slower from version 30 on;
* healthy runs, 500 versions, jitter 5 % and 10 %: switches;
* rare stalls, 600 versions: one random rank 10x or 30x slower for one version every 30-50 versions, and (12
  seeds) at independent random versions at a rate of one per 40: switches, and the most within any 50 versions.

Writes docs/results/auto_detect.json.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Optional

from pgc_lab.auto_scenarios import Switches, healthy, most_in_any, random_stalls, rare_stalls, simulate, slow_spell

from lightning_pgc.strategy.options import AutoOptions

ROOT = Path(__file__).resolve().parent.parent
OUT = ROOT / "docs" / "results" / "auto_detect.json"
SEEDS = range(6)
NS = (2, 4, 8, 16)
SPELL = (30, 90)  # the slow versions of a spell: from the first to before the second
HEALTHY_RUN, STALL_RUN, GAPS, PER = 500, 600, (30, 50), 50
RATE, RANDOM_SEEDS = 1 / 40, range(12)  # stalls at independent random versions


def _delay(switches: Switches, index: int, since: int) -> Optional[int]:
    return switches[index][0] - since if len(switches) > index else None


def _spell(n: int, factor: float, sigma: float, end: Optional[int], versions: int) -> dict[str, Any]:
    """One case over the seeds: a rank slow from ``SPELL[0]`` to ``end`` (None: to the end of the run)."""
    runs = [simulate(n, slow_spell(n, factor, SPELL[0], end, seed, sigma=sigma), versions, seed) for seed in SEEDS]
    row = {"n": n, "factor": factor, "sigma": sigma, "switches": [len(s) for s in runs]}
    row["into"] = [_delay(s, 0, SPELL[0]) for s in runs]
    if end is not None:
        row["back"] = [_delay(s, 1, end) for s in runs]
    return row


def spells() -> list[dict[str, Any]]:
    out = []
    for n in NS:
        out += [_spell(n, factor, 0.05, SPELL[1], 150) for factor in (1.4, 2.0, 3.0, 5.0, 10.0)]
        out += [_spell(n, factor, 0.1, None, 120) for factor in (2.0, 3.0, 10.0)]
    return out


def quiet() -> dict[str, Any]:
    runs = {
        "healthy": [
            {
                "n": n,
                "sigma": sigma,
                "switches": [len(simulate(n, healthy(n, sigma), HEALTHY_RUN, seed)) for seed in SEEDS],
            }
            for n in NS
            for sigma in (0.05, 0.1)
        ],
        "stalls": [],
        "random_stalls": [],
    }
    for n in NS:
        for factor in (10.0, 30.0):
            found = [simulate(n, rare_stalls(n, factor, seed, GAPS), STALL_RUN, seed) for seed in SEEDS]
            scattered = [simulate(n, random_stalls(n, factor, seed, RATE), STALL_RUN, seed) for seed in RANDOM_SEEDS]
            runs["random_stalls"].append(
                {
                    "n": n,
                    "factor": factor,
                    "switches": [len(s) for s in scattered],
                    "most_in_50": max(most_in_any(s, PER) for s in scattered),
                }
            )
            runs["stalls"].append(
                {
                    "n": n,
                    "factor": factor,
                    "versions": STALL_RUN,
                    "switches": [len(s) for s in found],
                    "most_in_50": max(most_in_any(s, PER) for s in found),
                }
            )
    return runs


def main() -> None:
    defaults = AutoOptions()
    result = {
        "command": "python benchmarks/auto_detect.py",
        "rule": {"margin": defaults.margin, "threshold": defaults.threshold, "horizon": defaults.horizon},
        "seeds": len(SEEDS),
        "setup": {
            "slow_versions": [SPELL[0], SPELL[1] - 1],
            "spell_run": 150,
            "healthy_run": HEALTHY_RUN,
            "stall_run": STALL_RUN,
            "stall_gaps": list(GAPS),
            "random_stall_rate": RATE,
            "random_stall_seeds": len(RANDOM_SEEDS),
            "per_versions": PER,
            "jitter": [0.05, 0.1],
        },
        "spells": spells(),
        **quiet(),
    }
    OUT.write_text(json.dumps(result, indent=1) + "\n")
    for row in result["spells"]:
        print(row)
    for row in result["healthy"] + result["stalls"] + result["random_stalls"]:
        print(row)


if __name__ == "__main__":
    main()
