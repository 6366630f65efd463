"""Summary of a round of the emulated map: per cell, each arm against ddp, and the winner against its runner-up.

**Estimand.** One per comparison: the ratio of restricted mean times to the *late* target (misses at the budget), arm
over ddp, paired by seed (:func:`~lightning_pgc.emulator.scoring.compare`: bootstrap interval, paired permutation test
of that ratio). The early target is reported, never tested.

**Bounds.** An arm that missed the late target on every tuning setting and seed (the miss rule of
:func:`~lightning_pgc.emulator.cells.run_arm`), or on every evaluation seed, has a restricted mean that is only a
lower bound of its time: its ratio is labelled ``bound`` (a lower bound of the ratio of unrestricted means), it is
left out of the test family and it is never ranked. A cell where ddp missed on every evaluation seed ranks nothing.

**Family and winner.** The family of a cell is every ranked arm's late-target comparison with ddp; Holm's correction
runs over it. The cell's *winner* is the ranked arm with the smallest ratio among those faster than ddp with a
Holm-adjusted p below ``alpha``. **Runner-up.** At each ``s``, the best ranked arm (smallest restricted mean) is
compared with the next best at the same ``s`` on the same seeds (the same estimand and test, raw p); the winner's
row carries its own runner-up comparison. How sure the claim is (``sure``): ``separated`` when the winner beats ddp
after Holm and its runner-up at p < ``alpha``, ``not separated from the runner-up`` when only the first holds.
Winner and runner-up are picked by the same data that compares them, so the runner-up's p favours the winner; it is
a check that the order is not noise, not an unbiased test.

**Power.** Per cell, the median standard deviation of the ranked arms' per-seed log ratios against ddp gives the
smallest effect the family's test detects with 80 % power (:func:`~lightning_pgc.emulator.scoring.detectable_effect`)
and the seeds a 10 % effect needs (:func:`~lightning_pgc.emulator.scoring.required_seeds`).
"""

from __future__ import annotations

import re
import statistics
from collections import defaultdict
from typing import Any, Optional, Sequence

from lightning_pgc.emulator.machine import environments
from lightning_pgc.emulator.scoring import (
    compare,
    detectable_effect,
    holm,
    median_censored,
    required_seeds,
    restricted_mean,
)

__all__ = [
    "ALPHA",
    "CHECK_HEADING",
    "EFFECT",
    "POWER",
    "SCHEMES_HEADING",
    "cell_label",
    "is_bound",
    "n_heading",
    "slug",
    "summarize",
    "summarize_cell",
]

ALPHA = 0.05
#: the effect the map is sized to detect (a ratio of 0.9) and the power it is sized for
EFFECT, POWER = 0.1, 0.8


def cell_label(cell: dict[str, Any]) -> str:
    data = "iid" if cell["data"] == "iid" else f"dirichlet({cell['alpha']:g})"
    return f"n={cell['n']} | {cell['pattern']} | {cell['bound']} | {data} | {cell['task']}"


def is_bound(record: dict[str, Any]) -> Optional[str]:
    """Why the arm's ratio is a bound (``None``: a measurement): it missed the late target on every tuning setting,
    or on every evaluation seed."""
    if record["tuning"].get("missed_everywhere"):
        return "missed the late target on every tuning setting"
    if all(t is None for t in record["eval"]["time_late"]):
        return "missed the late target on every evaluation seed"
    return None


