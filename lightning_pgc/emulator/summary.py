"""Summary of a round of the emulated map: per cell, each arm against ddp, with Holm's correction per cell.

Per arm: the chosen ``(lr, momentum)`` (and whether it sits on the edge of the tuning grid), how many evaluation
seeds reached each target, the restricted mean and the median time to each target (misses at the budget), and the
paired comparison with ddp on the same seeds (:func:`~lightning_pgc.emulator.scoring.compare`). The family of a
cell is every (arm, target) comparison with ddp; Holm-adjusted p-values are reported next to the raw ones. A cell's
*winner* is the arm with the smallest late-target ratio among those faster than ddp with an adjusted p below
``alpha``; without one, ddp holds (nothing beats it separably).
"""

from __future__ import annotations

import re
from collections import defaultdict
from typing import Any, Sequence

from lightning_pgc.emulator.scoring import compare, holm, median_censored, restricted_mean

__all__ = ["ALPHA", "CHECK_HEADING", "SCHEMES_HEADING", "cell_label", "n_heading", "slug", "summarize"]

ALPHA = 0.05


def cell_label(cell: dict[str, Any]) -> str:
    data = "iid" if cell["data"] == "iid" else f"dirichlet({cell['alpha']:g})"
    return f"n={cell['n']} | {cell['pattern']} | {cell['bound']} | {data} | {cell['task']}"


def _arm_summary(record: dict[str, Any]) -> dict[str, Any]:
    budget = record["budget_s"]
    ev = record["eval"]
    chosen = record["tuning"]["chosen"]
    protocol = record["protocol"]
    return {
        "arm": record["arm"]["label"],
        "strategy": record["arm"]["strategy"],
        "c": record["arm"]["c"],
        "s": record["arm"]["s"],
        "lr": chosen["lr"],
        "momentum": chosen["momentum"],
        "lr_at_grid_edge": chosen["lr"] in (min(protocol["lrs"]), max(protocol["lrs"])),
        "seeds": len(ev["time_late"]),
        "reached_early": sum(t is not None for t in ev["time_early"]),
        "reached_late": sum(t is not None for t in ev["time_late"]),
        "diverged": sum(bool(d) for d in ev["diverged"]),
        "rmean_early_s": restricted_mean(ev["time_early"], budget),
        "rmean_late_s": restricted_mean(ev["time_late"], budget),
        "median_late_s": median_censored(ev["time_late"], budget),
        "cpu_s": record.get("cpu_s"),
    }


def summarize(records: Sequence[dict[str, Any]], source: str, alpha: float = ALPHA) -> dict[str, Any]:
    """The round's summary (JSON-ready); cells without a ddp record are listed but not compared."""
    by_cell: dict[str, list[dict[str, Any]]] = defaultdict(list)
    for r in records:
        by_cell[cell_label(r["cell"])].append(r)
    cells = []
    for label, recs in by_cell.items():
        budget = recs[0]["budget_s"]
        arms = [_arm_summary(r) for r in recs]
        base = next((r for r in recs if r["arm"]["strategy"] == "ddp"), None)
        family: list[tuple[int, str, Any]] = []
        if base is not None:
            for i, r in enumerate(recs):
                if r["arm"]["strategy"] == "ddp":
                    continue
                for target in ("early", "late"):
                    comp = compare(r["eval"][f"time_{target}"], base["eval"][f"time_{target}"], budget)
                    family.append((i, target, comp))
        adjusted = holm([c.p for _, _, c in family]) if family else []
        for (i, target, comp), p_holm in zip(family, adjusted):
            arms[i][f"vs_ddp_{target}"] = {
                "ratio": comp.ratio,
                "low": comp.low,
                "high": comp.high,
                "p": comp.p,
                "p_holm": p_holm,
                "seeds": comp.seeds,
            }
        faster = [
            a
            for a in arms
            if a.get("vs_ddp_late") and a["vs_ddp_late"]["ratio"] < 1 and a["vs_ddp_late"]["p_holm"] < alpha
        ]
        slower = [
            a["arm"]
            for a in arms
            if a.get("vs_ddp_late") and a["vs_ddp_late"]["ratio"] > 1 and a["vs_ddp_late"]["p_holm"] < alpha
        ]
        winner = min(faster, key=lambda a: a["vs_ddp_late"]["ratio"]) if faster else None
        fastest = min(arms, key=lambda a: a["rmean_late_s"])
        cells.append(
            {
                "label": label,
                "cell": recs[0]["cell"],
                "budget_s": budget,
                "arms": arms,
                "complete": base is not None,
                "winner": None
                if winner is None
                else {k: winner[k] for k in ("arm", "strategy", "s", "c", "lr", "momentum")}
                | {
                    "ratio": winner["vs_ddp_late"]["ratio"],
                    "low": winner["vs_ddp_late"]["low"],
                    "high": winner["vs_ddp_late"]["high"],
                    "p_holm": winner["vs_ddp_late"]["p_holm"],
                },
                "fastest": fastest["arm"],
                "slower_than_ddp": slower,
                "ddp": next((a for a in arms if a["strategy"] == "ddp"), None),
            }
        )
    return {
        "source": source,
        "label": "emulated",
        "alpha": alpha,
        "correction": "Holm, per cell, over every (arm, target) comparison with ddp",
        "items_done": len(records),
        "cpu_s_total": sum(r.get("cpu_s", 0.0) for r in records),
        "cells": cells,
    }


#: headings of the summary's block in docs/benchmarks.md (``benchmarks/emulated_render.py`` writes them; README's guide,
#: ``benchmarks/which_strategy.py``, links to their anchors)
CHECK_HEADING = "### Emulated map: the check against the real 4-rank cells"
SCHEMES_HEADING = "### Emulated map: where each scheme wins and loses"


def n_heading(n: int) -> str:
    """The heading of the table of the cells with ``n`` workers."""
    return f"### Emulated map, {n} workers"


def slug(heading: str) -> str:
    """The anchor a heading gets (lower case, punctuation but ``-`` dropped, spaces to ``-``)."""
    return re.sub(r"[^\w\- ]", "", heading.lstrip("#").strip().lower()).replace(" ", "-")
