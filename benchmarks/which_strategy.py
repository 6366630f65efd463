"""Generate docs/which_strategy.json, the "which strategy should I use" rows, from a summary of the emulated map.

    python benchmarks/which_strategy.py                      # from docs/emulated_map_reduced.json
    python benchmarks/which_strategy.py --summary docs/emulated_map_full.json

One row per straggler pattern x compute/communication bound x data condition of the map (rows that agree over the
bound or the data condition are merged into "any"). A row's strategy is the winner of its cell at the largest n the
map has for it: an arm faster than ddp with a Holm-corrected p below the map's alpha; without one, ddp ("no arm
beats ddp separably"; for the pattern with no stragglers, "keep ddp"). lr and momentum are the winner's tuned
starting values. The default (pattern "don't know") is an arm that wins at least half of the cells it ran in and is
never separably slower than ddp (the one with the most wins); ddp when no arm does.
"""

from __future__ import annotations

import argparse
import json
import sys
from collections import Counter
from pathlib import Path
from typing import Any, Optional

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from lightning_pgc.emulator.cluster import PATTERNS  # noqa: E402

#: straggler pattern of the map -> how a user would describe it
USER_WORDS = {
    "none": "no stragglers",
    "lognormal": "every worker jitters a lot (log-normal, sigma 1.5)",
    "pareto": "rare very slow steps on any worker (Pareto tail)",
    "slow node": "one node is persistently slower",
    "node stalls": "whole nodes stall together now and then",
    "lognormal + stalls": "single workers stall for 10-30 s now and then",
}
EVIDENCE = "docs/benchmarks.md#emulated-crossover-map"


def _row(cell: dict[str, Any]) -> dict[str, Any]:
    c = cell["cell"]
    pattern, bound, data = c["pattern"], c["bound"], "iid" if c["data"] == "iid" else "skewed"
    win, ddp = cell["winner"], cell["ddp"]
    if win is not None:
        strategy, s, lr, momentum = win["strategy"], win["s"], win["lr"], win["momentum"]
    else:
        strategy, s, lr, momentum = "ddp", None, ddp["lr"], ddp["momentum"]
    words = USER_WORDS.get(pattern, pattern)
    if pattern == "none" and strategy == "ddp":
        words = "no stragglers: keep ddp"
    return {"pattern": words, "bound": bound, "data": data, "strategy": strategy, "s": s, "lr": lr,
            "momentum": momentum, "evidence": f"{EVIDENCE}-n{c['n']}", "_key": pattern, "_n": c["n"]}


def _merge(rows: list[dict[str, Any]], field: str) -> list[dict[str, Any]]:
    """Rows that differ only in ``field`` and agree on the advice become one row with ``field = "any"``."""
    groups: dict[tuple, list[dict[str, Any]]] = {}
    for r in rows:
        key = tuple((k, r[k]) for k in ("_key", "bound", "data") if k != field)
        groups.setdefault(key, []).append(r)
    out = []
    for group in groups.values():
        advice = {(r["strategy"], r["s"]) for r in group}
        if len(group) > 1 and len(advice) == 1:
            merged = dict(max(group, key=lambda r: r["_n"]))
            merged[field] = "any"
            out.append(merged)
        else:
            out.extend(group)
    return out


def build(summary: dict[str, Any], source: str) -> dict[str, Any]:
    cells = [c for c in summary["cells"] if c["complete"] and c["cell"]["pattern"] in PATTERNS]
    largest: dict[tuple, dict[str, Any]] = {}
    for cell in cells:
        c = cell["cell"]
        key = (c["pattern"], c["bound"], c["data"])
        if key not in largest or c["n"] > largest[key]["cell"]["n"]:
            largest[key] = cell
    rows = _merge(_merge([_row(c) for c in largest.values()], "bound"), "data")
    order = list(PATTERNS)
    rows.sort(key=lambda r: (order.index(r["_key"]), r["bound"], r["data"]))
    never_slower = {a["arm"] for c in cells for a in c["arms"]} - {a for c in cells for a in c["slower_than_ddp"]}
    ran = Counter(a["arm"] for c in cells for a in c["arms"])
    wins = Counter(c["winner"]["arm"] for c in cells if c["winner"] and c["winner"]["arm"] in never_slower)
    wins = Counter({arm: k for arm, k in wins.items() if 2 * k >= ran[arm]})
    default: Optional[dict[str, Any]] = None
    if wins:
        arm = wins.most_common(1)[0][0]
        example = next(a for c in cells for a in c["arms"] if a["arm"] == arm)
        default = {"strategy": example["strategy"], "s": example["s"], "lr": example["lr"],
                   "momentum": example["momentum"]}
    if default is None:
        ddps = [c["ddp"] for c in cells]
        common = Counter((d["lr"], d["momentum"]) for d in ddps).most_common(1)[0][0]
        default = {"strategy": "ddp", "s": None, "lr": common[0], "momentum": common[1]}
    for r in rows:
        del r["_key"], r["_n"]
    return {"source": source, "rows": rows,
            "default": {"pattern": "don't know", "bound": "any", "data": "any", **default, "evidence": EVIDENCE}}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--summary", type=Path, default=ROOT / "docs" / "emulated_map_reduced.json")
    parser.add_argument("--out", type=Path, default=ROOT / "docs" / "which_strategy.json")
    args = parser.parse_args(argv)
    summary = json.loads(args.summary.read_text())
    source = str(args.summary.resolve().relative_to(ROOT)) if args.summary.resolve().is_relative_to(ROOT) \
        else str(args.summary)
    args.out.write_text(json.dumps(build(summary, source), indent=1) + "\n")
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