def _arm_summary(record: dict[str, Any]) -> dict[str, Any]:
    budget = record["budget_s"]
    ev = record["eval"]
    tuning = record["tuning"]
    chosen = tuning["chosen"]
    protocol = record["protocol"]
    losses = [x for x in ev.get("final_loss", []) if x is not None]
    return {
        "arm": record["arm"]["label"],
        "strategy": record["arm"]["strategy"],
        "c": record["arm"]["c"],
        "s": record["arm"]["s"],
        "correction": record["arm"].get("correction", "none"),
        "lr": chosen["lr"],
        "momentum": chosen["momentum"],
        "grid_lrs": tuning.get("lrs", protocol["lrs"]),
        "grid_momenta": tuning.get("momenta", protocol["momenta"]),
        "edge": tuning.get("edge", []),
        "missed_everywhere": bool(tuning.get("missed_everywhere", False)),
        "bound": is_bound(record),
        "seeds": len(ev["time_late"]),
        "reached_early": sum(t is not None for t in ev["time_early"]),
        "reached_late": sum(t is not None for t in ev["time_late"]),
        "diverged": sum(bool(d) for d in ev["diverged"]),
        "rmean_early_s": restricted_mean(ev["time_early"], budget),
        "rmean_late_s": restricted_mean(ev["time_late"], budget),
        "median_late_s": median_censored(ev["time_late"], budget),
        # versions applied to reach the late target (misses at the protocol's cap; None when half or more missed)
        "median_versions_late": median_censored(ev.get("versions_late", []), protocol["max_versions"])
        if ev.get("versions_late")
        else None,
        "final_loss_median": statistics.median(losses) if losses else None,
        "cpu_s": record.get("cpu_s"),
    }


def _comparison(comp: Any) -> dict[str, Any]:
    return {
        "ratio": comp.ratio,
        "low": comp.low,
        "high": comp.high,
        "p": comp.p,
        "seeds": comp.seeds,
        "sd_log": comp.sd_log,
    }


def summarize_cell(recs: Sequence[dict[str, Any]], alpha: float = ALPHA) -> dict[str, Any]:
    """One cell's summary (its records: one per arm, on the same evaluation seeds)."""
    budget = recs[0]["budget_s"]
    arms = [_arm_summary(r) for r in recs]
    by_label = {r["arm"]["label"]: r for r in recs}
    base = next((r for r in recs if r["arm"]["strategy"] == "ddp"), None)
    ddp_missed = base is not None and is_bound(base) is not None
    family: list[tuple[dict[str, Any], Any]] = []
    sds = []
    if base is not None:
        for a, r in zip(arms, recs):
            if a["strategy"] == "ddp":
                continue
            late = compare(r["eval"]["time_late"], base["eval"]["time_late"], budget)
            early = compare(r["eval"]["time_early"], base["eval"]["time_early"], budget)
            a["vs_ddp_late"] = _comparison(late) | {"p_holm": None}
            a["vs_ddp_early"] = _comparison(early)
            if a["bound"] is None and not ddp_missed:
                family.append((a, late))
                sds.append(late.sd_log)
    for (a, _), p_holm in zip(family, holm([c.p for _, c in family]) if family else []):
        a["vs_ddp_late"]["p_holm"] = p_holm
    ranked = [a for a, _ in family]
    faster = [a for a in ranked if a["vs_ddp_late"]["ratio"] < 1 and a["vs_ddp_late"]["p_holm"] < alpha]
    slower = [a["arm"] for a in ranked if a["vs_ddp_late"]["ratio"] > 1 and a["vs_ddp_late"]["p_holm"] < alpha]
    by_s: list[dict[str, Any]] = []
    for s_value in sorted({a["s"] for a in ranked}):
        at_s = sorted((a for a in ranked if a["s"] == s_value), key=lambda a: a["rmean_late_s"])
        row: dict[str, Any] = {"s": s_value, "best": at_s[0]["arm"], "runner_up": None, "vs_runner_up": None}
        if len(at_s) > 1:
            best, second = by_label[at_s[0]["arm"]], by_label[at_s[1]["arm"]]
            comp = compare(best["eval"]["time_late"], second["eval"]["time_late"], budget)
            row.update(runner_up=at_s[1]["arm"], vs_runner_up=_comparison(comp))
        by_s.append(row)
    winner: Optional[dict[str, Any]] = None
    if faster:
        w = min(faster, key=lambda a: a["vs_ddp_late"]["ratio"])
        own = next(row for row in by_s if row["s"] == w["s"])
        if own["best"] == w["arm"]:
            runner_up, vs = own["runner_up"], own["vs_runner_up"]
        else:  # an arm of the same s has a smaller mean but is not separably faster than ddp: that is the runner-up
            best = by_label[own["best"]]
            comp = compare(by_label[w["arm"]]["eval"]["time_late"], best["eval"]["time_late"], budget)
            runner_up, vs = own["best"], _comparison(comp)
        separated = vs is not None and vs["ratio"] < 1 and vs["p"] < alpha
        winner = {k: w[k] for k in ("arm", "strategy", "s", "c", "correction", "lr", "momentum")} | {
            "ratio": w["vs_ddp_late"]["ratio"],
            "low": w["vs_ddp_late"]["low"],
            "high": w["vs_ddp_late"]["high"],
            "p_holm": w["vs_ddp_late"]["p_holm"],
            "runner_up": runner_up,
            "vs_runner_up": vs,
            "sure": "separated" if separated else "not separated from the runner-up",
        }
    sd = statistics.median(sds) if sds else None
    power = None
    if sd is not None and base is not None:
        seeds = len(base["eval"]["time_late"])
        power = {
            "sd_log": sd,
            "seeds": seeds,
            "family": len(family),
            "detectable_effect": detectable_effect(sd, seeds, len(family), alpha, POWER),
            "seeds_for_effect": required_seeds(sd, EFFECT, len(family), alpha, POWER),
        }
    rankable = ranked + ([a for a in arms if a["strategy"] == "ddp"] if not ddp_missed else [])
    return {
        "label": cell_label(recs[0]["cell"]),
        "cell": recs[0]["cell"],
        "budget_s": budget,
        "arms": arms,
        "complete": base is not None,
        "ddp_missed": ddp_missed,
        "family": len(family),
        "bounds": [a["arm"] for a in arms if a["bound"] is not None],
        "by_s": by_s,
        "winner": winner,
        "fastest": min(rankable, key=lambda a: a["rmean_late_s"])["arm"] if rankable else None,
        "slower_than_ddp": slower,
        "power": power,
        "ddp": next((a for a in arms if a["strategy"] == "ddp"), None),
    }


def summarize(records: Sequence[dict[str, Any]], source: str, alpha: float = ALPHA) -> dict[str, Any]:
    """The round's summary (JSON-ready); cells without a ddp record are listed but not compared."""
    by_cell: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_cell[cell_label(r["cell"])].append(r)
    cells = [summarize_cell(recs, alpha) for recs in by_cell.values()]
    return {
        "source": source,
        "label": "emulated",
        "alpha": alpha,
        "estimand": "ratio of restricted mean time to the late target, arm over ddp, paired by seed",
        "test": "paired permutation test of the ratio (swaps within seeds); 95 % paired bootstrap interval",
        "correction": "Holm, per cell, over every ranked arm's late-target comparison with ddp",
        "power": f"normal approximation, Holm's first step; {POWER:.0%} power for a {EFFECT:.0%} effect",
        "items_done": len(records),
        "cpu_s_total": sum(r.get("cpu_s", 0.0) for r in records),
        "environments": environments(records),
        "cells": cells,
    }


#: headings of the summary's block in docs/results/benchmarks.md (``benchmarks/emulated_render.py`` writes them; README's guide,
#: ``benchmarks/which_strategy.py``, links to their anchors)
CHECK_HEADING = "### Emulated map: the check against the real 4-rank cells"
SCHEMES_HEADING = "### Emulated map: where each scheme wins and loses"


def n_heading(n: int) -> str:
    """The heading of the table of the cells with ``n`` workers."""
    return f"### Emulated map, {n} workers"


def slug(heading: str) -> str:
    """The anchor a heading gets (lower case, punctuation but ``-`` dropped, spaces to ``-``)."""
    return re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")
